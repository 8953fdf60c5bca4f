"""The node's parts, in-process, through their public interfaces: the sync plan, the pacer on
a fake clock, the round state's legal moves, and one round's summary as /status, /history
and the metrics show it. No network: these are the decisions, tested case by case."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from pathlib import Path

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dtnode.daemon.catchup.sync_plan import LocalPosition, SyncAction, plan_sync
from dtnode.daemon.checkpoints.arrivals import (
    DETAIL_CHARS,
    PASSED_OVER_LIMIT,
    Arrivals,
    Download,
    DroppedRound,
    FetchMiss,
    Skip,
    Skipped,
    ThetaArrival,
    ThetaSource,
)
from dtnode.daemon.config.settings import NodeSettings
from dtnode.daemon.records.report import Condition, RoundOutcome, RoundSummary, RunStats
from dtnode.daemon.records.state import IllegalTransition, NodeState, Publisher, RecordPhase, RoundPhase, RoundState
from dtnode.daemon.records.status import NodeStatus, SyncMiss
from dtnode.daemon.rounds.pacer import SHARE_SLACK, TIME_BUDGET_RANGE, FixedPacer, SwarmPacer
from dtnode.daemon.rounds.strategies import left_off_the_swarm
from dtnode.daemon.telemetry.metrics import NodeMetrics
from dtnode.daemon.training.trainer import InnerResult
from dtnode.daemon.workload.recipe import recipe_of
from dtnode.peers.averager import AveragingResult, HopReport
from dtnode.peers.membership import PeerRecord

MODEL = "m" * 16


def _peer(
    name: str,
    step: int,
    phase: str = "inner",
    round_no: int | None = None,
    state: str = "training",
    checkpoint: int = -1,
    model: str = MODEL,
) -> PeerRecord:
    """A peer training (or averaging, or applying) round `round_no` from θ_g of `step`."""
    round_no = step if round_no is None else round_no
    return PeerRecord(
        peer_id=name,
        outer_step=step,
        state=state,
        round=round_no,
        phase=phase,
        round_checkpoint=step,
        checkpoint_step=checkpoint,
        model_hash=model,
    )


def _local(step: int, **kw) -> LocalPosition:
    return LocalPosition("me", MODEL, step, **kw)


# ---- plan_sync --------------------------------------------------------------------------------
def test_a_node_in_the_swarms_open_round_trains_on():
    view = {p.peer_id: p for p in (_peer("a", 5), _peer("b", 5))}
    plan = plan_sync(view, _local(5))
    assert plan.action == SyncAction.IN_STEP and plan.position is not None and plan.position.round == 5


def test_behind_by_one_step_it_downloads_the_step_the_open_round_starts_from():
    view = {p.peer_id: p for p in (_peer("a", 5), _peer("b", 5))}
    plan = plan_sync(view, _local(4))
    assert plan.action == SyncAction.DOWNLOAD and plan.step == 5 and not plan.ahead
    assert plan_sync(view, _local(4, max_lag=1)).action == SyncAction.IN_STEP  # --max-lag 1 tolerates it


def test_behind_by_many_steps_it_downloads_the_swarms_median_not_a_racer():
    racer = _peer("racer", 40)  # one node that went ahead alone must not pull the swarm onto its branch
    view = {p.peer_id: p for p in (_peer("a", 12), _peer("b", 12), racer)}
    plan = plan_sync(view, _local(0))
    assert plan.action == SyncAction.DOWNLOAD and plan.step == 12


def test_ahead_of_the_swarm_it_gives_up_its_solo_rounds_for_the_swarms_state():
    view = {p.peer_id: p for p in (_peer("a", 5), _peer("b", 5))}
    assert plan_sync(view, _local(6)).action == SyncAction.IN_STEP  # a round ahead: finishing its outer step
    plan = plan_sync(view, _local(9))
    assert plan.action == SyncAction.DOWNLOAD and plan.ahead and plan.step == 5


def test_a_node_that_is_half_the_swarm_keeps_its_rounds():
    """In a pair whose other host restarted at an older step, the host that trained on is as
    much the swarm as it: it keeps its rounds, and the restarted one downloads them. A swarm
    split evenly between two steps goes to the newer one from both sides."""
    restarted = {"b": _peer("b", 3)}
    assert plan_sync(restarted, _local(5)).action == SyncAction.IN_STEP
    trained_on = {"a": _peer("a", 5)}
    plan = plan_sync(trained_on, LocalPosition("b", MODEL, 3))
    assert plan.action == SyncAction.DOWNLOAD and plan.step == 5 and not plan.ahead
    split = {p.peer_id: p for p in (_peer("a", 9), _peer("b", 5), _peer("c", 5))}
    assert plan_sync(split, _local(9)).action == SyncAction.IN_STEP  # 9, 9 against 5, 5
    assert plan_sync(split, LocalPosition("c", MODEL, 5)).step == 9  # a 5 of the same split goes to 9
    outvoted = {p.peer_id: p for p in (_peer("b", 5), _peer("c", 5))}
    assert plan_sync(outvoted, _local(9)).ahead  # one against two: its solo rounds are a branch


def test_in_the_outer_phase_the_round_is_closed_and_it_waits_for_the_next_rounds_theta():
    # both peers averaged round 5 and are applying its outer step: round 6 is the open one,
    # and its θ_g (step 6) is not served by anyone yet
    view = {p.peer_id: p for p in (_peer("a", 5, "outer"), _peer("b", 5, "averaging", state="averaging"))}
    plan = plan_sync(view, _local(5))
    assert plan.action == SyncAction.WAIT and plan.position is not None and plan.position.round == 6
    assert plan.step == 6
    late = plan_sync(view, _local(5, waited_too_long=True))
    assert late.action == SyncAction.GIVE_UP and late.waited_too_long
    # once a peer holds step 6 the node downloads it
    ready = dict(view, a=_peer("a", 6, "inner"))
    assert plan_sync(ready, _local(5)).action == SyncAction.DOWNLOAD
    # ...but not while only a --client-mode peer does, which serves nobody (the download found no
    # donor, and the node, restarted gracefully while the swarm averaged, trained that round alone)
    client = _peer("a", 6, "inner").model_copy(update={"client_mode": True})
    assert plan_sync(dict(view, a=client), _local(5)).action == SyncAction.WAIT


def test_a_round_only_client_mode_peers_stand_at_is_not_waited_for():
    """A --client-mode peer that raced ahead alone (after a split) serves no checkpoint, and no
    donor holds or makes its θ_g: the node trains on at once instead of waiting --join-timeout
    for a file nobody will serve (seen: 120 s, round after round, in a pair with such a peer)."""
    racer = _peer("nat", 196, "inner").model_copy(update={"client_mode": True})
    plan = plan_sync({"nat": racer}, _local(12))
    assert plan.action == SyncAction.GIVE_UP and plan.unservable and not plan.waited_too_long
    behind = _peer("late", 0, "inner")  # a donor far behind makes no step-196 θ_g either
    assert plan_sync({"nat": racer, "late": behind}, _local(12)).unservable
    # a donor closing the round before it will make that θ_g: that is waited for
    closing = _peer("d", 195, "averaging", state="averaging")
    plan = plan_sync({"nat": racer, "d": closing}, _local(12))
    assert plan.action == SyncAction.WAIT and plan.step == 196


def test_no_donor_means_no_swarm_and_too_many_downloads_give_up():
    assert plan_sync({}, _local(3)).action == SyncAction.NO_SWARM
    others = {"x": _peer("x", 9, model="other"), "s": _peer("s", 9, state="stopped")}
    assert plan_sync(others, _local(3)).action == SyncAction.NO_SWARM  # another model, a stopped peer: no donors
    view = {p.peer_id: p for p in (_peer("a", 5), _peer("b", 5))}
    plan = plan_sync(view, _local(2, downloads=3))
    assert plan.action == SyncAction.GIVE_UP and not plan.waited_too_long


def test_a_download_that_found_no_donor_is_asked_again_a_heartbeat_later_unless_the_round_moved():
    """The swarm's θ_g of step 5 is made but not served yet (its donors still hash it, or no
    majority holds it): the node asks again later instead of training round 5 alone (seen on
    a graceful restart while the swarm averaged); a round that moved meanwhile is downloaded at
    once, and the downloads still run out."""
    view = {p.peer_id: p for p in (_peer("a", 5), _peer("b", 5))}
    again = plan_sync(view, _local(4, downloads=1, failed_step=5))
    assert again.action == SyncAction.RETRY and again.step == 5
    assert plan_sync(view, _local(4, downloads=1)).action == SyncAction.DOWNLOAD  # after the pause
    moved = {p.peer_id: p for p in (_peer("a", 6), _peer("b", 6))}
    plan = plan_sync(moved, _local(4, downloads=1, failed_step=5))
    assert plan.action == SyncAction.DOWNLOAD and plan.step == 6
    assert plan_sync(view, _local(4, downloads=3, failed_step=5)).action == SyncAction.GIVE_UP
    assert plan_sync(view, _local(5, failed_step=5)).action == SyncAction.IN_STEP  # in step after all


# ---- the pacer --------------------------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_swarm_pacer_ends_the_round_when_the_swarms_tokens_reach_the_target():
    clock = FakeClock()
    own = PeerRecord(
        peer_id="me",
        outer_step=3,
        state="training",
        round_tokens=0,
        tokens_per_s=100.0,
        tokens_per_step=100,
        progress_at=clock.now,
    )
    other = PeerRecord(
        peer_id="b",
        outer_step=3,
        state="training",
        round_tokens=0,
        tokens_per_s=300.0,
        tokens_per_step=100,
        progress_at=clock.now,
    )
    records = {"b": other}

    async def view() -> dict[str, PeerRecord]:
        return records

    coin = [0.5]  # the straddling step's draw
    pacer = SwarmPacer(
        view, lambda: own, inner_steps=10, round_tokens=None, clock=clock, dht_time=clock, draw=lambda: coin[0]
    )
    assert pacer.max_steps == 1000 and pacer.keep_going(1.0)  # nothing read yet: no end known
    pacer.round_end_at = clock.now - 5  # the last round's end, long past
    pacer.start_round()  # a new round: its first step never reads the old end
    assert pacer.keep_going(1.0)
    asyncio.run(pacer.update(3))
    # target 10 x (100 + 100) = 2000 tokens at 400 tok/s: 5 s left
    assert pacer.progress is not None and pacer.progress.target == 2000
    assert pacer.round_end_at == pytest.approx(clock.now + 5.0)
    clock.now += 4.0
    # 1 s left: a 1 s step fits; a 4 s step straddles the end with 1/4 of it inside: taken when
    # the draw falls under 1/4 (so a slow peer trains, in expectation, exactly the time left)
    assert pacer.keep_going(1.0) and not pacer.keep_going(4.0)
    coin[0] = 0.2
    assert pacer.keep_going(4.0)
    # (a count is clamped to 8x the other peers' median, or one average peer's round while they
    # have none: 1900 against our 0 would count as 1000, see peers/pacing.py)
    records["b"] = other.model_copy(update={"round_tokens": 1600})
    own = own.model_copy(update={"round_tokens": 300, "progress_at": clock.now})
    asyncio.run(pacer.update(3))
    # 100 tokens left at 400 tok/s: 0.25 s
    assert pacer.round_end_at == pytest.approx(clock.now + 0.25)
    coin[0] = 0.3
    assert pacer.keep_going(0.25) and not pacer.keep_going(1.0)  # the coin 0.3 is not under 0.25 / 1.0
    own = own.model_copy(update={"round_tokens": 400})
    asyncio.run(pacer.update(3))
    assert pacer.progress.reached and not pacer.keep_going(0.1)


@pytest.mark.parametrize(("peers", "stretch"), [(2, 1.0), (8, 1.0), (16, 2.0), (32, 4.0)])
def test_the_pacer_reads_a_large_swarm_proportionally_less_often(monkeypatch, peers, stretch):
    """Issue 60: every read of the membership key brings back all n records, so a pacer that
    read at one rate made n² record reads across the swarm. Up to FULL_RATE_PEERS peers it reads
    every `read_s`; above, proportionally less often: what a node reads per second stays flat."""
    import dtnode.daemon.rounds.pacer as pacer_module

    clock = FakeClock()
    records = {
        f"p{i}": PeerRecord(peer_id=f"p{i}", outer_step=3, state="training", tokens_per_s=100.0, tokens_per_step=100)
        for i in range(peers)
    }

    async def view() -> dict[str, PeerRecord]:
        return records

    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        raise asyncio.CancelledError  # one read, then the round's inner steps end

    pacer = SwarmPacer(view, lambda: records["p0"], 10, None, clock=clock, dht_time=clock, read_s=0.5)
    monkeypatch.setattr(pacer_module.asyncio, "sleep", sleep)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(pacer.follow(3))
    assert slept == [pytest.approx(0.5 * stretch)]


def test_the_swarm_pacer_extrapolates_records_and_ends_when_another_peer_closed_the_round():
    clock = FakeClock()
    own = PeerRecord(
        peer_id="me", outer_step=3, state="training", tokens_per_s=100.0, tokens_per_step=100, progress_at=clock.now
    )
    # b counted 1000 tokens 2 s ago at 300 tok/s: with a 3 s cap it is at 1600 now, not 1000
    b = PeerRecord(
        peer_id="b",
        outer_step=3,
        state="training",
        round_tokens=1000,
        tokens_per_s=300.0,
        tokens_per_step=100,
        progress_at=clock.now - 2.0,
    )
    records = {"b": b}

    async def view() -> dict[str, PeerRecord]:
        return records

    pacer = SwarmPacer(view, lambda: own, 10, None, clock=clock, dht_time=clock, max_extrapolation=3.0)
    asyncio.run(pacer.update(3))
    assert pacer.progress.done == pytest.approx(1600) and pacer.round_end_at == pytest.approx(clock.now + 1.0)
    # b moved on to averaging round 3 (its exact count published) while this node counted 1750:
    # the swarm is near its target, so the round is over here too
    records["b"] = b.model_copy(
        update={"state": "averaging", "round": 3, "phase": "averaging", "round_tokens": 1650, "progress_at": clock.now}
    )
    own = own.model_copy(update={"round_tokens": 150})
    asyncio.run(pacer.update(3))
    assert pacer.progress.closed == 1 and pacer.round_end_at == -math.inf and not pacer.keep_going(0.0)
    # one peer of three that left early (far from the target) does not end the round for the others
    c = b.model_copy(update={"peer_id": "c", "round_tokens": 0, "progress_at": clock.now})
    early = {"state": "averaging", "round": 3, "phase": "averaging", "round_tokens": 100, "progress_at": clock.now}
    records.update(b=b.model_copy(update=early), c=c)
    own = own.model_copy(update={"round_tokens": 0})
    asyncio.run(pacer.update(3))
    assert pacer.progress.closed == 1 and pacer.round_end_at > clock.now
    # half the round's peers did: the swarm is averaging, whatever this node counts
    records["c"] = c.model_copy(update={"state": "averaging", "round": 3, "phase": "matchmaking"})
    asyncio.run(pacer.update(3))
    assert pacer.progress.closed == 2 and pacer.round_end_at == -math.inf


def test_a_round_shorter_than_a_heartbeat_ends_at_each_peers_share_of_the_published_rates():
    """Four peers, H=10, 100 tokens a step: a round of 4000 tokens at the published 10,000
    tok/s lasts 0.4 s, less than the 2 s heartbeat, so the others' counts never arrive within
    it. Each peer trains its share of the target (its published rate over the summed
    published rates), in time (this peer: 3000 of 10,000 tok/s, 1200 tokens, 0.4 s) and at
    most SHARE_SLACK times it in its own tokens; a long round is left to the swarm's count."""
    clock = FakeClock()
    counted = [0]  # this peer's tokens so far this round, read live by the training thread
    published = {
        "me": PeerRecord(peer_id="me", outer_step=3, state="training", tokens_per_s=3000.0, tokens_per_step=100),
        **{
            name: PeerRecord(
                peer_id=name,
                outer_step=3,
                state="training",
                tokens_per_s=rate,
                tokens_per_step=100,
                progress_at=clock.now,
            )
            for name, rate in (("b", 2000.0), ("c", 2500.0), ("d", 2500.0))
        },
    }
    # its live rate this round (1500 tok/s, the host busier) is not what the others divide by
    own = published["me"].model_copy(update={"tokens_per_s": 1500.0, "progress_at": clock.now})

    async def view() -> dict[str, PeerRecord]:
        return published

    def pacer(heartbeat: float) -> SwarmPacer:
        return SwarmPacer(
            view,
            lambda: own,
            10,
            None,
            clock=clock,
            dht_time=clock,
            own_count=lambda: (counted[0], 100),
            share_below_s=heartbeat,
            draw=lambda: 0.99,
        )

    short = pacer(2.0)
    asyncio.run(short.update(3))
    assert short.progress.target == 4000 and short.progress.round_rate == pytest.approx(10_000)
    assert short.share_tokens == pytest.approx(1200) and short.round_end_at == pytest.approx(clock.now + 0.4)
    clock.now += 0.39  # the share's time is nearly up: a 0.1 s step no longer fits
    assert short.keep_going(0.005) and not short.keep_going(0.1)
    clock.now -= 0.39
    counted[0] = int(SHARE_SLACK * 1200)  # a peer that sped up: its own tokens end it before its time
    assert not short.keep_going(0.01)
    short.start_round()  # the next round starts from the last read's share, before any read of its own
    counted[0] = 0
    assert short.share_tokens == pytest.approx(1200) and short.round_end_at == math.inf
    assert short.keep_going(0.01)
    counted[0] = 2000
    assert not short.keep_going(0.01)

    long = pacer(0.1)  # heartbeats shorter than the round: the others' counts decide
    counted[0] = 2000
    asyncio.run(long.update(3))
    assert long.share_tokens == math.inf and long.keep_going(0.01)


