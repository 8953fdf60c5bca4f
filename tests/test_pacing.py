"""Swarm-paced rounds: when the round ends, as every peer computes it from the DHT records."""

import math

import pytest

from dtnode.peers.membership import PeerRecord
from dtnode.peers.pacing import COUNT_SLACK, PACING_SPREAD, round_target, swarm_progress, swarm_round_began


def _peer(
    name: str,
    step: int = 4,
    tokens: int = 0,
    rate: float = 0.0,
    at: float = 100.0,
    per_step: int = 100,
    state: str = "training",
) -> PeerRecord:
    return PeerRecord(
        peer_id=name,
        outer_step=step,
        round_tokens=tokens,
        tokens_per_s=rate,
        progress_at=at,
        tokens_per_step=per_step,
        state=state,
    )


def test_target_is_h_steps_of_every_live_peer_including_those_finishing_the_last_round():
    peers = [
        _peer("a"),
        _peer("b", per_step=400),
        _peer("c", step=3, state="averaging"),
        _peer("old", step=1),
        _peer("gone", state="stopped"),
    ]
    assert round_target(peers, 4, inner_steps=10, round_tokens=None) == 10 * (100 + 400 + 100)
    assert round_target(peers, 4, inner_steps=10, round_tokens=12345) == 12345


def test_progress_extrapolates_each_peer_from_its_last_report_and_caps_stale_ones():
    own = _peer("me", tokens=200, rate=100.0, at=110.0)
    fast = _peer("fast", tokens=300, rate=400.0, at=108.0)  # 2 s old: +800
    done = _peer("done", tokens=500, rate=400.0, at=100.0, state="averaging")  # finished: no extrapolation
    paused = _peer("paused", tokens=200, rate=100.0, at=50.0)  # 60 s stale: capped at 10 s + one 1 s step
    p = swarm_progress([fast, done, paused, _peer("me", tokens=0)], own, 4, 10, None, now=110.0, max_extrapolation=10.0)
    assert p.done == pytest.approx(200 + (300 + 800) + 500 + (200 + 1100))
    as_published = swarm_progress([fast, done, paused], own, 4, 10, None, now=110.0)  # no extrapolation
    assert as_published.done == pytest.approx(200 + 300 + 500 + 200)
    assert p.rate == pytest.approx(100 + 400 + 100)
    assert p.target == 10 * 4 * 100 and p.peers == 4
    assert not p.reached and p.seconds_left() == pytest.approx((4000 - p.done) / 600)


def test_a_slow_peer_does_not_hold_the_round_and_a_lone_peer_takes_h_steps():
    # three peers at 1000 tok/s and one at 250 tok/s, 100 tokens a step each, H = 20: the
    # round is 8000 tokens; after 2.5 s the fast ones have 7500 and the slow one 625
    fast = [_peer(f"f{i}", tokens=2500, rate=1000.0, at=10.0) for i in range(3)]
    slow = _peer("slow", tokens=625, rate=250.0, at=10.0)
    p = swarm_progress(fast, slow, 4, 20, None, now=10.0)
    assert p.reached and p.seconds_left() == 0.0
    alone = swarm_progress([], _peer("me", tokens=1900, rate=100.0), 4, 20, None, now=100.0)
    assert alone.target == 2000 and not alone.reached
    assert swarm_progress([], _peer("me", tokens=0), 4, 20, None, now=0.0).seconds_left() == math.inf


def test_overlapped_peers_are_counted_in_the_round_they_train_not_their_outer_step():
    # --overlap: a peer at outer step 3 trains round 4 while its round-3 average is in flight
    overlapped = PeerRecord(
        peer_id="o", outer_step=3, training_round=4, round_tokens=300, tokens_per_step=100, state="training"
    )
    plain = _peer("p", step=4, tokens=200)
    assert overlapped.round_in_training == 4 and plain.round_in_training == 4
    p = swarm_progress([overlapped], plain, 4, 10, None, now=100.0)
    assert p.done == 500 and p.peers == 2 and p.target == 10 * 200
    assert swarm_progress([overlapped], plain, 3, 10, None, now=100.0).peers == 0  # not in its outer step's round


