"""Positions inside blocks, Elias-Fano coded: about 2 + log2(block / count) bits each.

A sparse payload keeps `count` ascending positions in each block of `length` values. Fixed
12-bit positions cost 12 bits each whatever the density; Elias-Fano splits each position into
`low = floor(log2(length / count))` low bits, written as they are, and a high part, written in
unary in a bitvector of `count + ((length - 1) >> low) + 1` bits (the i-th position sets bit
`high + i`). For the top 64 of 4,096 values that is 8 bits a position instead of 12, and for
the union of a group of 4's positions (about 230 of 4,096) about 6: the sparse wire's largest
part shrinks by a third. The code is within 2 bits a position of the entropy of the position
set, and, unlike an entropy coder, it decodes with a handful of vectorised tensor ops.

Layout of one payload: the low bits of every position (block after block, each position's
bits least significant first), then every block's high bitvector, then zero bits up to a
byte; bits fill each byte from its least significant end. A block's count is known to the
receiver before its positions (the wire carries the counts first), so nothing else is sent.

Decoding is strict, since the bytes come from peers: the byte count must be exact, each
block's bitvector must hold exactly its count of set bits, and the padding must be zero.
What it cannot see (a position past its block's end, a position repeated) the caller checks
on the decoded positions, as it did with 12-bit positions.

Everything is vectorised over blocks and positions (no Python loop over either); it runs on
whatever device the inputs are on. Pure tensor math, no I/O.
"""

from __future__ import annotations

import torch

MAX_LOW_BITS = 12  # blocks hold at most 4,096 values
_BIT = torch.arange(8, dtype=torch.uint8)