def test_a_joiner_whose_round_closed_under_it_stops_at_once_and_fixed_pacing_never_asks():
    clock = FakeClock()
    own = PeerRecord(peer_id="me", outer_step=3, state="training", tokens_per_s=100.0, tokens_per_step=100)

    async def view() -> dict[str, PeerRecord]:
        return {}

    pacer = SwarmPacer(view, lambda: own, 10, None, closed_under_us=lambda v, r: r == 3, clock=clock, dht_time=clock)
    asyncio.run(pacer.update(3))
    assert pacer.round_end_at == -math.inf and not pacer.keep_going(0.0)
    fixed = FixedPacer(7)
    assert fixed.max_steps == 7 and fixed.keep_going(1e9) and fixed.progress is None


def test_time_paced_peers_end_their_steps_a_budget_after_the_swarms_median_start():
    """--round-seconds with swarm pacing: a peer that entered the round early trains on to the
    swarm's end instead of waiting at hop 0, a late one ends with the others, and no record
    moves a peer's end by more than half a budget from its own."""
    clock = FakeClock()
    budget = 10.0
    own = PeerRecord(peer_id="me", outer_step=3, round=3, state="training", tokens_per_s=100.0, tokens_per_step=100)
    records: dict[str, PeerRecord] = {}

    def peer(name: str, began: float, **fields: object) -> None:
        records[name] = own.model_copy(update={"peer_id": name, "round_began_at": began, **fields})

    async def view() -> dict[str, PeerRecord]:
        return records

    pacer = SwarmPacer(view, lambda: own, 10, 10**12, clock=clock, dht_time=clock, round_seconds=budget)
    started = clock.now
    # the latest its steps may run: the budget stretched as far as the swarm's start may move it
    assert pacer.start_round() == pytest.approx(started + TIME_BUDGET_RANGE[1] * budget)
    assert pacer.round_end_at == pytest.approx(started + budget)  # nothing read yet: its own budget
    own = own.model_copy(update={"round_began_at": started})
    asyncio.run(pacer.update(3))
    assert pacer.round_end_at == pytest.approx(started + budget)  # alone: its own start

    # two peers entered 4 s later: the median start is 2 s later than ours (4 starts)
    clock.now += 4.0
    peer("b", started + 4.0)
    peer("c", started + 4.0)
    peer("d", started)
    asyncio.run(pacer.update(3))
    assert pacer.round_end_at == pytest.approx(started + 2.0 + budget)
    # a peer still averaging the last round begins this one no sooner than now
    clock.now += 1.0
    peer("e", 0.0, round=2, outer_step=2, phase="averaging")
    asyncio.run(pacer.update(3))
    assert pacer.round_end_at == pytest.approx(started + 4.0 + budget)  # median of 0, 0, 4, 4, 5
    # peers past the round, stopped ones and ones that do not say are left out
    peer("f", started + 9.0, round=4, outer_step=4)
    peer("g", started + 9.0, state="stopped")
    peer("h", 0.0)
    asyncio.run(pacer.update(3))
    assert pacer.round_end_at == pytest.approx(started + 4.0 + budget)

    # a swarm (or lies) that began far later or sooner moves this peer's end by half a budget at
    # most; a start in the future counts as now
    for name in "bcdefgh":
        peer(name, started + 100.0)
    clock.now += 20.0
    asyncio.run(pacer.update(3))
    assert pacer.round_end_at == pytest.approx(started + TIME_BUDGET_RANGE[1] * budget)
    for name in "bcdefgh":
        peer(name, 1.0)
    asyncio.run(pacer.update(3))
    assert pacer.round_end_at == pytest.approx(started + TIME_BUDGET_RANGE[0] * budget)
    # the swarm's tokens still end the round when they come first
    for name in "bcdefgh":
        peer(name, started, round_tokens=10**12 // 4, progress_at=clock.now)
    asyncio.run(pacer.update(3))
    assert pacer.round_end_at <= clock.now

    # fixed pacing counts the budget from the peer's own start; no budget, no deadline
    assert FixedPacer(7, budget, clock=clock).start_round() == pytest.approx(clock.now + budget)
    assert FixedPacer(7).start_round() is None
    untimed = SwarmPacer(view, lambda: own, 10, None, clock=clock, dht_time=clock)
    assert untimed.start_round() is None and untimed.round_end_at == math.inf


# ---- the round state ----------------------------------------------------------------------------
def test_the_round_state_moves_through_a_round_and_refuses_illegal_moves():
    st = RoundState(overlap=False)
    with pytest.raises(IllegalTransition):
        st.enter_round(0, 0)  # joining: it must sync first
    st.start_syncing()
    st.ready()
    st.enter_round(0, 0)
    assert (st.state, st.phase, st.record_phase) == (NodeState.TRAINING, RoundPhase.INNER, RecordPhase.INNER)
    with pytest.raises(IllegalTransition):
        st.outer_applied()  # the outer step of a round that was never averaged
    st.begin_averaging()
    assert st.state == NodeState.AVERAGING and st.published_phase() == RecordPhase.MATCHMAKING
    st.averager_phase("allreduce")  # hop 0's group formed: the round is closed to joiners
    assert st.published_phase() == RecordPhase.AVERAGING
    st.outer_applied()
    with st.syncing():
        assert st.state == NodeState.SYNCING and not st.in_round
    assert st.state == NodeState.AVERAGING
    st.enter_round(1, 1)
    st.stop()
    with pytest.raises(IllegalTransition):
        st.enter_round(2, 2)  # nothing leaves stopped


def test_a_round_publishes_without_waiting_and_its_last_move_is_stored():
    """`publish` returns at once (a store waits on several DHT nodes, seconds on a loaded box);
    moves made while a store is in flight are stored once more after it, as they stand then, and
    a failed one is left to the heartbeat; `publish_now` stores the record as it stands at once,
    beside a store in flight, and says when it failed."""
    st = RoundState(overlap=False)
    stored: list[tuple[str, int]] = []
    release = asyncio.Event()
    failing = False

    async def announce(record: PeerRecord) -> bool:
        if record.state != "stopped":
            await release.wait()
        if failing:
            raise RuntimeError("no DHT node answered")
        stored.append((record.state, record.round))
        return True

    def record() -> PeerRecord:
        return PeerRecord(peer_id="me", state=st.state.value, round=st.round)

    async def settled(count: int) -> None:
        for _ in range(100):
            if len(stored) >= count:
                return
            await asyncio.sleep(0)

    async def main() -> None:
        nonlocal failing
        publisher = Publisher(st, record, announce, NodeMetrics("0", "run", "tiny", "cpu"))
        st.start_syncing()
        st.ready()
        st.enter_round(0, 0)
        publisher.publish()  # returns while the store waits
        await asyncio.sleep(0)
        st.begin_averaging()
        publisher.publish()
        st.outer_applied()
        st.enter_round(1, 1)
        publisher.publish()
        assert stored == []
        release.set()
        await settled(2)
        # the first store went out with the record as it stood when it started; the two moves
        # made during it were stored once after it, as they stood then
        assert stored == [("training", 0), ("training", 1)]
        release.clear()
        st.begin_averaging()
        publisher.publish()  # in flight, waiting
        st.outer_applied()
        st.stop()
        await publisher.publish_now()  # not behind the store in flight
        assert stored[-1] == ("stopped", 1)
        release.set()
        failing = True
        with pytest.raises(RuntimeError):
            await publisher.publish_now()
        publisher.publish()  # a failed background store does not escape: the heartbeat stores it again
        for _ in range(20):
            await asyncio.sleep(0)

    asyncio.run(main())


def test_overlapped_rounds_keep_training_while_they_average():
    st = RoundState(overlap=True)
    st.start_syncing()
    st.ready()
    st.enter_round(1, 0)
    st.begin_averaging()
    assert st.state == NodeState.TRAINING and st.published_phase() == RecordPhase.AVERAGING


def test_the_first_round_a_node_averages_is_the_first_it_enters_since_it_started_or_downloaded():
    """The record's `first_round`: peers' hop 0 of an earlier round does not wait for this node
    (an --overlap joiner enters round r while round r-1 is averaged). A download gives up what
    the node had to average, so the next round it enters is its first again."""
    st = RoundState(overlap=True)
    st.start_syncing()
    st.ready()
    assert st.first_round is None  # in no round yet: of no round's population
    st.enter_round(4, 3)
    st.enter_round(5, 4)
    assert st.first_round == 4
    with st.syncing():
        assert st.first_round is None
    st.enter_round(9, 8)
    assert st.first_round == 9


def test_a_round_began_when_its_inner_steps_began_or_when_it_was_entered_until_then():
    """The record's `round_began_at`, what time-paced peers end their steps from."""
    clock = FakeClock()
    st = RoundState(overlap=False, dht_time=clock)
    st.start_syncing()
    st.ready()
    assert st.round_began_at == 0.0  # in no round
    st.enter_round(2, 2)
    assert st.round_began_at == clock.now  # entered: its steps are about to begin
    clock.now += 1.5
    st.enter_round(2, 2)  # entered again (the loop's next pass): the round did not begin again
    assert st.round_began_at == clock.now - 1.5
    st.begin_inner(2)
    assert st.round_began_at == clock.now
    with st.syncing():
        assert st.round_began_at == 0.0
    clock.now += 1.0
    st.enter_round(3, 3)
    assert st.round_began_at == clock.now


def test_a_lone_average_while_peers_train_asks_the_next_groups_to_re_sync_theta(caplog):
    """A node paused past its record's expiry: its peers closed the round without expecting it,
    and on its return it averaged alone, both sides clean. Its θ_g took a step nobody took, so
    its next groups re-sync θ_g (seen in a drill: without, its eval loss stayed 0.15 above its
    peers' until the scheduled --consensus-every)."""
    alone = AveragingResult(torch.zeros(1), 1.0, [_hop(1, 1, 0, 0), _hop(1, 1, 0, 0)], None)
    paired = AveragingResult(torch.zeros(1), 1.0, [_hop(1, 1, 0, 0), _hop(2, 2, 10, 10)], None)

    def records(*peers: PeerRecord):
        async def view() -> dict[str, PeerRecord]:
            return {p.peer_id: p for p in (_peer("me", 4), *peers)}

        return view

    def check(view, result) -> bool:
        return asyncio.run(left_off_the_swarm(view, "me", MODEL, 3, result))

    training = records(_peer("a", 4), _peer("b", 4, "averaging", state="averaging"))
    assert check(training, alone)
    assert not check(training, paired)  # a partner in one hop: its group's θ_g is shared
    assert not check(training, None)  # no average at all: the failure path re-syncs already
    assert not check(records(), alone)  # alone in the swarm: nobody to be off from
    assert not check(records(_peer("x", 4, model="other"), _peer("s", 4, state="stopped")), alone)


# ---- the round summary ---------------------------------------------------------------------------
def _hop(
    size: int, expected: int, sent: int, received: int, failed: list[str] | None = None, waited: float = 0.0
) -> HopReport:
    return HopReport(
        0,
        "k",
        size,
        expected,
        size,
        size == expected,
        ["a", "b"][:size],
        0.25,
        1.0,
        waited_s=waited,
        allreduce_s=0.5,
        bytes_sent=sent,
        bytes_received=received,
        failed_parts=failed or [],
        failure_codes=["DEADLINE_EXCEEDED"] if failed else [],
    )


def _summary(hops: list[HopReport], overlap: bool = False) -> RoundSummary:
    import torch

    result = AveragingResult(torch.zeros(1), 3.0, hops, None)
    return RoundSummary(
        7, 8, InnerResult(10, 2560, 2.5, 4.0, 1e-3), result, 6.0, 0.0, 0.5, overlap, 2.25, 8, 1e-3, None, "a"
    )


def test_a_hop_whose_mean_lacks_a_member_in_some_part_is_not_clean():
    """Every part succeeded, but a reducer dropped a member at its deadline: the group's mean
    lacks it there and the dropped member kept its own values, so the round was not whole."""
    whole, dropped = _hop(3, 3, 100, 100), _hop(3, 3, 100, 100)
    whole.included_peers, dropped.included_peers = ["a", "b", "c"], ["a", "b"]
    assert whole.clean and whole.dropped_senders == 0
    assert not dropped.clean and dropped.dropped_senders == 1
    summary = _summary([dropped])
    assert summary.outcome == RoundOutcome.PARTIAL and summary.reasons == ["dropped_sender"]
    assert _hop(1, 1, 0, 0).dropped_senders == 0  # alone: nobody to lack


def test_theta_resyncs_are_counted_by_why_they_happened():
    asked, diverged, none = _hop(2, 2, 10, 10), _hop(2, 2, 10, 10), _hop(2, 2, 10, 10)
    asked.theta_resync_s = diverged.theta_resync_s = 0.5
    diverged.unasked_resync = True
    metrics = NodeMetrics("0", "run", "tiny", "cpu")
    _summary([asked, diverged, none]).observe(metrics)
    counted = {
        s.labels["reason"]: s.value
        for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        for s in f.samples
        if s.name == "dtnode_theta_resyncs_total"
    }
    assert counted == {"asked": 1, "diverged": 1}


def test_a_rounds_entry_says_where_its_theta_came_from_once():
    """What arrived since the last recorded round goes into the next entry, oldest first, and
    only there; a node that syncs again and again without a round keeps the newest few."""
    arrivals = Arrivals()
    arrivals.note(ThetaArrival(ThetaSource.RESUMED, 3, params_sha256="ab" * 32))
    liar = Skipped(Skip.CONTRADICTED, ("peer-liar",), 4, "2 other host(s) contradict it")
    arrivals.note(ThetaArrival(ThetaSource.DOWNLOADED, 4, Download(2, 1, 1000, passed_over=(liar,), resumes=2)))
    arrivals.note(ThetaArrival(ThetaSource.TAKEN, 5, Download(offered_by=1, served_by=1, size_bytes=500)))
    taken = arrivals.take()
    entry = dataclasses.replace(_summary([_hop(2, 2, 10, 10)]), synced=taken).history_entry(0, 0.0)
    passed_over = [
        {"why": "contradicted", "peers": ["peer-liar"], "step": 4, "detail": "2 other host(s) contradict it"}
    ]
    assert entry["synced"] == [
        {"source": "resumed", "step": 3, "params_sha256": "ab" * 32},
        {
            "source": "downloaded",
            "step": 4,
            "offered_by": 2,
            "served_by": 1,
            "bytes": 1000,
            "resumes": 2,
            "passed_over": passed_over,
        },
        {"source": "taken", "step": 5, "offered_by": 1, "served_by": 1, "bytes": 500, "resumes": 0, "passed_over": []},
    ]
    assert arrivals.take() == () and _summary([]).history_entry(0, 0.0)["synced"] == []
    # what donors sent is bounded in the history: a Sybil swarm's many offers, a long error
    sybils = tuple(Skipped(Skip.NO_OFFER, tuple(f"p{i}-{j}" for j in range(40)), None, "x" * 10**5) for i in range(100))
    arrivals.note(ThetaArrival(ThetaSource.DOWNLOADED, 6, Download(1, 1, 1000, passed_over=sybils)))
    (bounded,) = dataclasses.replace(_summary([]), synced=arrivals.take()).history_entry(0, 0.0)["synced"]
    assert len(bounded["passed_over"]) == PASSED_OVER_LIMIT
    assert all(
        len(p["peers"]) == PASSED_OVER_LIMIT and len(p["detail"]) == DETAIL_CHARS for p in bounded["passed_over"]
    )
    for step in range(40):
        arrivals.note(ThetaArrival(ThetaSource.DOWNLOADED, step))
    assert [a.step for a in arrivals.take()] == list(range(40 - Arrivals.LIMIT, 40))


def test_status_shows_the_last_fetch_that_installed_nothing_until_a_theta_arrives():
    """`/status`'s `last_sync_miss`: why a node that keeps catching up has not caught up (the
    donors its last fetch passed over), bounded like the history's, gone once a θ_g arrives."""
    arrivals = Arrivals()
    split = Skipped(Skip.NO_MAJORITY, ("peer-a", "peer-b"), 7, "1 of 3 hosts")
    arrivals.missed(FetchMiss(7, 8, 1234.5, (split, Skipped(Skip.NO_OFFER, ("peer-c",), None, "timed out"))))
    assert arrivals.last_miss is not None
    shown = SyncMiss.of(arrivals.last_miss).model_dump()
    assert shown == {
        "first_step": 7,
        "last_step": 8,
        "time": 1234.5,
        "passed_over": [
            {"why": "no_majority", "peers": ["peer-a", "peer-b"], "step": 7, "detail": "1 of 3 hosts"},
            {"why": "no_offer", "peers": ["peer-c"], "step": None, "detail": "timed out"},
        ],
    }
    sybils = tuple(Skipped(Skip.FAILED, tuple(f"p{i}-{j}" for j in range(40)), 9, "x" * 10**5) for i in range(100))
    arrivals.missed(FetchMiss(9, 9, 1240.0, sybils))
    assert arrivals.last_miss is not None
    bounded = SyncMiss.of(arrivals.last_miss)
    assert len(bounded.passed_over) == PASSED_OVER_LIMIT
    assert all(len(p.peers) == PASSED_OVER_LIMIT and len(p.detail) == DETAIL_CHARS for p in bounded.passed_over)
    arrivals.note(ThetaArrival(ThetaSource.DOWNLOADED, 9))
    assert arrivals.last_miss is None


def test_a_joiners_download_that_replaced_its_first_round_says_which_round_and_steps_it_dropped():
    """A joiner whose peers closed its first round while it took its first steps downloads the
    next round's θ_g; that download's line in the history names the round and the steps dropped
    (a re-entry that installed nothing marks no earlier arrival)."""
    arrivals = Arrivals()
    arrivals.note(ThetaArrival(ThetaSource.DOWNLOADED, 4))
    before = arrivals.noted
    arrivals.replacing(DroppedRound(4, 2), before)  # the re-entry's download failed: nothing new
    arrivals.note(ThetaArrival(ThetaSource.DOWNLOADED, 5))
    arrivals.replacing(DroppedRound(4, 2), before)
    assert [a.entry() for a in arrivals.take()] == [
        {"source": "downloaded", "step": 4},
        {"source": "downloaded", "step": 5, "dropped_round": 4, "dropped_steps": 2},
    ]


def test_a_round_summary_is_the_one_source_of_status_history_and_metrics():
    first = _hop(2, 2, 1000, 900, waited=0.125)
    first.formed_beside = ["c"]  # a cell peer its hop 0 closed without formed a group of its own
    summary = _summary([first, _hop(2, 3, 500, 400, failed=["b"], waited=0.0625)])
    assert summary.bytes_sent == 1500 and summary.bytes_received == 1300
    assert summary.outcome == RoundOutcome.PARTIAL and summary.reasons == ["deadline_exceeded", "incomplete_group"]
    last = summary.last_round()
    assert (last.bytes_sent, last.bytes_received, last.group_size, last.tokens) == (1500, 1300, 2, 2560)
    entry = summary.history_entry(tokens_total=10_000, tokens_per_s=640.0)
    assert entry["bytes_sent"] == last.bytes_sent and entry["outcome"] == "partial"
    assert entry["formed_beside"] == ["c"] and last.hops[0]["formed_beside"] == ["c"]
    assert entry["phases_s"] == {
        "inner": 4.0,
        "matchmaking": 0.5,
        "allreduce": 1.0,
        "waiting": 0.0,
        "eval": 0.5,
        "outer": 0.0,
    }
    assert entry["matchmaking_waited_s"] == 0.188  # of the matchmaking phase's 0.5 s, until the last registrant
    metrics = NodeMetrics("0", "run", "tiny", "cpu")
    summary.observe(metrics)
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        for s in f.samples
    }
    assert values[("dtnode_rounds_total", (("outcome", "partial"),))] == 1
    assert values[("dtnode_rounds_total", (("outcome", "full"),))] == 0
    assert values[("dtnode_allreduce_sent_bytes_total", ())] == 1500
    assert values[("dtnode_allreduce_received_bytes_total", ())] == 1300
    assert values[("dtnode_tokens_total", ())] == 2560
    assert values[("dtnode_hop_failures_total", (("reason", "deadline_exceeded"),))] == 1
    assert values[("dtnode_hop_failures_total", (("reason", "incomplete_group"),))] == 1
    assert values[("dtnode_round_phase_seconds_sum", (("phase", "allreduce"),))] == 1.0
    assert summary.log_line(640.0, None).startswith(
        "round 7 | groups 2/2 2/3 | 10 steps 2560 tok | lr 0.001 | "
        "loss 2.5000 | eval 2.2500 | allreduce 1.000s (1.5 kB sent)"
    )


