"""Sparse pseudo-gradients: top-k per block, 2-bit values, Elias-Fano positions, error feedback.

A pseudo-gradient is cut into blocks of `block_size` values (at most 4,096). Each block keeps
its `k` largest values by magnitude; the rest are not sent and stay in the node's error-feedback
buffer for the next round (SparseLoCo, arXiv:2508.15706). A kept value travels in 2 bits: its
sign, and whether it is above the block's mean kept magnitude; the block sends the two mean
magnitudes (below and above) as its scales, a one-step Lloyd-Max quantizer of the kept
magnitudes. A block's positions travel Elias-Fano coded (positions.py): 8 bits each for 64 of
4,096, where fixed 12-bit positions took 12. With k = 64 of 4,096 a parameter costs 64 x (8+2)
bits + 8 bytes of scales + 2 bytes of count per 4,096 values: 0.022 bytes, 182x less than fp32
(0.030 with 12-bit positions).

The mean of several members' sparse payloads is supported on the union of their positions:
`encode_support` sends it with 8-bit values (one absmax scale per block), so an averaged
result is exact to int8 precision at every position any member kept. `encode_mean` sends at
most k of such a mean's values per block, the same way (a later moshpit hop's input).

Everything is vectorised over blocks (one `topk`, one sort, no Python loop over blocks) and
runs on whatever device the input is on. Pure tensor math: no I/O, nothing about the wire
beyond the byte packing in `pack_*`/`unpack_*` and positions.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .positions import packed_position_bytes, position_bits_per_block
from .quantization import INT8_MAX, NonFiniteError, num_blocks

MAX_BLOCK = 4096  # a block's positions and its count (2 bytes on the wire) stay small
TWO_BIT = 2
EIGHT_BIT = 8
DEFAULT_SPARSE_BLOCK = 4096
DEFAULT_TOP_K = 64


@dataclass(frozen=True)
class SparseBlocks:
    """The kept values of a flat tensor of `numel` values, block by block.

    `counts[b]` values are kept in block b; their positions inside the block (`indices`,
    ascending within each block) and value codes (`codes`) follow block after block. With
    2-bit values a code is sign (bit 0) and high magnitude (bit 1), decoded through the
    block's two scales (low, high); with 8-bit values a code is a signed level of the block's
    one scale (absmax / 127)."""

    counts: torch.Tensor  # int64 (num_blocks,)
    indices: torch.Tensor  # int64 (total,)
    codes: torch.Tensor  # int8 (total,)
    scales: torch.Tensor  # float32 (num_blocks, 2) for 2-bit values, (num_blocks, 1) for 8-bit
    numel: int
    block_size: int
    value_bits: int

    @property
    def kept(self) -> int:
        return self.indices.numel()

    @property
    def density(self) -> float:
        return self.kept / self.numel if self.numel else 0.0


def check_block_size(block_size: int) -> None:
    if not 1 <= block_size <= MAX_BLOCK:
        raise ValueError(f"sparse block size must be in 1..{MAX_BLOCK}")


def block_lengths(numel: int, block_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Values in each block: block_size, except a shorter last block."""
    lengths = torch.full((num_blocks(numel, block_size),), block_size, dtype=torch.int64, device=device)
    if numel % block_size:
        lengths[-1] = numel % block_size
    return lengths


def positions(payload: SparseBlocks) -> torch.Tensor:
    """Flat positions of the kept values (block start + position inside the block)."""
    starts = torch.arange(payload.counts.numel(), device=payload.indices.device) * payload.block_size
    return torch.repeat_interleave(starts, payload.counts, output_size=payload.kept) + payload.indices


def _block_of_each(payload: SparseBlocks) -> torch.Tensor:
    blocks = torch.arange(payload.counts.numel(), device=payload.indices.device)
    return torch.repeat_interleave(blocks, payload.counts, output_size=payload.kept)


def values_of(payload: SparseBlocks) -> torch.Tensor:
    """The decoded kept values, in payload order."""
    owner = _block_of_each(payload)
    codes = payload.codes.to(torch.int64)
    if payload.value_bits == TWO_BIT:
        magnitude = payload.scales[owner, codes >> 1]
        return torch.where((codes & 1).bool(), -magnitude, magnitude)
    return codes.to(torch.float32) * payload.scales[owner, 0]


