"""Chunks on the wire: encoding, and the validation every received chunk goes through.

Nothing a peer sends is trusted. A chunk must name the plan's codec and block size, fit
inside its part at the expected offset, carry exactly the bytes its length implies and
only finite, non-negative scales; anything else raises `ChunkError`.
"""

from __future__ import annotations

import warnings
from typing import overload

import torch

from dtnode.ops.quantization import QuantizedBlocks, num_blocks
from dtnode.proto import averaging_pb2 as pb

from .plan import FP32, GroupPlan

MAX_WEIGHT = 1e12  # a weight is a token count; anything larger is a hostile or broken peer
Payload = QuantizedBlocks | torch.Tensor


class ChunkError(ValueError):
    """A chunk that does not match the plan; its sender's stream is refused."""


def max_message_bytes(chunk_elements: int) -> int:
    """Largest legal message: an fp32 chunk plus its header, with headroom."""
    return 4 * chunk_elements + (1 << 16)


def numel_of(payload: Payload) -> int:
    return payload.numel if isinstance(payload, QuantizedBlocks) else payload.numel()


def _frombuffer(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    """Zero-copy read-only view of message bytes (never written to)."""
    if not data:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.frombuffer(data, dtype=dtype)


# the largest scale whose every code (down to -128) decodes to a finite float32
MAX_SCALE = torch.finfo(torch.float32).max / 128


def decode_chunk(chunk: pb.PartChunk, plan: GroupPlan, part_length: int, expected_offset: int) -> Payload:
    """Validate a chunk's payload against the plan; return int8 blocks or fp32 values.

    Every int8 code (including -128) decodes to within 128 times its block's scale, so codes
    need no check beyond their count; scales must be finite, non-negative and at most
    MAX_SCALE (so that the decoded values are finite too), fp32 values finite.
    """
    n = chunk.length
    if chunk.offset != expected_offset:
        raise ChunkError(f"chunk offset {chunk.offset}, expected {expected_offset}")
    if n == 0 or n > plan.chunk_elements or chunk.offset + n > part_length:
        raise ChunkError(f"chunk length {n} at offset {chunk.offset} does not fit part of {part_length}")
    if chunk.codec != plan.codec:
        raise ChunkError(f"codec {chunk.codec}, plan uses {plan.codec}")
    values = chunk.values  # each access of a bytes field copies it: read once
    if plan.codec == FP32:
        if len(values) != 4 * n or len(chunk.scales):
            raise ChunkError("fp32 chunk has the wrong byte count")
        decoded = _frombuffer(values, torch.float32)
        if not bool(torch.isfinite(decoded).all()):
            raise ChunkError("non-finite values")
        return decoded
    if chunk.block_size != plan.block_size:
        raise ChunkError(f"block size {chunk.block_size}, plan uses {plan.block_size}")
    scale_bytes = chunk.scales
    if len(values) != n or len(scale_bytes) != 4 * num_blocks(n, plan.block_size):
        raise ChunkError("int8 chunk has the wrong byte count")
    scales = _frombuffer(scale_bytes, torch.float32)
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise ChunkError("non-finite or negative scales")
    if bool((scales > MAX_SCALE).any()):  # a code of -128 would decode to inf
        raise ChunkError(f"a scale over {MAX_SCALE:.3g}: its block would decode to non-finite values")
    return QuantizedBlocks(_frombuffer(values, torch.int8), scales, plan.block_size)


def payload_size(payload: Payload) -> int:
    """Wire bytes of a decoded payload (without copying the message's bytes again)."""
    if isinstance(payload, QuantizedBlocks):
        return payload.codes.numel() + 4 * payload.scales.numel()
    return 4 * payload.numel()


def chunk_message(
    plan: GroupPlan, part: int, sender: str, weight: float, offset: int, payload: Payload
) -> pb.PartChunk:
    msg = pb.PartChunk(
        run_id=plan.run_id,
        round=plan.round,
        hop=plan.hop,
        group_id=plan.group_id,
        part=part,
        sender=sender,
        weight=weight,
        offset=offset,
        length=numel_of(payload),
        codec=plan.codec,
    )
    if isinstance(payload, QuantizedBlocks):
        msg.block_size = plan.block_size
        msg.values = payload.codes.numpy().tobytes()
        msg.scales = payload.scales.numpy().tobytes()
    else:
        msg.values = payload.contiguous().numpy().tobytes()
    return msg


@overload
def slice_payload(payload: QuantizedBlocks, offset: int, length: int, block_size: int) -> QuantizedBlocks: ...
@overload
def slice_payload(payload: torch.Tensor, offset: int, length: int, block_size: int) -> torch.Tensor: ...
def slice_payload(payload: Payload, offset: int, length: int, block_size: int) -> Payload:
    """A block-aligned slice of a payload (views, no copies)."""
    if isinstance(payload, QuantizedBlocks):
        first = offset // block_size
        return QuantizedBlocks(
            payload.codes[offset : offset + length],
            payload.scales[first : first + num_blocks(length, block_size)],
            block_size,
        )
    return payload[offset : offset + length]
