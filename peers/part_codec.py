"""How a member's slice of a part becomes what the wire carries, and what stays behind.

The plan's codec (int8 blocks, sparse top-k, or fp32) decides the payload; with error feedback,
what the code could not carry goes into the member's buffer for the next round instead of
being lost. A part whose reducer failed is applied from the member's own values, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dtnode.ops import sparse
from dtnode.ops.coded import CodedSlice
from dtnode.ops.quantization import dequantize, quantize, quantize_with_feedback

from .plan import INT8, SPARSE, GroupPlan
from .wire import Payload


@dataclass(frozen=True)
class Feedback:
    """This member's error-feedback buffer for the values it sends.

    `inject` (a hop's own Δ): what is sent is values + decay x buffer, and the buffer keeps
    what the code could not carry. Not `inject` (a later moshpit hop, whose values are a
    group's mean that already holds the buffer's mass): the buffer only collects what the
    code dropped, for the next round's Δ."""

    buffer: torch.Tensor
    inject: bool = True
    decay: float = 1.0


def encode_part(
    plan: GroupPlan, values: torch.Tensor | CodedSlice, residual: torch.Tensor | None, feedback: Feedback | None
) -> Payload:
    """Encode a chunk for the plan's codec; `residual` is the chunk's slice of the feedback buffer.
    A coded Δ's chunk is its own payload: the codes it holds are what the wire carries."""
    if isinstance(values, CodedSlice):
        return values.payload()
    if plan.codec == SPARSE:
        if plan.later_sparse_hop:  # a group's mean: its largest values on their support, 8-bit
            payload = sparse.encode_mean(values, plan.block_size, plan.sender_top_k)
        elif residual is not None and feedback is not None and feedback.inject:
            return sparse.encode_with_feedback(values, residual, plan.block_size, plan.top_k, feedback.decay)
        else:
            payload = sparse.encode(values, plan.block_size, plan.top_k)
        if residual is not None and feedback is not None:  # the buffer collects what was cut
            residual.add_(values).sub_(sparse.decode(payload))
        return payload
    if plan.codec != INT8:
        return values
    if residual is not None:
        return quantize_with_feedback(values, residual, plan.block_size)
    return quantize(values, plan.block_size)


def keep_own(
    target: torch.Tensor | CodedSlice,
    mine: torch.Tensor | CodedSlice,
    residual: torch.Tensor | None,
    before: torch.Tensor | None,
    feedback: Feedback | None,
) -> None:
    """A part whose reducer failed: this member applies its own values there exactly, with the
    feedback it would have sent (that buffer is then spent), or, at a later hop, its buffer
    goes back to what it held before this part was encoded."""
    assign(target, mine)
    if residual is None or before is None or feedback is None:
        return
    assert isinstance(target, torch.Tensor)  # a coded Δ has no feedback on the wire
    if feedback.inject:
        target.add_(before, alpha=feedback.decay)
        residual.zero_()
    else:
        residual.copy_(before)


def assign(target: torch.Tensor | CodedSlice, source: torch.Tensor | CodedSlice) -> None:
    """target ← source: codes into codes, fp32 into fp32 (butterfly_allreduce takes no mix)."""
    if isinstance(target, CodedSlice):
        assert isinstance(source, CodedSlice)
        target.copy_(source)
    else:
        assert isinstance(source, torch.Tensor)
        target.copy_(source)


def through_int8(own: torch.Tensor, block_size: int) -> torch.Tensor:
    """The reducer's own values as its senders' reach it: through the int8 code."""
    return dequantize(quantize(own, block_size))


def sparsify_own(plan: GroupPlan, own: torch.Tensor, residual: torch.Tensor | None, feedback: Feedback | None):
    """The reducer's own values as the group sees everyone's: through the same top-k code."""
    payload = encode_part(plan, own, residual, feedback)
    assert isinstance(payload, sparse.SparseBlocks)  # a sparse plan's code
    return sparse.decode(payload)


class EncodingError(RuntimeError):
    """Quantizing this member's values failed (its cause is chained): a bug, not the network."""