def test_a_round_is_closed_by_a_peer_averaging_it_or_training_the_next_not_by_one_still_in_the_last():
    own = _peer("me", step=4, tokens=100)
    averaging = _peer("a", step=4, tokens=900, state="averaging").model_copy(update={"round": 4, "phase": "averaging"})
    ahead = PeerRecord(peer_id="o", outer_step=4, training_round=5, state="training")  # --overlap: on to round 5
    behind = _peer("b", step=3, state="averaging").model_copy(update={"round": 3, "phase": "averaging"})
    # applying round 3's outer step: its outer step already says 4, its round and phase say 3, outer
    applying = _peer("c", step=4, state="averaging").model_copy(update={"round": 3, "phase": "outer"})
    training = _peer("t", step=4, tokens=500).model_copy(update={"round": 4, "phase": "inner"})
    p = swarm_progress([averaging, ahead, behind, applying, training], own, 4, 10, None, now=100.0)
    assert p.closed == 2 and p.done == 1500
    assert swarm_progress([behind, applying, training], own, 4, 10, None, now=100.0).closed == 0


def test_a_slow_peer_mid_step_is_extrapolated_through_its_step_not_just_the_heartbeat():
    # 100 tokens per 4 s step, two steps in: 3 s into its third it has counted 200; with a 1.5 s
    # heartbeat allowance plus one of its steps, all 3 s of it count (75 tokens)
    slow = _peer("slow", tokens=200, rate=25.0, at=97.0, per_step=100)
    own = _peer("me", tokens=0, rate=0.0, at=100.0)
    p = swarm_progress([slow], own, 4, 10, None, now=100.0, max_extrapolation=1.5)
    assert p.done == pytest.approx(275.0)
    gone = _peer("slow", tokens=200, rate=25.0, at=80.0, per_step=100)  # 20 s silent: 1.5 + 4 s at most
    assert swarm_progress([gone], own, 4, 10, None, now=100.0, max_extrapolation=1.5).done == pytest.approx(337.5)


def test_a_peer_without_two_steps_of_the_round_is_extrapolated_one_step_at_most():
    # its rate (5000 tok/s) is last round's, when it had the host to itself: 1 s of it is not
    # 5000 tokens of this round but one step (100) at most until two of its steps are in
    fresh = _peer("fresh", tokens=100, rate=5000.0, at=99.0, per_step=100)
    running = _peer("running", tokens=200, rate=500.0, at=99.0, per_step=100)
    own = _peer("me", tokens=0, rate=0.0, at=100.0)
    p = swarm_progress([fresh, running], own, 4, 10, None, now=100.0, max_extrapolation=1.5)
    assert p.done == pytest.approx((100 + 100) + (200 + 500))


