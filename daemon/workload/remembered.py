"""The run's `--model` and `--tokenizer`, noted in the state dir for `dtnode export`.

The shared checkpoint files must not carry local paths, yet an export should find the model
and tokenizer without being told: the node notes them beside its checkpoints at start.
"""

from __future__ import annotations

import json
from pathlib import Path

WORKLOAD_FILE = "workload.json"  # in the state dir: the run's --model and --tokenizer, local paths included


def remember_workload(state_dir: Path, model: str, tokenizer: Path | None) -> None:
    """Note this node's --model and --tokenizer beside its checkpoints."""
    entry = {"model": model, "tokenizer": str(tokenizer.resolve()) if tokenizer is not None else None}
    (state_dir / WORKLOAD_FILE).write_text(json.dumps(entry) + "\n")


def remembered_workload(state_dir: Path) -> dict:
    """What `remember_workload` noted ({} when nothing readable was)."""
    try:
        entry = json.loads((state_dir / WORKLOAD_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return entry if isinstance(entry, dict) else {}
