"""The two ways a round runs, behind one interface: `PlainRound` averages a round's Δ before
the next round starts; `OverlappedRound` (--overlap) trains the next round while it is averaged.

Both drive the round loop's parts (loop.py) and move the round state only through it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from dtnode.peers import failpoints
from dtnode.peers.averager import AveragingResult
from dtnode.peers.membership import PeerRecord

if TYPE_CHECKING:
    from dtnode.daemon.rounds.loop import RoundLoop

log = logging.getLogger("dtnode")


class RoundStrategy(Protocol):
    async def run_round(self) -> None: ...

    async def drain(self) -> None:
        """On the way out: whatever the strategy still owes the final θ_g."""


class PlainRound:
    """Average this round's Δ, apply the outer step, then start the next round."""

    def __init__(self, loop: RoundLoop):
        self.loop = loop

    async def run_round(self) -> None:
        lp, worker, state, joiner = self.loop, self.loop.worker, self.loop.state, self.loop.joiner
        started = time.monotonic()
        if (trained := await lp.train_round()) is None:
            return
        round_no, inner = trained
        if joiner.closed_under_us(await lp.membership.recent_members(), round_no) and await joiner.enter_next_round(
            round_no, inner
        ):
            lp.metrics.dropped_inner_steps.inc(inner.steps)
            return
        delta = await worker.call(worker.pseudo_gradient)
        drift = await worker.call(worker.resync_bound)
        lp.allow_for(round_no, inner)
        state.begin_averaging()
        lp.publisher.publish()
        resync = lp.wants_resync(round_no)
        result = await lp.average(round_no, delta, inner, resync, worker.call, drift)
        # a wanted re-sync that found nobody to sync with is still wanted next round
        lp.needs_resync = (
            not result.clean
            or (resync and result.theta is None)
            or await left_off_the_swarm(lp.membership.members, lp.peer_id, lp.model_hash, round_no, result)
        )
        if (
            result.alone
            and joiner.closed_under_us(await lp.membership.recent_members(), round_no, alone=True)
            and await joiner.enter_next_round(round_no, inner, alone=True)
        ):
            lp.metrics.dropped_inner_steps.inc(inner.steps)
            return  # the records it judged by were a heartbeat behind
        joiner.reentries = 0
        state.applying_outer_step()
        await lp.store.settle_hash()  # the hash of the previous θ_g reads it
        await worker.call(worker.apply, result)
        lp.needs_resync = lp.resync_clipped() or lp.needs_resync
        state.outer_applied()
        lp.publisher.publish()  # a joiner may download the new θ_g at once
        lp.store.rehash()
        await failpoints.pause("outer-phase", round_no)
        if worker.eval_due():
            await worker.call(worker.evaluate_local)
        lp.rounds_done += 1
        if worker.outer_step % lp.settings.checkpoints.checkpoint_every == 0:
            await lp.store.schedule()
        state.enter_round(worker.outer_step, worker.outer_step)
        lp.finish(round_no, inner, result, time.monotonic() - started)
        lp.publisher.publish()

    async def drain(self) -> None:
        """Nothing is in flight between plain rounds."""