def test_one_lying_record_can_neither_end_a_round_at_once_nor_stretch_it():
    """Finding 10 of the security issue: pacing trusted record fields; now each is clamped to
    PACING_SPREAD x the peers' lower median."""
    honest = [_peer(f"h{i}", tokens=300, rate=100.0, at=100.0) for i in range(3)]
    own = _peer("me", tokens=300, rate=100.0, at=100.0)
    clean = swarm_progress(honest, own, 4, 10, None, now=100.0)
    assert clean.target == 4000 and not clean.reached
    ender = _peer("liar", tokens=10**18, rate=1e15, at=100.0)
    p = swarm_progress([*honest, ender], own, 4, 10, None, now=100.0, max_extrapolation=2.0)
    assert not p.reached  # was: 1e18 tokens reached every target at once
    assert p.done <= 4 * 300 + PACING_SPREAD * 300 + 1
    stretcher = _peer("liar", per_step=1 << 40)
    target = swarm_progress([*honest, stretcher], own, 4, 10, None, now=100.0).target
    assert target <= 10 * (4 * 100 + PACING_SPREAD * 100)  # was: 1e13 tokens, a round 100x H and more
    # in a pair the lower median is the honest peer's: a liar with no rate counts one median
    # peer's whole round (10 x 100), one at the honest rate COUNT_SLACK x the honest count
    pair = swarm_progress([_peer("liar", tokens=10**18)], own, 4, 10, None, now=100.0)
    assert pair.done == 300 + 10 * 100
    paced = swarm_progress([_peer("liar", tokens=10**18, rate=100.0)], own, 4, 10, None, now=100.0)
    assert paced.done == 300 + max(COUNT_SLACK * 300, 10 * 100)
    honest_pair = [_peer(f"h{i}", tokens=3000, rate=100.0) for i in range(2)]
    crowd = swarm_progress([*honest_pair, _peer("liar", tokens=10**18, rate=100.0)], own, 4, 10, None, now=100.0)
    assert crowd.done == 300 + 2 * 3000 + COUNT_SLACK * 3000  # was 8x: it ended the round at 5/12 of H
    # a count a fast peer's rate backs counts in full (up to PACING_SPREAD)
    fast = swarm_progress([*honest_pair, _peer("fast", tokens=12000, rate=400.0)], own, 4, 10, None, now=100.0)
    assert fast.done == 300 + 2 * 3000 + 12000


def test_a_big_step_at_an_ordinary_rate_does_not_stretch_the_round():
    """Issue 56's bench: a record claiming 2^40 tokens a step at an honest rate (clamped to 8x the
    median) made the target 12 peers' steps for 5 peers, and four honest peers' rounds of H = 50
    took 60 to 100 steps (0.75x their rounds per minute). A step above the median now counts only
    as far as its rate backs it: the target is the clean one."""
    honest = [_peer(f"h{i}", tokens=300, rate=100.0, at=100.0) for i in range(3)]
    own = _peer("me", tokens=300, rate=100.0, at=100.0)
    clean = swarm_progress(honest, own, 4, 10, None, now=100.0)
    liar = _peer("liar", tokens=300, rate=100.0, per_step=1 << 40)
    stretched = swarm_progress([*honest, liar], own, 4, 10, None, now=100.0)
    assert stretched.target == 10 * 5 * 100 == clean.target + 10 * 100
    assert stretched.share == pytest.approx(clean.share) == pytest.approx(10 * 100)  # H of an honest peer's steps
    # in a pair the honest peer's step time is the lower median: the liar counts as one step of it
    assert swarm_progress([liar], own, 4, 10, None, now=100.0).target == 10 * 2 * 100
    # a liar that claims the rate to match (clamped to 8x too) counts in full, and each honest
    # peer's share is still H of its own steps: the rates it is divided by grew as much
    fast_liar = _peer("liar", tokens=300, rate=1e15, per_step=1 << 40)
    both = swarm_progress([*honest, fast_liar], own, 4, 10, None, now=100.0)
    assert both.target == 10 * (4 * 100 + PACING_SPREAD * 100)
    assert both.share == pytest.approx(10 * 100)


def test_a_bigger_batch_counts_as_far_as_its_rate_backs_it():
    """A host with 4x the batch at the rate of the others (its steps take 4x as long) counts what
    it trains in a median step's time: the round lasts H median steps, and it takes fewer steps in
    it. A peer with no rate yet counts a median step; a smaller step counts in full."""
    small = [_peer(f"s{i}", rate=100.0) for i in range(2)]
    own = _peer("me", rate=100.0)
    slow_big = _peer("big", rate=100.0, per_step=400)
    assert swarm_progress([*small, slow_big], own, 4, 10, None, now=100.0).target == 10 * 4 * 100
    half_backed = _peer("big", rate=200.0, per_step=400)  # 2x the rate: counts 2 median steps
    assert swarm_progress([*small, half_backed], own, 4, 10, None, now=100.0).target == 10 * (3 * 100 + 200)
    unknown = _peer("big", rate=0.0, per_step=400)
    assert swarm_progress([*small, unknown], own, 4, 10, None, now=100.0).target == 10 * 4 * 100
    tiny_step = _peer("little", rate=10.0, per_step=25)  # a slow small peer: in full, as before
    assert swarm_progress([*small, tiny_step], own, 4, 10, None, now=100.0).target == 10 * (3 * 100 + 25)


