"""Chunks on the wire: encoding, and the validation every received chunk goes through.

Nothing a peer sends is trusted. A chunk must name the plan's codec and block size, fit
inside its part at the expected offset, carry exactly the bytes its length implies and
only finite, non-negative scales; a sparse chunk must also keep the plan's count per block,
at positions inside their block, each once and in ascending order. Anything else raises
`ChunkError`, whose `reason` is what the refusal is counted by.
"""

from __future__ import annotations

import warnings
from typing import overload

import torch

from dtnode.ops import positions, sparse
from dtnode.ops.quantization import QuantizedBlocks, num_blocks
from dtnode.ops.sparse import SparseBlocks
from dtnode.proto import averaging_pb2 as pb

from .plan import FP32, SPARSE, SPARSE_SUPPORT, GroupPlan

# The data plane's format: the chunk fields, the codecs and what a reducer accepts of each.
# Raise it with every change that a peer of the previous version would refuse or misread:
# peers of two protocols cannot average together, so a joiner of another protocol is refused
# at the door (the swarm's recipe, daemon/workload/recipe.py) rather than failing part after part.
# 1: every version before this number was published; 2: a later moshpit hop's sparse chunks
# carry its group's mean on its support (CODEC_SPARSE_SUPPORT); 3: sparse positions are
# Elias-Fano coded (ops/positions.py), not 12 bits each; 4: without outer momentum a θ_g
# re-sync carries θ_g alone, not θ_g and a zero momentum (daemon/training/outer_replica.py);
# 5: the moshpit grid has the fewest hops whose cells hold up to 2M peers, agreed by majority
# (peers/grid.py): from 17 peers in groups of 4 a peer of 4 picks other hops, whose keys never meet;
# 6: a registration says how many groups its member stands in (`load`, signed with the swarm key)
# and each group's all-reduce deadline allows for its most loaded member (peers/group_reduce.py);
# a reducer says at once that it took a stream (REDUCING_METADATA); 7: a part whose reducer is in
# no group goes to its stand-in (peers/stand_in.py), a sender dropped from a part takes its mean
# (`reducer.SenderLate`), and a member still forming says so (FORMING_METADATA): a node of 6 would
# not stand in, and a mixed swarm's stand-ins would wait for it to their deadline; 8: a θ_g
# re-sync's plan names the members a strict majority outvoted `silent` (peers/plan.py, in the
# plan's id): a node of 7 would refuse such a re-sync's chunks, part after part.
PROTOCOL = 8
# the initial metadata a reducer sends as soon as it takes a stream into the part it reduces (it
# formed the sender's group): the sender then knows it present, whatever the DHT's records say
REDUCING_METADATA = ("x-dtnode-reducing", "1")
# beside a "not yet" answer (FAILED_PRECONDITION): this member is still forming its groups of
# that hop, or in the hop before (`ReductionRegistry.forming`)
FORMING_METADATA = ("x-dtnode-forming", "1")
# beside NOT_FOUND: this member took the sender for out of the group (`SenderAbsent`); it is in
# the group itself, unlike a member that formed other groups (peers/stand_in.py)
LEFT_OUT_METADATA = ("x-dtnode-left-out", "1")
MAX_WEIGHT = 1e12  # a weight is a token count; anything larger is a hostile or broken peer
WEIGHT_SLACK = 1e-9  # a stream's weight is its registration's, bit for bit: slack for float printing only
Payload = QuantizedBlocks | SparseBlocks | torch.Tensor


class RefusalReason:
    """Why a chunk was refused: the label it is counted by."""

    MALFORMED = "malformed"
    INDEX_OUT_OF_RANGE = "index_out_of_range"
    DUPLICATE_INDEX = "duplicate_index"
    WRONG_COUNT = "wrong_count"
    BAD_SCALE = "bad_scale"
    NON_FINITE = "non_finite"
    BAD_WEIGHT = "bad_weight"


class ChunkError(ValueError):
    """A chunk that does not match the plan; its sender's stream is refused."""

    def __init__(self, message: str, reason: str = RefusalReason.MALFORMED):
        super().__init__(message)
        self.reason = reason


