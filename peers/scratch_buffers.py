"""Where each group of a moshpit hop writes its results, without a second model-sized copy
where none is needed."""

from __future__ import annotations

from collections import Counter

import torch

from dtnode.ops.coded import CodedDelta


class ScratchBuffers:
    """Where each group of a hop writes its results: into its own input, in place (a part's
    result replaces those values only once whole and checked, see `PartResult`), unless another
    group of the hop reads the same input (a member of a small group carrying one mean into
    several groups); then into model-sized scratch buffers, kept across rounds, that no input is."""

    def __init__(self) -> None:
        self._scratch: list[torch.Tensor | CodedDelta] = []

    def outputs(self, inputs: list[torch.Tensor | CodedDelta]) -> list[torch.Tensor | CodedDelta]:
        """One output buffer per input."""
        busy = {id(t) for t in inputs}
        readers = Counter(id(t) for t in inputs)
        outputs, index = [], 0
        for values in inputs:
            if readers[id(values)] == 1:
                outputs.append(values)
                continue
            while id(buffer := self._buffer(index, values)) in busy:
                index += 1
            outputs.append(buffer)
            index += 1
        return outputs

    def _buffer(self, index: int, like: torch.Tensor | CodedDelta) -> torch.Tensor | CodedDelta:
        while len(self._scratch) <= index:
            self._scratch.append(_empty_like(like))
        kept = self._scratch[index]
        if kept.numel() != like.numel() or type(kept) is not type(like) or _block_of(kept) != _block_of(like):
            self._scratch[index] = _empty_like(like)
        return self._scratch[index]


def _empty_like(like: torch.Tensor | CodedDelta) -> torch.Tensor | CodedDelta:
    return like.empty_like() if isinstance(like, CodedDelta) else torch.empty_like(like)


def _block_of(buffer: torch.Tensor | CodedDelta) -> int:
    return buffer.block_size if isinstance(buffer, CodedDelta) else 0