def test_uneven_honest_peers_count_in_full():
    """A peer with an 8x bigger batch and an 8x faster rate is inside the clamp."""
    small = [_peer(f"s{i}", tokens=100, rate=100.0) for i in range(2)]
    big = _peer("big", tokens=800, rate=800.0, per_step=800)
    own = _peer("me", tokens=100, rate=100.0)
    p = swarm_progress([*small, big], own, 4, 10, None, now=100.0)
    assert p.done == 3 * 100 + 800 and p.rate == 3 * 100 + 800
    assert p.target == 10 * (3 * 100 + 800)


def test_one_record_claiming_the_next_round_does_not_close_the_round_for_two_peers_training_it():
    """Issue 56, finding 7: a record announcing round_in_training = r + 1 counted as a peer that
    closed round r and not as one of its peers, so with two honest peers training r (1 closed,
    2 peers: 2 x 1 >= 2) every round ended at once. A peer past the round now counts among its
    peers too: half of all must be past it."""
    honest = _peer("h", tokens=100, rate=100.0)
    own = _peer("me", tokens=100, rate=100.0)
    liar = _peer("liar", step=5, tokens=100, rate=100.0)  # says it trains round 5
    p = swarm_progress([honest, liar], own, 4, 10, None, now=100.0)
    assert p.closed == 1 and p.peers == 2 and p.round_peers == 3 and not p.closed_by_most
    # two honest peers where one really closed: the other follows at once, as before
    assert swarm_progress([liar], own, 4, 10, None, now=100.0).closed_by_most


def test_step_rates_tell_a_host_of_big_steps_from_a_fast_one():
    """A host of 2 ranks takes steps of twice the tokens: at the same tokens/s it makes half the
    steps of a one-rank peer, so its pseudo-gradient is the shorter one (what `allow_for` scales by)."""
    own = _peer("two-ranks", tokens=1000, rate=1000.0, per_step=200)
    one = _peer("one-rank", tokens=1000, rate=1000.0, per_step=100)
    idle = _peer("new", tokens=0, rate=0.0)  # no rate yet: not counted
    p = swarm_progress([one, idle], own, 4, 10, None, now=100.0)
    assert p.own_step_rate == pytest.approx(5.0)
    assert p.step_rate == pytest.approx((5.0 + 10.0) / 2)
    assert swarm_progress([], _peer("me"), 4, 10, None, now=100.0).own_step_rate == 0.0


def test_a_typical_peer_is_what_the_rounds_peers_counted_and_one_liar_moves_it_to_an_honest_count():
    """The outer step's allowance (daemon/rounds/loop.py `allow_for`) asks what a typical peer of
    the round trained: in a swarm's first round, where no rate is known, peers train past the
    target's share (37 and 64 steps of 15 in CI), and a node that trained its share takes a mean
    of their longer Δ. The upper median of the round's counts, own and averaging peers included;
    a peer of another round counts nothing, and a liar is held to another peer's count."""
    own = _peer("me", tokens=1500, rate=100.0)
    ahead = [_peer("a", tokens=9500, rate=100.0), _peer("b", tokens=16000, rate=100.0, state="averaging")]
    other_round = _peer("c", step=3, tokens=10**6, rate=100.0)
    p = swarm_progress([*ahead, other_round], own, 4, 15, None, now=100.0)
    assert p.typical_tokens == 9500 and p.target / p.peers <= p.typical_tokens / 4  # the share: 4x less
    liar = _peer("liar", tokens=10**18, rate=100.0)
    assert swarm_progress([*ahead, liar], own, 4, 15, None, now=100.0).typical_tokens == 16000
    assert swarm_progress([], own, 4, 15, None, now=100.0).typical_tokens == 1500
    assert swarm_progress([], _peer("me", step=5), 4, 15, None, now=100.0).typical_tokens == 0.0


