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
    full = body.shape[0]
    parts = []
    kernels = _fused  # read once: another thread may switch kernels
    if full and kernels is not None and x.device.type == "cpu" and codes.is_contiguous():
        if not bool(kernels.quantize(body, code_body, scales[:full])):
            raise NonFiniteError("cannot quantize non-finite values")
    elif full:
        parts.append((body, code_body, scales[:full]))
    if tail is not None and code_tail is not None:
        parts.append((tail, code_tail, scales[full:]))
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
    _decode_into(q, out)
    return out


def _decode_into(q: QuantizedBlocks, out: torch.Tensor) -> None:
    if out.numel() != q.numel or out.dtype != torch.float32:
        raise ValueError("output must be fp32 with one value per code")
    if q.numel == 0:
        return
    code_body, code_tail = _blocked(q.codes, q.block_size)
    out_body, out_tail = _blocked(out, q.block_size)
    full = code_body.shape[0]
    parts = []
    kernels = _fused
    if full and kernels is not None and out.device.type == "cpu" and out.is_contiguous():
        kernels.dequantize(code_body, q.scales[:full], out_body)
    elif full:
        parts.append((code_body, out_body, q.scales[:full]))
    if code_tail is not None and out_tail is not None:
        parts.append((code_tail, out_tail, q.scales[full:]))
    for codes, target, scales in parts:
        torch.mul(codes, scales.unsqueeze(1), out=target)


class _FusedKernels:
    """The same math as the eager path, compiled by TorchInductor into one pass per call.

    Eager torch makes five or six passes over the data for a quantize (abs, max, scale,
    round, clamp, cast), each a full-size temporary; a fused loop reads the fp32 values
    once and writes the int8 codes once, which is what brings int8 coding near memcpy speed
    on CPU (the hand-written C++ kernels INTELLECT-1 needed, without writing any).
    The compiled kernels give bit-identical results to the eager ones (tested).
    """

    def __init__(self) -> None:
        self.quantize = torch.compile(_quantize_blocks, dynamic=True)
        self.dequantize = torch.compile(_dequantize_blocks, dynamic=True)


def _quantize_blocks(values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    absmax = values.abs().amax(dim=1)
    scales.copy_(absmax / INT8_MAX)
    inverse = torch.where(absmax > 0, INT8_MAX / absmax.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    codes.copy_((values * inverse.unsqueeze(1)).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8))
    return torch.isfinite(absmax).all()


def _dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(codes.float() * scales.unsqueeze(1))


_fused: _FusedKernels | None = None


def use_fused_kernels(enable: bool = True) -> bool:
    """Switch CPU coding to compiled kernels (compiles on first use: seconds). Returns
    whether they are active; any failure to compile leaves the eager path in place."""
    global _fused
    if not enable:
        _fused = None
        return False
    try:
        kernels = _FusedKernels()
        probe = torch.linspace(-3, 3, 4 * DEFAULT_BLOCK_SIZE)
        blocks = probe.view(-1, DEFAULT_BLOCK_SIZE)
        codes = torch.empty_like(blocks, dtype=torch.int8)
        scales = torch.empty(blocks.shape[0])
        kernels.quantize(blocks, codes, scales)
        decoded = torch.empty_like(blocks)
        kernels.dequantize(codes, scales, decoded)
        _fused = None
        reference = quantize(probe, DEFAULT_BLOCK_SIZE)
        if not (torch.equal(reference.codes, codes.view(-1)) and torch.equal(reference.scales, scales)):
            return False
    except Exception:  # noqa: BLE001  (no compiler, unsupported platform: the eager path is always correct)
        return False
    _fused = kernels
    return True


def fused_kernels_active() -> bool:
    return _fused is not None


def relative_l2_error(reference: torch.Tensor, approx: torch.Tensor) -> float:
    denom = float(reference.float().norm())
    diff = float((reference.float() - approx.float()).norm())
    return diff / denom if denom > 0 else diff


def quantize_with_feedback(
    x: torch.Tensor, residual: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE
) -> QuantizedBlocks:
    """Error feedback: quantize x + residual and leave in `residual` what the codes lost.

    Carried into the next round, the residual makes the error of a sum of rounds that of a
    single quantization instead of growing with the number of rounds (Seide et al., 2014;
    Karimireddy et al., 2019). `residual` is updated in place; `x` is not touched.
    """
    if residual.shape != x.shape or residual.dtype != torch.float32:
        raise ValueError("residual must be fp32 and shaped like x")
    corrected = x.float() + residual
    q = quantize(corrected, block_size)
    dequantize(q, out=residual)
    torch.sub(corrected, residual, out=residual)
    return q
