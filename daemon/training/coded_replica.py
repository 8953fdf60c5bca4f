"""A replica whose Δ is int8 codes: the int8 codec on a node whose θ_g is in host memory (a CPU
node, and a sharded host's rank 0, where host memory decides the largest model it trains).

With the int8 codec every value of Δ reaches the wire through the code anyway, and the group's
mean comes back coded. So Δ is coded as it is taken (θ_g − θ_l, a slice or, sharded, a
parameter at a time), the wire carries those very codes, each part's mean is written over them
as the codes it came back in, and the outer step decodes it a slice at a time: 1 byte per
parameter for Δ, not 4, and no model-sized fp32 Δ at any moment (ops/coded.py).

With --overlap the Δ in flight is coded too (1 byte per parameter more, not 4), and landing its
average moves θ_l by (θ_g' − θ_g) + the Δ in flight in one pass that steps θ_g a span at a
time (`LocalWeights.add`): no model-sized fp32 buffer there either. θ_l then keeps what the code
of the Δ in flight lost (its rounding error), and the next Δ carries it: nothing is lost.

int8 error feedback (--error-feedback), when on, is taken as Δ is coded (`feedback`), not on
the wire: the codes the wire sends already hold it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from dtnode.daemon.training.outer_replica import Replica
from dtnode.daemon.training.ranks.host import LocalRankFailure
from dtnode.daemon.training.theta_local import SpanWork
from dtnode.daemon.training.trainer import Trainer
from dtnode.ops.coded import DECODE_SLICE, CodedDelta, SpanEncoder
from dtnode.ops.quantization import NonFiniteError
from dtnode.peers.part_result import DriftBound

log = logging.getLogger("dtnode")


class CodedReplica(Replica):
    def __init__(self, trainer: Trainer, outer_lr: float, outer_momentum: float, block_size: int):
        """`block_size`: the int8 codec's block, the swarm's (the codes go out as they are)."""
        self.block_size = block_size
        if trainer.local_weights.span_device.type != "cpu":
            raise ValueError("a coded Δ lives beside θ_g in host memory; a GPU's θ_g stages Δ in fp32")
        super().__init__(trainer, outer_lr, outer_momentum)
        self.feedback: torch.Tensor | None = None  # int8 error feedback (the worker's buffer), if on
        self._in_flight_codes: CodedDelta | None = None  # --overlap: the Δ being averaged

    def _new_staging(self, n: int, pin: bool) -> CodedDelta:
        return CodedDelta(n, self.block_size)

    @property
    def coded(self) -> bool:
        return True

    @property
    def staged(self) -> CodedDelta:
        assert isinstance(self.delta_cpu, CodedDelta)  # `_new_staging` made it
        return self.delta_cpu

    @torch.no_grad()
    def pseudo_gradient(self) -> CodedDelta:
        """Δ = θ_g − θ_l, coded into the staging buffer (returned)."""
        self._code_difference(self.local.read, self.staged)
        self.bounds.measure_own(self.staged)
        return self.staged

    def _code_difference(self, read: Callable[[SpanWork], object], target: CodedDelta) -> None:
        """target ← θ_g − (each span of θ_l `read` hands over), coded a slice at a time. A
        non-finite value is a FloatingPointError: the round fails and θ_l goes back to θ_g, as
        for a non-finite loss (nothing non-finite is ever coded or sent)."""
        encoder = SpanEncoder(target, self.feedback)
        scratch = torch.empty(min(DECODE_SLICE, self.numel), dtype=torch.float32)

        def code(span: slice, values: torch.Tensor) -> None:
            for at in range(0, values.numel(), DECODE_SLICE):
                part = values[at : at + DECODE_SLICE]
                start = span.start + at
                difference = scratch[: part.numel()]
                encoder.add(torch.sub(self.theta_g[start : start + part.numel()], part, out=difference))

        try:
            read(code)
            encoder.finish()
        except NonFiniteError as e:
            raise FloatingPointError(f"the pseudo-gradient holds non-finite values ({e})") from e

    def _coded_in_flight(self) -> CodedDelta:
        if self._in_flight_codes is None:
            self._in_flight_codes = CodedDelta(self.numel, self.block_size)
        return self._in_flight_codes

    @torch.no_grad()
    def stage_delta(self) -> CodedDelta:
        """--overlap: this round's Δ coded once, kept in flight, and its codes copied to the
        staging buffer, which the network writes the mean over (returned)."""
        in_flight = self._coded_in_flight()
        self._code_difference(self.local.read, in_flight)
        self.bounds.measure_own(in_flight)
        self.has_in_flight = True
        self.staged.whole().copy_(in_flight.whole())
        return self.staged

    @torch.no_grad()
    def reset_local(self) -> None:
        """θ_l ← θ_g, minus the Δ still in flight (decoded a slice at a time)."""
        if not self.has_in_flight:
            self._local_from(self.theta_g)
            return
        in_flight = self._coded_in_flight()

        def minus_in_flight(span: slice, out: torch.Tensor) -> None:
            for at in range(span.start, span.stop, DECODE_SLICE):
                end = min(at + DECODE_SLICE, span.stop)
                torch.sub(self.theta_g[at:end], in_flight.values(at, end), out=out[at - span.start : end - span.start])

        self.local.write(minus_in_flight)

    @torch.no_grad()
    def land(
        self,
        mean_cpu: torch.Tensor | CodedDelta | None,
        consensus_cpu: torch.Tensor | None,
        bound: DriftBound | None = None,
    ) -> None:
        """--overlap: the average's outer step (Replica.land says when and why), as
        θ_l += (θ_g' − θ_g) + (the Δ in flight, when the mean replaces it), in one pass that
        re-syncs and steps θ_g a span at a time. A failed average (mean None) moves θ_l only by
        a re-sync's change of θ_g, if any: its Δ goes out again inside the next one."""
        if consensus_cpu is not None:
            self._check_consensus(consensus_cpu, bound)
        if mean_cpu is not None:
            mean_cpu = self.bounds.bounded(mean_cpu)
            if consensus_cpu is None:  # a re-synced momentum arrives span by span, held to its own bound
                self.bounds.bound_momentum(mean_cpu)
        replaced = self.has_in_flight and mean_cpu is not None
        in_flight = self._coded_in_flight()
        moved = 0  # θ_g's values [0, moved) have their re-sync and step

        def move(start: int, stop: int) -> None:
            nonlocal moved
            if consensus_cpu is not None:
                self._consensus_range(consensus_cpu, start, stop)
            if mean_cpu is not None:
                self.outer.step_range(self.theta_g, mean_cpu, start, stop)
            moved = stop

        def amount(span: slice, out: torch.Tensor) -> None:
            torch.neg(self.theta_g[span], out=out)
            move(span.start, span.stop)
            out.add_(self.theta_g[span])
            if replaced:
                out.add_(in_flight.values(span.start, span.stop))

        try:
            self.local.add(amount)
        except LocalRankFailure as e:  # a sharded host whose rank died: θ_l is lost, θ_g lands whole
            log.warning("landing the outer step without θ_l (%s): the node restarts from θ_g", e)
        move(moved, self.numel)
        if mean_cpu is not None:
            self._stepped(mean_cpu)
        self.has_in_flight = False