def test_status_carries_the_summary_and_the_condition_the_stats_give():
    stats = RunStats()
    assert stats.condition(NodeState.SYNCING)[0] == Condition.CATCHING_UP
    assert stats.condition(NodeState.TRAINING)[0] == Condition.STARTING
    alone = _summary([])
    stats.round_ended(alone.outcome)
    assert stats.condition(NodeState.TRAINING)[0] == Condition.ALONE
    stats.round_ended(RoundOutcome.FAILED)
    assert stats.condition(NodeState.TRAINING)[0] == Condition.FAILING and stats.round_failures == 1
    summary = _summary([_hop(2, 2, 10, 10)])
    condition, detail = stats.condition(NodeState.TRAINING)
    status = NodeStatus(
        peer_id="a",
        run_id="r",
        state=NodeState.TRAINING,
        phase="inner",
        outer_step=8,
        inner_step=10,
        inner_lr=1e-3,
        loss=math.nan,
        eval_loss=2.25,
        eval_step=8,
        loss_floor=None,
        tokens_per_s=1.0,
        compute_utilization=None,
        uptime_s=1.0,
        params_sha256="",
        http_url="",
        grpc_addr="",
        join_command="",
        dht_addrs=[],
        tls_fingerprint=None,
        model="tiny",
        model_hash="h",
        recipe=recipe_of(NodeSettings(), 64, "synthetic (seed 0)"),
        device="cpu",
        client_mode=False,
        version="0",
        last_round=summary.last_round(),
        deadlines={},
        fused_kernels=False,
        pacing="swarm",
        round_failures=stats.round_failures,
        condition=condition,
        condition_detail=detail,
        round_progress=None,
        ranks=[],
    )
    shown = status.model_dump(mode="json")
    assert shown["loss"] is None  # JSON has no NaN: the dashboard parses this
    assert shown["state"] == "training" and shown["condition"] == "failing"
    assert shown["last_round"]["bytes_sent"] == 10 and shown["last_round"]["group_size"] == 2