def max_message_bytes(chunk_elements: int) -> int:
    """Largest legal message: an fp32 chunk plus its header, with headroom."""
    return 4 * chunk_elements + (1 << 16)


def numel_of(payload: Payload) -> int:
    return payload.numel if isinstance(payload, QuantizedBlocks | SparseBlocks) else payload.numel()


def _frombuffer(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    """Zero-copy read-only view of message bytes (never written to)."""
    if not data:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.frombuffer(data, dtype=dtype)


# the largest scale whose every code (down to -128) decodes to a finite float32
MAX_SCALE = torch.finfo(torch.float32).max / 128


def decode_chunk(
    chunk: pb.PartChunk, plan: GroupPlan, part_length: int, expected_offset: int, result: bool = False
) -> Payload:
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
    codec = plan.result_codec if result else plan.sender_codec
    if chunk.codec != codec:
        raise ChunkError(f"codec {chunk.codec}, plan uses {codec}")
    values = chunk.values  # each access of a bytes field copies it: read once
    if plan.codec == FP32:
        if len(values) != 4 * n or len(chunk.scales):
            raise ChunkError("fp32 chunk has the wrong byte count")
        decoded = _frombuffer(values, torch.float32)
        if not bool(torch.isfinite(decoded).all()):
            raise ChunkError("non-finite values", RefusalReason.NON_FINITE)
        return decoded
    if chunk.block_size != plan.block_size:
        raise ChunkError(f"block size {chunk.block_size}, plan uses {plan.block_size}")
    if plan.codec == SPARSE:
        return _decode_sparse(chunk, plan, n, values, result)
    scale_bytes = chunk.scales
    if len(values) != n or len(scale_bytes) != 4 * num_blocks(n, plan.block_size):
        raise ChunkError("int8 chunk has the wrong byte count")
    scales = _frombuffer(scale_bytes, torch.float32)
    _check_scales(scales)
    return QuantizedBlocks(_frombuffer(values, torch.int8), scales, plan.block_size)


def _check_scales(scales: torch.Tensor) -> None:
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise ChunkError("non-finite or negative scales", RefusalReason.BAD_SCALE)
    if bool((scales > MAX_SCALE).any()):  # a code of -128 would decode to inf
        raise ChunkError(
            f"a scale over {MAX_SCALE:.3g}: its block would decode to non-finite values", RefusalReason.BAD_SCALE
        )


def _decode_sparse(chunk: pb.PartChunk, plan: GroupPlan, n: int, values: bytes, result: bool) -> SparseBlocks:
    """A sender's top-k chunk (exactly the plan's count per block, 2-bit values; at most its
    count in a later hop, 8-bit values) or a reducer's mean (at most every member's count per
    block, 8-bit values), positions strictly ascending inside each block."""
    block = plan.block_size
    nb = num_blocks(n, block)
    lengths = sparse.block_lengths(n, block)
    count_bytes = chunk.counts
    if len(count_bytes) != 2 * nb:
        raise ChunkError(f"{len(count_bytes)} bytes of counts for {nb} blocks", RefusalReason.WRONG_COUNT)
    counts = _frombuffer(count_bytes, torch.int16).to(torch.int64) & 0xFFFF
    eight_bit = result or plan.later_sparse_hop
    if result:
        allowed = lengths.clamp_max(len(plan.members) * plan.sender_top_k)
        if chunk.top_k != 0 or bool((counts > allowed).any()):
            raise ChunkError("a result block holds more values than its members kept", RefusalReason.WRONG_COUNT)
    elif eight_bit:
        if chunk.top_k != plan.sender_top_k or bool((counts > lengths.clamp_max(plan.sender_top_k)).any()):
            raise ChunkError(f"a block keeps more than {plan.sender_top_k} values", RefusalReason.WRONG_COUNT)
    elif chunk.top_k != plan.top_k or not torch.equal(counts, lengths.clamp_max(plan.top_k)):
        raise ChunkError(f"a block does not keep exactly top_k={plan.top_k} values", RefusalReason.WRONG_COUNT)
    total = int(counts.sum())
    index_bytes = chunk.indices
    if len(index_bytes) != positions.packed_position_bytes(counts, lengths):
        raise ChunkError("sparse chunk has the wrong byte count of positions", RefusalReason.WRONG_COUNT)
    try:
        indices = positions.unpack_positions(_frombuffer(index_bytes, torch.uint8), counts, lengths)
    except ValueError as e:  # a block's bitvector that does not hold its count, or stray padding
        raise ChunkError(f"malformed positions: {e}", RefusalReason.WRONG_COUNT) from e
    owner = torch.repeat_interleave(torch.arange(nb), counts, output_size=total)
    if bool((indices >= lengths[owner]).any()):
        raise ChunkError("a position outside its block", RefusalReason.INDEX_OUT_OF_RANGE)
    same_block = owner[1:] == owner[:-1]
    if bool((same_block & (indices[1:] <= indices[:-1])).any()):
        raise ChunkError("a position repeated, or out of order, in its block", RefusalReason.DUPLICATE_INDEX)
    bits = sparse.EIGHT_BIT if eight_bit else sparse.TWO_BIT
    levels = 1 if eight_bit else 2
    code_bytes = total if eight_bit else sparse.packed_two_bit_bytes(total)
    scale_bytes = chunk.scales
    if len(values) != code_bytes or len(scale_bytes) != 4 * levels * nb:
        raise ChunkError("sparse chunk has the wrong byte count of values or scales", RefusalReason.WRONG_COUNT)
    scales = _frombuffer(scale_bytes, torch.float32).view(nb, levels)
    _check_scales(scales)
    raw = _frombuffer(values, torch.int8 if eight_bit else torch.uint8)
    codes = raw if eight_bit else sparse.unpack_two_bit(raw, total)
    return SparseBlocks(counts, indices, codes, scales, n, block, bits)


def payload_size(payload: Payload) -> int:
    """Wire bytes of a decoded payload (without copying the message's bytes again)."""
    if isinstance(payload, QuantizedBlocks):
        return payload.codes.numel() + 4 * payload.scales.numel()
    if isinstance(payload, SparseBlocks):
        return sparse.wire_bytes(payload)
    return 4 * payload.numel()


def chunk_message(
    plan: GroupPlan, part: int, sender: str, weight: float, offset: int, payload: Payload, result: bool = False
) -> pb.PartChunk:
    """A sender's chunk, or (`result`) a reducer's chunk of the mean."""
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
        codec=plan.codec,  # a sparse payload names its own code below
    )
    if isinstance(payload, SparseBlocks):
        eight_bit = payload.value_bits == sparse.EIGHT_BIT
        msg.codec = SPARSE_SUPPORT if eight_bit else SPARSE
        msg.block_size = payload.block_size
        msg.top_k = 0 if result else plan.sender_top_k
        msg.counts = payload.counts.to(torch.int16).numpy().tobytes()  # counts <= 4096 fit
        lengths = sparse.block_lengths(payload.numel, payload.block_size)
        msg.indices = positions.pack_positions(payload.indices, payload.counts, lengths).numpy().tobytes()
        codes = payload.codes if eight_bit else sparse.pack_two_bit(payload.codes)
        msg.values = codes.numpy().tobytes()
        msg.scales = payload.scales.contiguous().numpy().tobytes()
    elif isinstance(payload, QuantizedBlocks):
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
def slice_payload(
    payload: QuantizedBlocks | torch.Tensor, offset: int, length: int, block_size: int
) -> QuantizedBlocks | torch.Tensor:
    """A block-aligned slice of a dense payload (views, no copies)."""
    if isinstance(payload, QuantizedBlocks):
        first = offset // block_size
        return QuantizedBlocks(
            payload.codes[offset : offset + length],
            payload.scales[first : first + num_blocks(length, block_size)],
            block_size,
        )
    return payload[offset : offset + length]
