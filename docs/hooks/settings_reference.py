"""MkDocs hook: the configuration reference, generated from the settings model at build time.

The table replaces a marker in `reference/configuration.md`, so the page lists exactly the options
`dtnode join --help` does, with the same help texts and defaults, and cannot drift from them.
"""

from __future__ import annotations

from typing import Any

from dtnode.daemon.cli.main import ENV_ONLY
from dtnode.daemon.config.settings import ENV_PREFIX, NodeSettings, flag

MARKER = "<!-- settings-reference -->"


def on_page_markdown(markdown: str, **_: Any) -> str:
    return markdown.replace(MARKER, settings_table()) if MARKER in markdown else markdown


def settings_table() -> str:
    """One row per option: its flag, its environment variable, its default and its help text."""
    rows = ["| option | environment variable | default | meaning |", "| --- | --- | --- | --- |"]
    for name, field in NodeSettings.model_fields.items():
        default = field.get_default(call_default_factory=True)
        shown = "none" if default in (None, []) else f"`{default}`"
        if name in ENV_ONLY:
            option = "(environment only)"
        else:
            option = "`--peer`" if name == "peers" else f"`{flag(name)}`"
        meaning = " ".join((field.description or "").split()).replace("|", "\\|")
        rows.append(f"| {option} | `{ENV_PREFIX}{name.upper()}` | {shown} | {meaning} |")
    return "\n".join(rows)