def test_a_peer_that_trained_its_share_while_the_others_trained_on_falls_short_of_them():
    """The shortfall `allow_for` allows the outer step (update_bounds.py): against the round's
    counts where its peers trained past the target's share (a swarm's first round), against the
    share otherwise, and against the average step rate where that is the larger."""
    own = _peer("me", tokens=1500, rate=100.0)
    ahead = [_peer("a", tokens=9000, rate=100.0), _peer("b", tokens=16000, rate=100.0)]
    assert swarm_progress(ahead, own, 4, 15, None, now=100.0).shortfall(1500) == pytest.approx(6.0)
    even = [_peer("a", tokens=1500, rate=100.0), _peer("b", tokens=1500, rate=100.0)]
    p = swarm_progress(even, own, 4, 15, None, now=100.0)
    assert p.shortfall(1500) == pytest.approx(p.target / 3 / 1500) and p.shortfall(0) == math.inf
    slow = _peer("me", tokens=1500, rate=25.0)  # a quarter of the others' steps a second
    assert swarm_progress(even, slow, 4, 15, None, now=100.0).shortfall(1500) == pytest.approx(3.0)


def test_a_groups_typical_member_is_the_upper_median_of_its_capped_weights():
    """`weight_shortfall`: what the hop-0 group's registrations say a typical member trained,
    over this member's tokens; a liar's weight is capped and moves the median to an honest one."""
    from dtnode.peers.plan import Member, weight_shortfall

    def group(*weights: float) -> list[Member]:
        return [Member(f"p{i}", "127.0.0.1:1", weight=w) for i, w in enumerate(weights)]

    assert weight_shortfall(group(3584, 12032, 18688), "p0") == pytest.approx(12032 / 3584)
    assert weight_shortfall(group(3584, 12032, 1e18), "p0") == pytest.approx(12032 / 3584)  # capped, then the median
    assert weight_shortfall(group(3584, 12032, 1e18, 4000), "p0") == pytest.approx(12032 / 3584)
    assert weight_shortfall(group(12032, 3584), "p0") == pytest.approx(1.0)
    assert weight_shortfall(group(0, 3584), "p0") == 1.0


def _began(name: str, at: float, round: int = 5, state: str = "training", phase: str = "inner") -> PeerRecord:
    return PeerRecord(peer_id=name, outer_step=round, round=round, phase=phase, round_began_at=at, state=state)


def test_the_swarms_start_of_a_round_is_the_median_of_its_peers_starts():
    now = 1000.0
    starts = [_began("a", 990.0), _began("b", 992.0), _began("c", 996.0)]
    assert swarm_round_began(starts, 5, now) == 992.0
    # a peer still averaging the round before begins this one no sooner than now
    late = PeerRecord(peer_id="d", outer_step=4, round=4, phase="averaging", state="averaging")
    assert swarm_round_began([*starts, late], 5, now) == pytest.approx((992.0 + 996.0) / 2)
    # left out: a peer past the round, one further behind, a stopped one, one that does not say
    # (an older dtnode), and a joiner in no round yet
    others = [
        _began("e", 999.0, round=6),
        PeerRecord(peer_id="f", outer_step=2, round=2, state="training"),
        _began("g", 999.0, state="stopped"),
        _began("h", 0.0),
        PeerRecord(peer_id="i", outer_step=0, state="joining"),
    ]
    assert swarm_round_began([*starts, *others], 5, now) == 992.0
    assert swarm_round_began(others, 5, now) is None
    # a start in the future counts as now; a liar moves the median no further than an honest start
    assert swarm_round_began([*starts, _began("liar", 1e11)], 5, now) == pytest.approx((992.0 + 996.0) / 2)
    assert swarm_round_began([*starts, _began("liar", 1.0)], 5, now) == pytest.approx((990.0 + 992.0) / 2)
