"""The node's record of its rounds, bounded and kept in the state dir.

A dashboard opened late, or after a restart, must still show the whole run: the sidecar
serves this record (`GET /history?since=STEP`) instead of the page collecting points while
it is open. One JSON object per line, appended as each round ends (a crash loses at most
the line being written, and a torn last line is skipped on load); the file is rewritten
to the newest `limit` entries when it grows past twice that.
"""

from __future__ import annotations

import json
import logging
import math
from collections import deque
from pathlib import Path
from typing import Any

from dtnode.peers.durable import replace_durably

log = logging.getLogger(__name__)

FILE_NAME = "history.jsonl"
DEFAULT_LIMIT = 20_000  # rounds kept (a few MB): months of hourly rounds, days of minute-long ones
MAX_LINE = 64 * 1024  # an entry is a few hundred bytes; anything far larger is not ours


def finite_or_none(value: float | None) -> float | None:
    """JSON has no NaN: a loss not known yet is null (/status, /history, history.jsonl)."""
    return None if value is None or not math.isfinite(value) else value


class RoundHistory:
    def __init__(self, path: Path, limit: int = DEFAULT_LIMIT):
        self.path = path
        self.limit = limit
        self.entries: deque[dict[str, Any]] = deque(maxlen=limit)
        self._lines_in_file = 0

    def load(self) -> None:
        """Read what earlier runs of this state dir recorded (blocking: a worker thread)."""
        try:
            with self.path.open("rb") as f:
                for raw in f:
                    self._lines_in_file += 1
                    if len(raw) > MAX_LINE:
                        continue
                    try:
                        entry = json.loads(raw)
                    except ValueError:  # a torn last line from a crash
                        continue
                    if isinstance(entry, dict) and isinstance(entry.get("step"), int):
                        self.entries.append(entry)
        except FileNotFoundError:
            return
        except OSError as e:
            log.warning("could not read the round history %s: %s; starting a new one", self.path, e)

    @property
    def tokens_total(self) -> int:
        """Tokens this node trained on over the whole record (carried across restarts)."""
        return int(self.entries[-1].get("tokens_total", 0)) if self.entries else 0

    def append(self, entry: dict[str, Any]) -> dict[str, Any]:
        """Record one round in memory (cheap: the event loop); `persist` writes it."""
        entry = {k: finite_or_none(v) if isinstance(v, float) else v for k, v in entry.items()}
        self.entries.append(entry)
        return entry

    def persist(self, entry: dict[str, Any]) -> None:
        """Append one recorded round to the file (blocking: a worker thread). A full disk costs
        the file, never the node."""
        try:
            if self._lines_in_file >= 2 * self.limit:
                self._rewrite()
            else:
                with self.path.open("a", encoding="utf-8") as f:
                    f.write(json.dumps(entry, separators=(",", ":")) + "\n")
                self._lines_in_file += 1
        except OSError as e:
            log.warning("could not save the round history: %s", e)

    def _rewrite(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            for entry in list(self.entries):
                f.write(json.dumps(entry, separators=(",", ":")) + "\n")
        replace_durably(tmp, self.path)
        self._lines_in_file = len(self.entries)

    def since(self, step: int, limit: int) -> list[dict[str, Any]]:
        """Entries whose outer step is after `step`, oldest first, at most `limit` of them (the oldest)."""
        out = []
        for entry in self.entries:
            if entry["step"] > step:
                out.append(entry)
                if len(out) == limit:
                    break
        return out
