"""Blockwise absmax int8 quantization with fp32 scales.

Each block of `block_size` consecutive values is scaled by its own absolute maximum, so one
outlier only coarsens its own block. The error of a block is at most scale/2 per value, with
scale = absmax/127; on Gaussian data the relative L2 error is well under 1% for blocks up to
a few thousand values. A block of zeros gets scale 0 and decodes to exact zeros.

Non-finite input raises: a NaN folded into a scale would silently poison a whole block of
every peer that averages it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT8_MAX = 127
DEFAULT_BLOCK_SIZE = 256


class NonFiniteError(ValueError):
    """The tensor holds NaN or Inf; such values must never be quantized or averaged."""


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


@dataclass(frozen=True)
class QuantizedBlocks:
    """int8 codes (one per value) and fp32 scales (one per block)."""

    codes: torch.Tensor  # int8, shape (numel,)
    scales: torch.Tensor  # float32, shape (num_blocks,)
    block_size: int

    @property
    def numel(self) -> int:
        return self.codes.numel()


def _blocked(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Split a flat tensor into a (full_blocks, block_size) view and a tail (or None)."""
    full = x.numel() // block_size * block_size
    body = x[:full].view(-1, block_size)
    tail = x[full:].view(1, -1) if full < x.numel() else None
    return body, tail


def quantize(
    x: torch.Tensor,
    block_size: int = DEFAULT_BLOCK_SIZE,
    out: QuantizedBlocks | None = None,
) -> QuantizedBlocks:
    """Quantize a flat float tensor; writes into `out` when given (no allocation of codes)."""
    if x.dim() != 1:
        raise ValueError("quantize expects a flat tensor")
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    x = x.float()
    n = x.numel()
    if out is None:
        codes = torch.empty(n, dtype=torch.int8, device=x.device)
        scales = torch.empty(num_blocks(n, block_size), dtype=torch.float32, device=x.device)
    else:
        if out.numel != n or out.block_size != block_size:
            raise ValueError("output buffer does not match the input")
        codes, scales = out.codes, out.scales
    if n == 0:
        return QuantizedBlocks(codes, scales, block_size)
    body, tail = _blocked(x, block_size)
    code_body, code_tail = _blocked(codes, block_size)
    parts = [(body, code_body, scales[: body.shape[0]])]
    if tail is not None:
        parts.append((tail, code_tail, scales[body.shape[0] :]))
    for values, block_codes, block_scales in parts:
        absmax = values.abs().amax(dim=1)
        if not bool(torch.isfinite(absmax).all()):
            raise NonFiniteError("cannot quantize non-finite values")
        torch.div(absmax, INT8_MAX, out=block_scales)
        # Zero blocks: inverse scale 0 maps every value to code 0 (exact zeros on decode).
        inverse = torch.where(absmax > 0, INT8_MAX / absmax.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
        scaled = values * inverse.unsqueeze(1)
        scaled.round_().clamp_(-INT8_MAX, INT8_MAX)
        block_codes.copy_(scaled)
    return QuantizedBlocks(codes, scales, block_size)


def dequantize(q: QuantizedBlocks, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode to fp32; writes into `out` when given."""
    if out is None:
        out = torch.empty(q.numel, dtype=torch.float32, device=q.codes.device)
    _decode_into(q, out, accumulate=False, weight=1.0)
    return out


def dequantize_accumulate(q: QuantizedBlocks, acc: torch.Tensor, weight: float = 1.0) -> None:
    """acc += weight * dequantize(q), without materialising the decoded tensor in full."""
    _decode_into(q, acc, accumulate=True, weight=weight)


def _decode_into(q: QuantizedBlocks, out: torch.Tensor, accumulate: bool, weight: float) -> None:
    if out.numel() != q.numel or out.dtype != torch.float32:
        raise ValueError("output must be fp32 with one value per code")
    if q.numel == 0:
        return
    code_body, code_tail = _blocked(q.codes, q.block_size)
    out_body, out_tail = _blocked(out, q.block_size)
    parts = [(code_body, out_body, q.scales[: code_body.shape[0]])]
    if code_tail is not None:
        parts.append((code_tail, out_tail, q.scales[code_body.shape[0] :]))
    for codes, target, scales in parts:
        factors = (scales * weight).unsqueeze(1) if weight != 1.0 else scales.unsqueeze(1)
        if accumulate:
            target.addcmul_(codes.float(), factors)
        else:
            torch.mul(codes, factors, out=target)


def relative_l2_error(reference: torch.Tensor, approx: torch.Tensor) -> float:
    denom = float(reference.float().norm())
    diff = float((reference.float() - approx.float()).norm())
    return diff / denom if denom > 0 else diff
