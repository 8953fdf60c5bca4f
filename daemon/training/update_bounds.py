"""How far one outer step, or a θ_g re-sync, may move this node's state: bounds measured
against this node's own recent pseudo-gradients and outer steps, never against a quantity a
peer chooses (its weight, its Δ, ‖θ‖ itself).

The replica (outer_replica.py) asks before every outer step (`bounded`) and every round's
averaging (`resync_bound`); the catch-up's trust radius asks how far a step reaches
(`update_scale`).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable

import torch

from dtnode.ops.coded import CodedDelta
from dtnode.ops.outer_optimizer import NesterovOuterOptimizer
from dtnode.peers.part_result import DriftBound

log = logging.getLogger("dtnode")

UPDATES_REMEMBERED = 8  # outer steps whose size `update_scale` takes the largest of
# How far the swarm may move this node's θ_g, relative to this node's own recent pseudo-gradients
# (the last OWN_DELTAS_REMEMBERED of them, the longest): never relative to a quantity a peer
# chooses (its weight, its Δ, ‖θ‖ itself), and never to what the swarm applied before (a member
# that moved it to the bound each round would raise the bound each round)
OWN_DELTAS_REMEMBERED = 8
# an averaged Δ at most this many times this node's longest recent Δ (times `allowance`, for a
# node that trained less than the round's average peer (fewer tokens or fewer steps)); a longer mean is scaled down to
# it, whoever in the group made it long
OUTER_REACH = 3.0
# ‖Δ‖ grows with the steps taken: linearly with aligned updates, and with their square while the
# learning rate warms up (a sum of rising rates: a 9-node swarm's round 0, peers of 4 to 24 steps,
# held a mean 7x the shortest one's Δ); so (typical / own)² in tokens or steps, up to a peer 4x slower's
MAX_ALLOWANCE = 16.0
# a θ_g re-sync may move θ_g by this many of this node's recent outer steps, and the momentum by
# this many of its recent Δ (its own, or the bounded means it applied), per step the two states may
# lie apart (one, plus the steps this node made alone): a failed part, a download from another
# moshpit group's θ_g of the step, a few solo rounds. Two honest groups' momenta differ by the
# difference of the means they added since they parted, at most about twice a mean per step;
# a bound of Δ/(1−μ) per step (10x at μ = 0.9) let a member re-syncing its partner every round
# build its momentum up to 48 from 3, and the outer steps along it to 5x the clean swarm's
RESYNC_REACH = 4.0
# The outer momentum is held to what means no longer than this node's own Δ (x `allowance`)
# could build: 1/(1−μ) of its longest recent own Δ, 10 at μ = 0.9, reached only by means that
# all point one way. OUTER_REACH bounds each averaged Δ, yet a member that pushes the mean to
# that bound in one direction round after round had the momentum add the rounds up, to 3/(1−μ)
# of its own Δ: the hostile bench's plain-mean rows made outer steps of 22.8-24.9 against a bound
# of 21.1 (4x the clean run's largest). Held so, a step is at most lr·(3 + μ/(1−μ)) = 12 own Δ
# at μ = 0.9, where the attack's grew toward lr·(3 + 3μ/(1−μ)) = 30.


class UpdateBounds:
    """The sizes this node remembers (0-d tensors, read only when asked) and the bounds made of them."""

    def __init__(self, outer: NesterovOuterOptimizer, numel: int):
        self.outer = outer
        self.numel = numel
        # bounds on the sizes of the last outer steps, with the round each came from (its inner
        # learning rate scales it: see update_scale)
        self._update_sizes: deque[tuple[torch.Tensor, int]] = deque(maxlen=UPDATES_REMEMBERED)
        # ‖Δ‖ of this node's own last pseudo-gradients: what bounds the swarm's moves
        self._own_norms: deque[torch.Tensor] = deque(maxlen=OWN_DELTAS_REMEMBERED)
        # ‖mean Δ‖ of the last outer steps, after `bounded`: with the own ones, the scale of the
        # momentum a re-sync may move (`resync_bound`)
        self._mean_norms: deque[torch.Tensor] = deque(maxlen=OWN_DELTAS_REMEMBERED)
        self.outer_steps_scaled = 0  # averaged Δ scaled down to OUTER_REACH (`bounded`)
        self.momenta_scaled = 0  # momentum scaled down to its reach (`bound_momentum`)
        self.drift: DriftBound | None = None  # the last `resync_bound`: what a re-sync is clipped to
        self.allowance = 1.0  # `bounded`'s factor for this round (`allow_for_shortfall`)
        self._steps_lr = 0.0  # the mean inner rate of the last round in which this node took a step
        self._rate = 1.0  # the swarm's inner rate over this node's, as `allow_for_shortfall` last took it

    def measure_own(self, delta: torch.Tensor | CodedDelta) -> None:
        """Remember ‖Δ‖ of this node's own pseudo-gradient (no host sync until it is read)."""
        self._own_norms.append(delta.norm() if isinstance(delta, CodedDelta) else torch.linalg.vector_norm(delta))

    def own_scale(self) -> float | None:
        """The longest of this node's recent own pseudo-gradients (None before its first, and
        while all were empty: a node that joined at a round's end trained 0 steps, and a bound of
        0 x its Δ zeroed the group's mean for it alone, splitting its θ_g from its partner's)."""
        if not self._own_norms:
            return None
        longest = float(torch.stack(list(self._own_norms)).max())
        return longest if longest > 0 else None

    def rate_shortfall(self, swarm_rate: float, mean_lr: float) -> float:
        """The swarm's inner rate over the round against the rate behind this node's own recent
        Δ: this round's steps' mean rate, or, in a round it took no step in, that of the last
        round it took some in (the Δ that sets its scale were made at that rate). Without the
        memory a 4x slower peer whose warm-up ran at 2e-05-4e-05 against the swarm's 1e-3 drew
        no step in a round, counted its rate as the swarm's, clipped the group's mean to 48x its
        tiny Δ alone and split its θ_g from the group's (CI, `test_a_slower_peer_is_neither_...`)."""
        if mean_lr > 0:
            self._steps_lr = mean_lr
        own = self._steps_lr
        return swarm_rate / own if own > 0 and swarm_rate > 0 else 1.0

    def allow_for_shortfall(self, ratio: float, rate: float = 1.0) -> None:
        """An average peer of the round trained `ratio` times what this node did (in tokens or in
        steps, whichever is more): this node may take a mean longer than its own Δ by ratio², up to
        MAX_ALLOWANCE (the swarm's pacing reports are clamped). `rate` is the swarm's inner
        learning rate over the round against the mean rate of this node's steps: Δ grows with
        it, and a joiner whose fresh optimizer warms up again trains at a fraction of the
        swarm's rate (CI: 1 step at 2e-05 against its group's 13 at about 4e-4 made a Δ 122x
        shorter than the group's mean, which it clipped alone, splitting its θ_g). The rates
        are this node's own schedule, no peer's report, so they are not held to MAX_ALLOWANCE;
        a rate above the swarm's allows nothing less."""
        ratio = ratio if math.isfinite(ratio) else MAX_ALLOWANCE
        self._rate = rate if math.isfinite(rate) and rate > 1.0 else 1.0
        self.allowance = min(max(ratio * ratio, 1.0), MAX_ALLOWANCE) * self._rate

    def allow_for_group(self, ratio: float) -> None:
        """The round's hop-0 group announced `ratio` times this node's tokens for a typical member
        (`AveragingResult.group_shortfall`): the allowance grows to what that shortfall allows,
        where it is more than the swarm's progress said (`allow_for_shortfall`). That was read
        while this node trained; in a swarm's first round, where no rate is known, its peers
        trained on after it (CI: 47 and 73 steps against its 14, and the mean it scaled down
        alone split θ_g). The weights are the group's signed registrations, each capped
        (peers/plan.py `capped_weights`), and the ratio is held to MAX_ALLOWANCE like a report."""
        if math.isfinite(ratio) and ratio > 1.0:
            self.allowance = max(self.allowance, min(ratio * ratio, MAX_ALLOWANCE) * self._rate)

    def bounded(self, mean: torch.Tensor | CodedDelta) -> torch.Tensor | CodedDelta:
        """The averaged Δ, scaled down in place to OUTER_REACH x this node's longest recent own Δ
        (x `allowance`) if it is longer: however a group's mean was made (a member's Δ x1000, a
        weight of 1e12 in a pair), this node's outer step stays within a few of its own."""
        scale = self.own_scale()
        if scale is None:
            return mean
        limit = OUTER_REACH * self.allowance * scale
        size = float(mean.norm() if isinstance(mean, CodedDelta) else torch.linalg.vector_norm(mean))
        if size <= limit:
            return mean
        factor = limit / size if math.isfinite(size) else 0.0
        log.warning(
            "the averaged Δ is %.4g long, over %.3g x this node's longest recent own Δ (%.4g): scaled down to that",
            size,
            OUTER_REACH * self.allowance,
            scale,
        )
        self.outer_steps_scaled += 1
        if isinstance(mean, CodedDelta):
            mean.scales.mul_(factor)
        else:
            mean.mul_(factor)
        return mean

    def bound_momentum(self, mean: torch.Tensor | CodedDelta) -> None:
        """Scale the outer momentum down in place, before the step along `mean` (already
        `bounded`), so that the buffer the step builds (μ·buf + mean) is at most 1/(1−μ) x this
        node's longest recent own Δ (x `allowance`): what means no longer than its own Δ could
        build (see above). By the triangle inequality, μ·‖buf‖ + ‖mean‖ is kept within it.
        Nothing before this node's first own Δ (no scale to hold it to)."""
        mu = self.outer.momentum
        scale = self.own_scale()
        if mu == 0 or scale is None:
            return
        reach = self.allowance / (1 - mu)
        limit = reach * scale
        size = float(mean.norm() if isinstance(mean, CodedDelta) else torch.linalg.vector_norm(mean))
        held = float(torch.linalg.vector_norm(self.outer.momentum_buffer))
        if math.isfinite(held) and mu * held + size <= limit:
            return
        # a bounded mean is at most OUTER_REACH·(1−μ) of the limit: the factor is positive
        factor = max(limit - size, 0.0) / (mu * held) if math.isfinite(held) and held > 0 else 0.0
        log.warning(
            "the outer momentum is %.4g long, with this round's mean over %.3g x this node's longest recent own Δ "
            "(%.4g): scaled down to that",
            held,
            reach,
            scale,
        )
        self.momenta_scaled += 1
        self.outer.momentum_buffer.mul_(factor)

    def resync_bound(self, solo_steps: int) -> DriftBound:
        """How far a θ_g re-sync may move this node's θ_g and momentum (see RESYNC_REACH), per
        step apart: θ_g by the largest of its recent outer steps (before its first, the step
        lr·(1+μ)·‖Δ‖ of its own longest recent Δ), the momentum by the longest of its recent own
        Δ and applied means. Each part of the result is checked against its share where it
        arrives (peers/part_result.py), and the whole move once more before it is taken
        (training/consensus_clip.py)."""
        own = self.own_scale() or 0.0
        step = max(self.update_scale() or 0.0, self.outer.lr * (1 + self.outer.momentum) * own)
        means = float(torch.stack(list(self._mean_norms)).max()) if self._mean_norms else 0.0
        apart = RESYNC_REACH * (1 + solo_steps)
        self.drift = DriftBound(apart * step, apart * max(own, means), self.numel)
        return self.drift

    def update_scale(self, rate_of: Callable[[int], float] | None = None, at_rate: float | None = None) -> float | None:
        """The largest of the last few outer steps' sizes (a bound on ‖θ_g after − θ_g before‖),
        or None before this process made one: how far θ_g moves in a step, which tells a
        download that is this node's swarm a few steps on from one that is not.

        With `rate_of` (a round's mean inner learning rate) and `at_rate`, each size is scaled
        to that rate first: Δ grows with the inner rate, and steps measured during its warmup
        (a node paused after its first rounds) are a fraction of the swarm's steps since."""
        if not self._update_sizes:
            return None
        sizes = torch.stack([size for size, _ in self._update_sizes])
        if rate_of is not None and at_rate is not None:
            rates = [rate_of(round_no) for _, round_no in self._update_sizes]
            factors = [at_rate / rate if rate > 0 else 1.0 for rate in rates]
            sizes = sizes * torch.tensor(factors, dtype=sizes.dtype, device=sizes.device)
        return float(sizes.max())

    def stepped(self, mean: torch.Tensor | CodedDelta, round_no: int) -> None:
        """An outer step was made along `mean` in round `round_no`: its size remembered."""
        self._update_sizes.append((self.outer.step_norm_bound(mean), round_no))
        self._mean_norms.append(mean.norm() if isinstance(mean, CodedDelta) else torch.linalg.vector_norm(mean))