def decode(payload: SparseBlocks, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense fp32 tensor the payload stands for (zeros where nothing was kept)."""
    if out is None:
        out = torch.empty(payload.numel, dtype=torch.float32, device=payload.indices.device)
    if out.numel() != payload.numel or out.dtype != torch.float32:
        raise ValueError("output must be fp32 with one value per position")
    out.zero_()
    out.index_put_((positions(payload),), values_of(payload))
    return out


def _top_k_rows(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (ascending) and values of the k largest magnitudes of every row."""
    picked = rows.abs().topk(k, dim=1, sorted=False).indices
    picked = picked.sort(dim=1).values
    return picked, rows.gather(1, picked)


def top_k(x: torch.Tensor, block_size: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(counts, indices, values) of the k largest magnitudes of each block of flat `x`.

    The full blocks go through one batched topk; a shorter last block keeps min(k, its
    length) values in a second call. Ties are broken by topk; positions come out ascending."""
    check_block_size(block_size)
    if k < 1:
        raise ValueError("k must be >= 1")
    n = x.numel()
    full = n // block_size
    parts_idx, parts_val = [], []
    keep = min(k, block_size)
    if full:
        idx, val = _top_k_rows(x[: full * block_size].view(full, block_size), keep)
        parts_idx.append(idx.reshape(-1))
        parts_val.append(val.reshape(-1))
    tail = n - full * block_size
    if tail:
        idx, val = _top_k_rows(x[full * block_size :].view(1, tail), min(k, tail))
        parts_idx.append(idx.reshape(-1))
        parts_val.append(val.reshape(-1))
    counts = torch.full((full,), keep, dtype=torch.int64, device=x.device)
    if tail:
        counts = torch.cat([counts, torch.tensor([min(k, tail)], dtype=torch.int64, device=x.device)])
    if not parts_idx:
        empty = torch.empty(0, dtype=torch.int64, device=x.device)
        return counts, empty, torch.empty(0, dtype=x.dtype, device=x.device)
    return counts, torch.cat(parts_idx), torch.cat(parts_val)


def encode(x: torch.Tensor, block_size: int = DEFAULT_SPARSE_BLOCK, k: int = DEFAULT_TOP_K) -> SparseBlocks:
    """Top-k per block with 2-bit values (sign, and low or high mean magnitude of the block)."""
    counts, indices, values, owner = _kept(x, block_size, k)
    nb = counts.numel()
    magnitude = values.abs()
    per_block = counts.clamp_min(1).to(torch.float32)
    mean = torch.zeros(nb, device=x.device).index_add_(0, owner, magnitude) / per_block
    high = magnitude > mean[owner]
    scales = torch.zeros(nb, 2, device=x.device)
    scales.index_put_((owner, high.long()), magnitude, accumulate=True)
    members = torch.zeros(nb, 2, device=x.device)
    members.index_put_((owner, high.long()), torch.ones_like(magnitude), accumulate=True)
    scales = scales / members.clamp_min(1)
    codes = (high.to(torch.int8) << 1) | (values < 0).to(torch.int8)
    return SparseBlocks(counts, indices, codes, scales, x.numel(), block_size, TWO_BIT)


def _kept(x: torch.Tensor, block_size: int, k: int) -> tuple[torch.Tensor, ...]:
    """(counts, indices, values, owning block of each) of the top-k of flat, finite `x`."""
    if x.dim() != 1:
        raise ValueError("encode expects a flat tensor")
    counts, indices, values = top_k(x.float(), block_size, k)
    if values.numel() and not bool(torch.isfinite(values).all()):
        raise NonFiniteError("cannot encode non-finite values")
    owner = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts, output_size=values.numel())
    return counts, indices, values, owner


def encode_mean(x: torch.Tensor, block_size: int = DEFAULT_SPARSE_BLOCK, k: int = DEFAULT_TOP_K) -> SparseBlocks:
    """At most k values per block, the largest, with 8-bit codes (blockwise absmax scale): how a
    later moshpit hop sends a group's mean, which is already sparse (on its members' union) and
    whose values are no longer two magnitudes. Values that code to 0 are not sent, so a block
    whose mean holds fewer than k nonzeros sends just those."""
    counts, indices, values, owner = _kept(x, block_size, k)
    codes, scales = _eight_bit(values, owner, counts.numel())
    sent = codes != 0
    counts = torch.bincount(owner[sent], minlength=counts.numel())
    return SparseBlocks(counts, indices[sent], codes[sent], scales, x.numel(), block_size, EIGHT_BIT)


def encode_with_feedback(
    x: torch.Tensor,
    residual: torch.Tensor,
    block_size: int = DEFAULT_SPARSE_BLOCK,
    k: int = DEFAULT_TOP_K,
    decay: float = 1.0,
) -> SparseBlocks:
    """Error feedback: encode x + decay * residual and leave in `residual` what was not sent.

    Whatever top-k dropped and the 2-bit values rounded off is carried into the next round,
    so the sum of what is sent over rounds follows the sum of the pseudo-gradients
    (SparseLoCo's buffer; decay < 1 lets old mass fade, as its momentum-like decay does).
    `residual` is updated in place; `x` is not touched."""
    if residual.shape != x.shape or residual.dtype != torch.float32:
        raise ValueError("residual must be fp32 and shaped like x")
    corrected = x.float() + residual * decay if decay != 1.0 else x.float() + residual
    payload = encode(corrected, block_size, k)
    decode(payload, out=residual)
    torch.sub(corrected, residual, out=residual)
    return payload


def encode_support(x: torch.Tensor, block_size: int = DEFAULT_SPARSE_BLOCK) -> SparseBlocks:
    """Every nonzero value of `x` with an 8-bit code (blockwise absmax scale): how a reducer
    returns the mean of sparse payloads, which is nonzero only where some member kept a value."""
    check_block_size(block_size)
    if x.dim() != 1:
        raise ValueError("encode_support expects a flat tensor")
    x = x.float()
    nb = num_blocks(x.numel(), block_size)
    where = torch.nonzero(x).squeeze(1)
    values = x[where]
    if values.numel() and not bool(torch.isfinite(values).all()):
        raise NonFiniteError("cannot encode non-finite values")
    owner = torch.div(where, block_size, rounding_mode="floor")
    counts = torch.bincount(owner, minlength=nb)
    codes, scales = _eight_bit(values, owner, nb)
    return SparseBlocks(counts, where - owner * block_size, codes, scales, x.numel(), block_size, EIGHT_BIT)


def _eight_bit(values: torch.Tensor, owner: torch.Tensor, nb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes of kept values and their blocks' scales (absmax / 127, shape (nb, 1))."""
    absmax = torch.zeros(nb, device=values.device).scatter_reduce_(0, owner, values.abs(), "amax")
    inverse = torch.where(absmax > 0, INT8_MAX / absmax.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    codes = (values * inverse[owner]).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, (absmax / INT8_MAX).unsqueeze(1)


# ---- bytes -------------------------------------------------------------------------------
def pack_two_bit(codes: torch.Tensor) -> torch.Tensor:
    """2-bit codes, four to a byte (uint8), padded with zeros."""
    c = codes.to(torch.uint8)
    pad = -c.numel() % 4
    if pad:
        c = torch.cat([c, c.new_zeros(pad)])
    c = c.view(-1, 4)
    return c[:, 0] | (c[:, 1] << 2) | (c[:, 2] << 4) | (c[:, 3] << 6)


def unpack_two_bit(packed: torch.Tensor, count: int) -> torch.Tensor:
    if packed.numel() != packed_two_bit_bytes(count):
        raise ValueError("packed codes have the wrong byte count")
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 3).reshape(-1)[:count].to(torch.int8)


def packed_two_bit_bytes(count: int) -> int:
    return (count + 3) // 4


def wire_bytes(payload: SparseBlocks) -> int:
    """Bytes of the payload on the wire: counts (2 each), positions, codes and scales."""
    codes = packed_two_bit_bytes(payload.kept) if payload.value_bits == TWO_BIT else payload.kept
    lengths = block_lengths(payload.numel, payload.block_size, payload.counts.device)
    positions = packed_position_bytes(payload.counts, lengths)
    return 2 * payload.counts.numel() + positions + codes + 4 * payload.scales.numel()


def bytes_per_value(block_size: int, k: int) -> float:
    """Wire bytes per parameter of a 2-bit top-k payload of a long tensor."""
    kept = min(k, block_size)
    return (2 + position_bits_per_block(kept, block_size) / 8 + kept / 4 + 8) / block_size


def support_bytes_per_value(block_size: int, kept: int) -> float:
    """Wire bytes per parameter of an 8-bit payload keeping `kept` values of each block (at most)."""
    kept = min(kept, block_size)
    return (2 + position_bits_per_block(kept, block_size) / 8 + kept + 4) / block_size