def low_bits(counts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """floor(log2(length / count)) per block (0 where count is 0 or count >= length): a float
    estimate, corrected by one step either way so that it is exact in integers."""
    c = counts.clamp_min(1)
    low = torch.log2(lengths.double() / c.double()).floor_().clamp_(0, MAX_LOW_BITS).to(counts.dtype)
    low += (((c << (low + 1)) <= lengths) & (low < MAX_LOW_BITS)).to(low.dtype)
    low -= (((c << low) > lengths) & (low > 0)).to(low.dtype)
    return torch.where(counts > 0, low, 0)


def _high_lengths(counts: torch.Tensor, lengths: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    return torch.where(counts > 0, counts + ((lengths - 1) >> low) + 1, 0)


def packed_position_bits(counts: torch.Tensor, lengths: torch.Tensor) -> int:
    low = low_bits(counts, lengths)
    return int((counts * low).sum() + _high_lengths(counts, lengths, low).sum())


def packed_position_bytes(counts: torch.Tensor, lengths: torch.Tensor) -> int:
    """Bytes of the positions of blocks with these counts and lengths."""
    return (packed_position_bits(counts, lengths) + 7) // 8


def position_bits_per_block(count: int, length: int) -> int:
    """Bits of `count` positions in one block of `length` values (for size estimates)."""
    if count <= 0:
        return 0
    low = 0
    while low < MAX_LOW_BITS and count << (low + 1) <= length:
        low += 1
    return count * low + count + ((length - 1) >> low) + 1


class _Layout:
    """Where each position's bits go: shared by the encoder and the decoder. int32 throughout
    (a chunk's positions and bits stay far below 2^31; int64 would double the memory traffic),
    and per-position values gathered with `index_select` (several times faster on a CPU than
    indexing with a tensor)."""

    def __init__(self, counts: torch.Tensor, lengths: torch.Tensor):
        counts, lengths = counts.to(torch.int32), lengths.to(torch.int32)
        self.total = int(counts.sum())
        self.low = low_bits(counts, lengths)
        low_sizes = counts * self.low
        self.high_sizes = _high_lengths(counts, lengths, self.low)
        self.low_total = int(low_sizes.sum())
        self.high_ends = torch.cumsum(self.high_sizes, 0, dtype=torch.int32)  # relative to the high region
        self.bits = self.low_total + int(self.high_sizes.sum())
        self.bytes = (self.bits + 7) // 8
        blocks = torch.arange(counts.numel(), device=counts.device)
        owner = torch.repeat_interleave(blocks, counts, output_size=self.total)
        # per position: its block's low width, where its low part starts (they are packed in
        # order), and the bit its high part counts from: its block's bitvector's start plus its
        # rank in the block, that is (start - block's first position's index) + its own index
        self.low_each = self.low.index_select(0, owner)
        self.low_offset = torch.cumsum(self.low_each, 0, dtype=torch.int32) - self.low_each
        first = torch.cumsum(counts, 0, dtype=torch.int32) - counts
        from_start = self.low_total + self.high_ends - self.high_sizes - first
        self.high_base = from_start.index_select(0, owner) + torch.arange(
            self.total, dtype=torch.int32, device=counts.device
        )


# A low part has at most 12 bits and starts at any bit of a byte: it touches at most 3 bytes.
_SPAN = 3


def pack_positions(indices: torch.Tensor, counts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Elias-Fano code (uint8) of `indices`: `counts[b]` ascending positions in block b, block after block.

    Bits of different fields never overlap, so each field's bytes are added into place
    (`index_add_`): no bit-by-bit array, a few passes over the positions."""
    layout = _Layout(counts, lengths)
    idx = indices.to(torch.int32)
    out = torch.zeros(layout.bytes + _SPAN, dtype=torch.int32, device=idx.device)
    shifted = (idx & ((1 << layout.low_each) - 1)) << (layout.low_offset & 7)
    first_byte = layout.low_offset >> 3
    for k in range(_SPAN):
        out.index_add_(0, first_byte + k, (shifted >> (8 * k)) & 0xFF)
    high_bit = layout.high_base + (idx >> layout.low_each)
    out.index_add_(0, high_bit >> 3, 1 << (high_bit & 7))
    return out[: layout.bytes].to(torch.uint8)


def unpack_positions(packed: torch.Tensor, counts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The positions (int64) `pack_positions` wrote for these counts; ValueError on malformed bytes."""
    layout = _Layout(counts, lengths)
    if packed.numel() != layout.bytes:
        raise ValueError(f"{packed.numel()} bytes of positions where {layout.bytes} were due")
    if layout.bits % 8 and int(packed[-1]) >> (layout.bits % 8):
        raise ValueError("the positions' padding bits are not zero")
    if layout.total == 0:
        return torch.zeros(0, dtype=torch.int64, device=packed.device)
    wide = torch.cat([packed.to(torch.int32), packed.new_zeros(_SPAN - 1, dtype=torch.int32)])
    words = wide[:-2] | (wide[1:-1] << 8) | (wide[2:] << 16)  # the 24 bits from each byte on
    word = words.index_select(0, layout.low_offset >> 3)
    low = (word >> (layout.low_offset & 7)) & ((1 << layout.low_each) - 1)
    # the high region's bits, and which are set; each block's bitvector must hold exactly its
    # count (a prefix sum of the bits, read at the blocks' ends), so the i-th set bit is the
    # i-th position's, in its own block
    start = layout.low_total
    region = packed[start >> 3 :]
    bits = ((region.unsqueeze(1) >> _BIT.to(packed.device)) & 1).reshape(-1)[start & 7 : layout.bits - (start & ~7)]
    seen = torch.cumsum(torch.cat([bits.new_zeros(1), bits]), 0, dtype=torch.int32)  # set bits before each bit
    per_block = torch.diff(seen.index_select(0, layout.high_ends), prepend=seen.new_zeros(1))
    if not torch.equal(per_block, counts.to(torch.int32)):
        raise ValueError("a block's bitvector does not hold its count of positions")
    set_bits = bits.nonzero().squeeze(1).to(torch.int32)
    high = set_bits + start - layout.high_base
    return ((high << layout.low_each) | low).to(torch.int64)
