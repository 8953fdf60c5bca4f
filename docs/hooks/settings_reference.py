"""MkDocs hook: the configuration reference, generated from the settings model at build time.

The table replaces a marker in `reference/configuration.md`, so the page lists exactly the options
`dtnode join --help` does, with the same help texts and defaults, and cannot drift from them.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from dtnode.daemon.cli.main import ENV_ONLY
from dtnode.daemon.config.settings import ENV_PREFIX, NodeSettings, flag, option_groups
from dtnode.daemon.config.sources import TOP_LEVEL

MARKER = "<!-- settings-reference -->"


def on_page_markdown(markdown: str, **_: Any) -> str:
    return markdown.replace(MARKER, settings_table()) if MARKER in markdown else markdown


def settings_table() -> str:
    """One table per group of options, in the help's order; one row per option: its flag, its
    environment variable, its default and its help text. `dtnode join --help` lists the same
    groups; a TOML file may hold each option at its top level or in a table named for its group."""
    sections = []
    for attribute, group in option_groups():
        names = [*group.model_fields, *(sorted(TOP_LEVEL) if attribute == "operations" else [])]
        rows = [
            f"### {group.TITLE} (`[{attribute}]`)",
            "",
            group.HELP,
            "",
            "| option | environment variable | default | meaning |",
            "| --- | --- | --- | --- |",
        ]
        rows += [_row(name) for name in names]
        sections.append("\n".join(rows))
    return "\n\n".join(sections)


def _row(name: str) -> str:
    field = NodeSettings.option(name)
    default = field.get_default(call_default_factory=True)
    value = default.value if isinstance(default, Enum) else default
    shown = "none" if default in (None, []) else f"`{value}`"
    if name in ENV_ONLY:
        option = "(environment only)"
    else:
        option = "`--peer`" if name == "peers" else f"`{flag(name)}`"
    meaning = " ".join((field.description or "").split()).replace("|", "\\|")
    return f"| {option} | `{ENV_PREFIX}{name.upper()}` | {shown} | {meaning} |"
