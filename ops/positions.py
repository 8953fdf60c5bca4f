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
    """floor(log2(length / count)) per block (0 where count is 0 or count >= length)."""
    low = torch.zeros_like(counts)
    for bits in range(1, MAX_LOW_BITS + 1):  # 12 element-wise steps, not a loop over blocks
        low += ((counts << bits) <= lengths) & (counts > 0)
    return low


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
    (a chunk's positions and bits stay far below 2^31; int64 would double the memory traffic)."""

    def __init__(self, counts: torch.Tensor, lengths: torch.Tensor):
        counts, lengths = counts.to(torch.int32), lengths.to(torch.int32)
        self.total = int(counts.sum())
        self.low = low_bits(counts, lengths)
        low_sizes = counts * self.low
        high_sizes = _high_lengths(counts, lengths, self.low)
        self.low_total = int(low_sizes.sum())
        self.high_ends = torch.cumsum(high_sizes, 0, dtype=torch.int32)  # relative to the high region
        self.bits = self.low_total + int(high_sizes.sum())
        self.bytes = (self.bits + 7) // 8
        # per position: its block's low width, where its low part starts, and the bit its high
        # part counts from (its block's bitvector's start plus its rank in the block)
        first = torch.cumsum(counts, 0, dtype=torch.int32) - counts
        self.high_starts = self.high_ends - high_sizes
        owner = torch.repeat_interleave(
            torch.arange(counts.numel(), device=counts.device), counts, output_size=self.total
        )
        self.owner = owner
        self.low_each = self.low[owner]
        self.low_offset = torch.cumsum(self.low_each, 0, dtype=torch.int32) - self.low_each  # packed in order
        rank = torch.arange(self.total, dtype=torch.int32, device=counts.device) - first[owner]
        self.high_base = (self.low_total + self.high_starts)[owner] + rank  # bit of high part 0 at this rank


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
    wide = torch.cat([packed.to(torch.int32), packed.new_zeros(_SPAN, dtype=torch.int32)])
    first_byte = layout.low_offset >> 3
    word = wide[first_byte] | (wide[first_byte + 1] << 8) | (wide[first_byte + 2] << 16)
    low = (word >> (layout.low_offset & 7)) & ((1 << layout.low_each) - 1)
    # the high region's bits (from the byte it starts in), and which of them are set
    region = packed[layout.low_total >> 3 :]
    bits = ((region.unsqueeze(1) >> _BIT.to(packed.device)) & 1).reshape(-1)
    set_bits = bits[layout.low_total & 7 : layout.bits - (layout.low_total & ~7)].nonzero().squeeze(1)
    if set_bits.numel() != layout.total:
        raise ValueError(f"{set_bits.numel()} positions coded where the counts say {layout.total}")
    # the i-th set bit is the i-th position's: it must lie in that position's block's bitvector
    # (else a block holds more or fewer set bits than its count, and a neighbour the difference).
    # A set bit before its rank's place (high < 0) means an earlier one sits in another block.
    # What lies inside the bitvector but past the block's end is the caller's range check.
    set_bits = set_bits.to(torch.int32)
    high = set_bits + layout.low_total - layout.high_base
    if bool(((high < 0) | (set_bits >= layout.high_ends[layout.owner])).any()):
        raise ValueError("a block's positions do not match its count")
    return ((high << layout.low_each) | low).to(torch.int64)