class OverlappedRound:
    """--overlap: inner steps while the previous round's Δ is averaged; then that average's
    outer step if it has not landed yet, and this round's Δ goes out to be averaged during
    the next round.

    The trade-off (streaming DiLoCo's overlapped outer step): the network's time hides behind
    compute, while the first steps of each round run from a θ_g that lacks the last round's
    average, with the node's own part of it kept in θ_l. The average lands between two inner
    steps as soon as it is in (`Landing.land_on_arrival`), so those are few when the average
    is quick; at the round's end this waits for one still running."""

    def __init__(self, loop: RoundLoop):
        self.loop = loop

    async def run_round(self) -> None:
        lp, worker, state, landing = self.loop, self.loop.worker, self.loop.state, self.loop.landing
        started = time.monotonic()
        if (trained := await lp.train_round()) is None:
            return
        round_no, inner = trained
        state.begin_averaging()
        had_average = landing.in_flight
        if had_average:
            state.waiting_for_average()
        previous = await landing.settle()
        if had_average:
            lp.needs_resync = landing.needs_resync(previous) or await left_off_the_swarm(
                lp.membership.members, lp.peer_id, lp.model_hash, round_no - 1, previous
            )
        state.applying_outer_step()
        await lp.store.settle_hash()
        delta = None
        if lp.joiner.catch_up_round == round_no:
            if previous is None:
                lp.joiner.catch_up_round = None
                delta = await lp.joiner.catch_up(round_no)
            else:
                lp.joiner.drop_catch_up()
        # θ_g moves now (a new hash): a catch-up, or an average that did not land during the steps
        changed = delta is not None or (previous is not None and not landing.landed)
        landed_after = landing.landed_after_steps if previous is not None and landing.landed else inner.steps
        if delta is None:
            delta = await worker.call(landing.land_and_stage, previous)
        lp.needs_resync = lp.resync_clipped() or lp.needs_resync  # (landed during the steps, or now)
        state.outer_applied()
        if changed:
            lp.store.rehash()
        resync = lp.wants_resync(round_no)
        # θ_g does not change while the average runs (only its outer step, awaited first, writes
        # it): the consensus state is read on the I/O thread, not behind this round's inner steps
        io = asyncio.get_running_loop()
        drift = await worker.call(worker.resync_bound)
        lp.allow_for(round_no, inner)  # read when this average lands, during the next round's steps
        landing.launch(
            lp.average(round_no, delta, inner, resync, lambda fn: io.run_in_executor(lp.store.io_thread, fn), drift),
            resync,
        )
        if previous is not None:  # the new θ_g's eval, once its hash and the next average are under way
            await worker.call(worker.evaluate_theta_g)
        lp.rounds_done += 1
        if previous is not None and worker.outer_step % lp.settings.checkpoints.checkpoint_every == 0:
            await lp.store.schedule()
        state.train(round_no + 1)  # peers count this node in the next round at once
        state.enter_round(round_no + 1, worker.outer_step)
        lp.finish(round_no, inner, previous, time.monotonic() - started, landed_after if previous is not None else None)
        lp.publisher.publish()

    async def drain(self) -> None:
        """The last average's outer step, so the final θ_g (and its checkpoint) holds every
        round this node took part in."""
        lp, landing, worker = self.loop, self.loop.landing, self.loop.worker
        if not landing.in_flight:
            return
        result = await landing.settle(2 * lp.settings.averaging.bound_s)

        def settle() -> None:
            if not landing.landed:
                landing.land(result)
            if result is not None:
                worker.evaluate_theta_g(force=bool(lp.settings.evaluation.eval_every))

        await worker.call(settle)
        if result is not None:
            lp.store.rehash()
            await lp.store.settle_hash()
            log.info(
                "applied the last round's average: outer step %d (params %s)",
                worker.outer_step,
                worker.replica.params_sha256()[:12],
            )


async def left_off_the_swarm(
    view: Callable[[], Awaitable[dict[str, PeerRecord]]],
    peer_id: str,
    model_hash: str,
    round_no: int,
    result: AveragingResult | None,
) -> bool:
    """Whether this round's average found no partner in any hop while other peers of this
    model train: θ_g then took a step nobody else took. Both sides may report the round
    clean: a node paused past its record's expiry is not expected by peers that close the
    round without it, and alone in its own view when it averages on its return. So its next
    groups re-sync θ_g; before, it stayed off the swarm's until the scheduled
    --consensus-every (a drill's paused peer had an eval loss 0.15 above its peers' for the
    four rounds that followed)."""
    if result is None or not result.alone:
        return False
    records = await view()
    others = sum(
        r.peer_id != peer_id and r.model_hash == model_hash and r.state in ("training", "averaging")
        for r in records.values()
    )
    if others:
        log.info("round %d averaged alone while %d other peer(s) train: its next groups re-sync θ_g", round_no, others)
    return others > 0
