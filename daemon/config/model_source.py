"""What a `--model hf:SOURCE` names: a local directory, or a model on the Hugging Face Hub.

Settled from the string and the file system alone (no import of transformers, no network), so
the settings can check it at start and the bootstrap can tell which peers' files a joiner needs.
"""

from __future__ import annotations

import re
from pathlib import Path

# A Hub id: NAME or ORG/NAME, each of letters, digits, '-', '_' and '.', optionally @REVISION
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?(@[\w./-]{1,128})?$")


def is_hub_id(source: str) -> bool:
    """Whether `hf:SOURCE` names a Hub model: no such local path, and shaped like a Hub id."""
    return not Path(source).expanduser().exists() and bool(_HUB_ID.match(source)) and ".." not in source
