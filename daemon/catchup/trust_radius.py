"""How far from its own θ_g a running node may adopt a download that no majority vouches for.

In a moshpit swarm each group of a round ends with a θ_g of its own (different members, int8
rounding, a partial group), so one step's checkpoints carry several hashes, and with more
than two groups often none is served by a majority of hosts. A node that just started takes
the most-served file: it has no θ_g to lose. A running node that fell behind (paused, stalled,
cut off) does, and used to refuse every such file: it trained the missed rounds alone, then
averaged on from a θ_g that no longer matched anyone's (with `--compression sparse`, which has
no periodic re-sync, for the rest of the run).

What it has is its own θ_g, which was the swarm's a few steps ago. The swarm's θ_g now is at
most the outer steps in between away from it, plus the steps this node made alone, each no
larger than the outer steps this node made recently, scaled to the inner learning rate of the
steps in between (Δ grows with it: a node paused after its first rounds measured its steps
during the rate's warmup, at a fraction of the swarm's steps since; seen with `--overlap`,
where it refused honest files at 1.04x and 1.005x of an unscaled reach and trained alone).
A file farther away than `REACH_FACTOR` times that is not its swarm's, whoever serves it.
One that passes may still be a liar's, but it lies within a few outer steps of the honest
θ_g, and the re-sync that follows a download averages it with the node's next group.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dtnode.daemon.checkpoints.file_format import LoadedCheckpoint
    from dtnode.daemon.training.worker import ModelWorker

log = logging.getLogger("dtnode")

REACH_FACTOR = 4.0  # slack over the step sizes seen (each scaled to the inner rate of the steps in between)
RATE_STEPS = 32  # outer steps between the two θ_g whose inner rate is looked at, at most


@dataclass(frozen=True)
class Reach:
    """The distance a running node may move its θ_g by adopting a split-vote download."""

    update_scale: float  # the largest of this node's recent outer steps (‖θ_g after − before‖ bound)
    steps_apart: int  # outer steps between the file's θ_g and this node's, counted generously

    @classmethod
    def of(cls, update_scale: float, file_step: int, own_step: int, solo_steps: int) -> Reach:
        """`solo_steps`: this node's latest outer steps made alone (no partner in any hop),
        during which its θ_g and the swarm's went separate ways; one more for the groups'
        differences within a step."""
        return cls(update_scale, abs(file_step - own_step) + solo_steps + 1)

    @property
    def radius(self) -> float:
        return REACH_FACTOR * self.steps_apart * self.update_scale

    def refusal(self, distance: float) -> str | None:
        """Why a θ_g `distance` from this node's is not adopted, or None when it is within reach."""
        if distance <= self.radius:
            return None
        return (
            f"its θ_g is {distance:.4g} from this node's, beyond the {self.radius:.4g} that {self.steps_apart} "
            f"outer steps of up to {self.update_scale:.4g} reach (x{REACH_FACTOR:g})"
        )


async def judge_split_vote(worker: ModelWorker, loaded: LoadedCheckpoint) -> str | None:
    """Why a running node does not adopt a file that no majority of hosts serves alone (a
    moshpit swarm's split vote), or None: it must lie within reach of the node's own θ_g.
    The norms are taken on the worker's thread, where θ_g lives."""
    own = worker.outer_step
    low, high = min(own, loaded.step), max(own, loaded.step)
    between = range(low, high + 1, max(1, -(-(high - low + 1) // RATE_STEPS)))
    at_rate = max(worker.round_rate(step) for step in [*between, high])  # the fastest rate in between
    scale = await worker.call(worker.replica.bounds.update_scale, worker.round_rate, at_rate)
    if scale is None:
        return "this node has made no outer step since it started, so nothing to judge its θ_g by"
    reach = Reach.of(scale, loaded.step, own, worker.solo_steps)
    distance = await worker.call(worker.replica.distance_to, loaded.theta_g)
    refusal = reach.refusal(distance)
    if refusal is None:
        log.info(
            "adopting step %d's θ_g at %.4g from this node's (within %.4g): its hosts are split between moshpit "
            "groups, or this node gives up steps of its own for it",
            loaded.step,
            distance,
            reach.radius,
        )
    return refusal
