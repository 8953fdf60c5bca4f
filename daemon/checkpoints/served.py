"""The checkpoints a node's membership record says it served lately (`PeerRecord.served`).

A joiner's vote binds a donor's offer to a (step, sha256) the donor signed in its record; a
donor that moved past the step by its next heartbeat still announces it here, since rounds can
be shorter than a heartbeat. A step is served from memory and then from its file with the same
bytes (one sha256): it counts once, or the pair would push an older step out of the few the
record holds, and every peer would read it twice in every read of the membership.
"""

from __future__ import annotations

from collections import OrderedDict

SERVED_IN_RECORD = 6  # checkpoints a membership record announces (peers/membership.py: `served`)


class RecentlyServed:
    """(step, sha256) pairs, each once, the `keep` most recently added kept."""

    def __init__(self, keep: int = SERVED_IN_RECORD):
        self.keep = keep
        self._pairs: OrderedDict[tuple[int, str], None] = OrderedDict()

    def add(self, step: int, sha256: str) -> None:
        """This node serves (or served) checkpoint `step` with this hash: newest again if known."""
        pair = (step, sha256)
        self._pairs[pair] = None
        self._pairs.move_to_end(pair)
        while len(self._pairs) > self.keep:
            self._pairs.popitem(last=False)

    def __contains__(self, pair: object) -> bool:
        return pair in self._pairs

    def pairs(self) -> list[tuple[int, str]]:
        """What the record announces, by step."""
        return sorted(self._pairs)