def test_the_pacer_reads_the_swarm_a_few_times_a_heartbeat_not_at_every_poll():
    """Issue 60: each read is every peer's record, so a node reading 5 times a second made the
    swarm's DHT traffic grow as n² (32 nodes spent a 2-core box on it). `follow` reads every
    `read_s` (a quarter heartbeat in the node); the wait for the round's end still looks at
    its own clock every `poll_s`."""
    reads = 0

    async def view() -> dict[str, PeerRecord]:
        nonlocal reads
        reads += 1
        return {}

    async def main() -> None:
        pacer = SwarmPacer(view, lambda: PeerRecord(peer_id="me"), 10, None, poll_s=0.01, read_s=0.2)
        following = asyncio.ensure_future(pacer.follow(0))
        await asyncio.sleep(0.5)
        following.cancel()

    asyncio.run(main())
    assert 2 <= reads <= 4  # at 0, 0.2 and 0.4 s; a read per poll would be about 50


def test_a_peer_whose_last_step_did_not_fit_waits_for_the_round_s_end_or_its_close():
    """It reaches matchmaking with the swarm, not a step early: it idles until the expected end,
    at most one step, and at once when another peer closes the round (follow sets -inf)."""

    async def nothing() -> dict[str, PeerRecord]:
        return {}

    async def main() -> None:
        pacer = SwarmPacer(nothing, lambda: PeerRecord(peer_id="me"), 10, None, poll_s=0.01)
        pacer.round_end_at = time.monotonic() + 60.0
        waiting = asyncio.ensure_future(pacer.wait_for_end(at_most=60.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # the round's end is a minute away: still waiting
        pacer.round_end_at = -math.inf  # another peer closed it
        await asyncio.wait_for(waiting, 5)
        pacer.round_end_at = time.monotonic() + 60.0
        await asyncio.wait_for(pacer.wait_for_end(at_most=0.05), 5)  # one step at most
        await asyncio.wait_for(FixedPacer(3).wait_for_end(60.0), 5)  # fixed pacing: the H-th step is the end

    asyncio.run(main())


def test_rounds_failing_in_a_row_wait_longer_and_log_a_repeated_failure_once():
    """A fault met in every round (the GPU run's restored AdamW state, before its fix) waited 1 s
    and logged a traceback each time, forever: now 3 quick tries, then doubling pauses up to a
    cap, and a failure like the last one is said in one line. A round that ends well starts over."""
    from dtnode.daemon.rounds.backoff import MAX_FAILED_ROUND_BACKOFF_S, FailureStreak

    streak = FailureStreak()
    same = [streak.failed(RuntimeError("state_steps is on cpu")) for _ in range(9)]
    assert [pause for pause, _ in same] == [1, 1, 1, 2, 4, 8, 16, MAX_FAILED_ROUND_BACKOFF_S, 30]
    assert [repeated for _, repeated in same] == [False] + [True] * 8
    assert streak.failed(ValueError("another fault")) == (30, False)  # a new fault gets its traceback
    streak.ended()
    assert streak.failed(ValueError("another fault")) == (1, False)


def test_the_join_line_status_shows_names_the_files_each_host_brings_not_where_they_lie_here():
    """Issue 56, finding 12: /status showed the --data path (and a --tokenizer or hf: model
    path) to anyone who could reach the sidecar. Its join line now names the files only; the
    line printed to the operator who started the node keeps the paths."""
    from dtnode.daemon.swarm.bootstrap import join_command

    paths = {"data": Path("/home/alice/private/corpus.txt"), "tokenizer": Path("/home/alice/tok")}
    s = NodeSettings().replaced(**paths, model="hf:/srv/models/m1")  # paths of another host
    recipe = recipe_of(s, 64, "100 tokens, sha256 0123456789abcdef")
    public, local = (join_command(s, recipe, "/ip4/1.2.3.4/tcp/1/p2p/Qm", public=p) for p in (True, False))
    assert "/home/alice" not in public and "/srv/" not in public
    assert "--data corpus.txt" in public and "--tokenizer tok" in public and "--model hf:m1" in public
    assert "--data /home/alice/private/corpus.txt" in local and "--model hf:/srv/models/m1" in local


def test_the_join_line_names_a_hub_model_as_it_is():
    """`--model hf:ORG/NAME` is a Hub id every host resolves through its own cache, not a path."""
    from dtnode.daemon.swarm.bootstrap import join_command

    s = NodeSettings().replaced(model="hf:test-org/tiny-llama")
    recipe = recipe_of(s, 64, "synthetic (seed 0)")
    for public in (True, False):
        assert "--model hf:test-org/tiny-llama" in join_command(s, recipe, "/ip4/1.2.3.4/tcp/1/p2p/Qm", public=public)


def test_the_join_line_carries_the_runs_end():
    from dtnode.daemon.swarm.bootstrap import join_command

    s = NodeSettings().replaced(max_rounds=40)
    line = join_command(s, recipe_of(s, 64, "synthetic (seed 0)"), "/ip4/1.2.3.4/tcp/1/p2p/Qm")
    assert line.endswith("--max-rounds 40")
