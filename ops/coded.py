"""A model-sized Δ kept as int8 codes: 1 byte per value and one fp32 scale per block.

Why: with the int8 codec every value of Δ reaches the wire through `quantize` anyway, and the
group's mean comes back as int8 codes too. A node whose θ_g lives in host memory (a CPU node, a
sharded host's rank 0) can therefore hold Δ, and the mean written over it, coded from the moment
it is taken: 1 byte per parameter instead of 4. The codes a node sends are the very bytes it
holds (no second quantization), and a part's mean is stored as the bytes that came back.

Blocks are aligned to the buffer's start, as the group plan's parts and chunks are (whole
blocks, the last one possibly short), so a slice that starts on a block boundary is a view of
codes and scales, and its payload is that view.

`SpanEncoder` fills the buffer from spans of any length in order (a sharded host reads θ_l one
parameter at a time, and parameters do not end on block boundaries): it carries a partial
block over to the next span, and feeds the rounding error back into a residual when given.
"""

from __future__ import annotations

import torch

from .quantization import QuantizedBlocks, dequantize, num_blocks, quantize

DECODE_SLICE = 1 << 20  # values decoded at a time by a whole-buffer pass (norms, outer step)


class CodedDelta:
    """int8 codes and per-block fp32 scales for `numel` values, in host memory."""

    def __init__(self, numel: int, block_size: int, pin_memory: bool = False):
        if numel < 0 or block_size < 1:
            raise ValueError("numel must be >= 0 and block_size >= 1")
        self.block_size = block_size
        self.codes = torch.zeros(numel, dtype=torch.int8, pin_memory=pin_memory)
        self.scales = torch.zeros(num_blocks(numel, block_size), dtype=torch.float32, pin_memory=pin_memory)

    def numel(self) -> int:
        return self.codes.numel()

    def __getitem__(self, index: slice) -> CodedSlice:
        start, stop, step = index.indices(self.numel())
        if step != 1:
            raise ValueError("a coded Δ is sliced in steps of 1")
        return CodedSlice(self, start, max(stop - start, 0))

    def whole(self) -> CodedSlice:
        return CodedSlice(self, 0, self.numel())

    def empty_like(self) -> CodedDelta:
        return CodedDelta(self.numel(), self.block_size)

    def scaled(self, factor: float) -> CodedDelta:
        """A copy whose every value is `factor` times this one's (a test's hostile sender)."""
        out = self.empty_like()
        out.codes.copy_(self.codes)
        torch.mul(self.scales, factor, out=out.scales)
        return out

    def norm(self) -> torch.Tensor:
        """‖Δ‖ (a 0-d fp32 tensor), decoded a slice at a time: no model-sized temporary."""
        return self.whole().norm()

    def values(self, start: int, stop: int) -> torch.Tensor:
        """Values [start, stop), fp32, from anywhere (the blocks around them are decoded)."""
        block = self.block_size
        first = start // block * block
        last = min(-(-stop // block) * block, self.numel())
        return self[first:last].decoded()[start - first : stop - first]


class CodedSlice:
    """A block-aligned range of a `CodedDelta`: reads decode it, writes code into it."""

    def __init__(self, coded: CodedDelta, offset: int, length: int):
        block = coded.block_size
        end = offset + length
        if offset < 0 or end > coded.numel() or offset % block or (end % block and end != coded.numel()):
            raise ValueError(f"[{offset}, {end}) is not whole blocks of {block} within {coded.numel()} values")
        self.coded, self.offset, self.length = coded, offset, length

    def numel(self) -> int:
        return self.length

    def __getitem__(self, index: slice) -> CodedSlice:
        start, stop, step = index.indices(self.length)
        if step != 1:
            raise ValueError("a coded Δ is sliced in steps of 1")
        return CodedSlice(self.coded, self.offset + start, max(stop - start, 0))

    def payload(self) -> QuantizedBlocks:
        """The slice's codes and scales as the wire carries them (views, no copy)."""
        block = self.coded.block_size
        first = self.offset // block
        return QuantizedBlocks(
            self.coded.codes[self.offset : self.offset + self.length],
            self.coded.scales[first : first + num_blocks(self.length, block)],
            block,
        )

    def decoded(self) -> torch.Tensor:
        """The slice's values, fp32 (a new tensor of its length)."""
        return dequantize(self.payload())

    def norm(self) -> torch.Tensor:
        squares = torch.zeros((), dtype=torch.float64)
        for start in range(0, self.length, DECODE_SLICE):
            squares += torch.linalg.vector_norm(self[start : start + DECODE_SLICE].decoded()).double() ** 2
        return squares.sqrt().float()

    def store(self, payload: QuantizedBlocks) -> None:
        """The slice ← an int8 payload of its length and block size (a part's mean as it came)."""
        if payload.numel != self.length or payload.block_size != self.coded.block_size:
            raise ValueError("the payload does not match the coded slice")
        mine = self.payload()
        mine.codes.copy_(payload.codes)
        mine.scales.copy_(payload.scales)

    def store_values(self, values: torch.Tensor) -> None:
        """The slice ← fp32 values, quantized in place (NonFiniteError for NaN or Inf)."""
        if values.numel() != self.length:
            raise ValueError("the values do not match the coded slice")
        quantize(values.reshape(-1), self.coded.block_size, out=self.payload())

    def copy_(self, source: CodedSlice) -> None:
        """The slice ← another's codes (nothing to do for itself)."""
        if source.coded is not self.coded or source.offset != self.offset:
            self.store(source.payload())


class SpanEncoder:
    """Fills a `CodedDelta` from consecutive spans of fp32 values of any length.

    Whole blocks are coded as they complete; a partial block waits in a one-block carry for the
    next span. With `residual` (int8 error feedback), each block is coded as values + residual
    and the residual keeps what the code lost, as `quantize_with_feedback` does."""

    def __init__(self, target: CodedDelta, residual: torch.Tensor | None = None):
        if residual is not None and (residual.numel() != target.numel() or residual.dtype != torch.float32):
            raise ValueError("the residual must be fp32, one value per coded value")
        self.target, self.residual = target, residual
        self.written = 0  # values coded so far
        self.carry = torch.empty(target.block_size, dtype=torch.float32)
        self.carried = 0  # values waiting in `carry`

    def add(self, values: torch.Tensor) -> None:
        """The next `values.numel()` values, in order."""
        values = values.reshape(-1)
        block = self.target.block_size
        taken = 0
        if self.carried:
            taken = min(block - self.carried, values.numel())
            self.carry[self.carried : self.carried + taken].copy_(values[:taken])
            self.carried += taken
            if self.carried == block:
                self._code(self.carry)
                self.carried = 0
        whole = (values.numel() - taken) // block * block
        if whole:
            self._code(values[taken : taken + whole])
        rest = values.numel() - taken - whole
        if rest:
            self.carry[:rest].copy_(values[taken + whole :])
            self.carried = rest

    def finish(self) -> None:
        """Code the last, short block; every value must have come."""
        if self.carried:
            self._code(self.carry[: self.carried])
            self.carried = 0
        if self.written != self.target.numel():
            raise ValueError(f"{self.written} values coded of {self.target.numel()}")

    def _code(self, values: torch.Tensor) -> None:
        at, n = self.written, values.numel()
        out = self.target[at : at + n]
        if self.residual is None:
            out.store_values(values)
        else:
            residual = self.residual[at : at + n]
            corrected = values + residual
            out.store_values(corrected)
            dequantize(out.payload(), out=residual)
            torch.sub(corrected, residual, out=residual)
        self.written += n
