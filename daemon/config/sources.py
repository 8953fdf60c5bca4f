"""Where option values come from, each source shaped like NodeSettings' groups.

Users write an option by its flat name in every source: a flag (--inner-steps), a variable
(DTNODE_INNER_STEPS), a key of the TOML file (`inner_steps`, or `inner_steps` under a
`[diloco]` table). Each source here returns the values nested by group
(`{"diloco": {"inner_steps": 30}}`), so pydantic-settings merges them field by field:
a flag for one DiLoCo option does not hide a TOML value for another.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

ENV_PREFIX = "DTNODE_"
# The options outside every group (the settings' own file)
TOP_LEVEL = frozenset({"config"})


class SettingsError(ValueError):
    """A bad option value; `option` names it the way the user wrote it (flag form)."""

    def __init__(self, option: str, message: str):
        super().__init__(f"{option}: {message}")
        self.option = option


def grouped(values: Mapping[str, Any], group_of: Mapping[str, str]) -> dict[str, Any]:
    """Flat option names placed in their groups; a group given whole (a table of the TOML file,
    a model passed to the constructor) and anything unknown pass as they are, the unknown for
    pydantic to refuse by name."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        group = group_of.get(name)
        if group is None:
            if isinstance(value, Mapping):  # a copy: the flat fields merged in must not reach the caller's
                out[name] = {**value, **out[name]} if isinstance(out.get(name), dict) else dict(value)
            else:
                out[name] = value
        elif isinstance(out.get(group), dict):
            out[group][name] = value
        elif group in out:  # a whole group model given beside one of its fields: the field wins
            out[group] = out[group].model_copy(update={name: value})
        else:
            out[group] = {name: value}
    return out


class _GroupedSource(PydanticBaseSettingsSource):
    """A source that produces its whole dict at once (pydantic-settings' per-field lookup unused)."""

    def __init__(self, settings_cls: type[BaseSettings], group_of: Mapping[str, str]):
        super().__init__(settings_cls)
        self.group_of = group_of

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False


class GroupedInit(_GroupedSource):
    """The constructor's keyword arguments (the CLI's flags, a test's values), by flat name."""

    def __init__(self, settings_cls: type[BaseSettings], group_of: Mapping[str, str], values: Mapping[str, Any]):
        super().__init__(settings_cls, group_of)
        self.values = values

    def __call__(self) -> dict[str, Any]:
        return grouped(self.values, self.group_of)


class FlatEnvironment(_GroupedSource):
    """DTNODE_<NAME> for every option NAME: the strings go to pydantic as they are (its lax mode
    reads "30" as 30 and "true" as True; the peers validator splits commas)."""

    def __call__(self) -> dict[str, Any]:
        names = [*self.group_of, *TOP_LEVEL]
        found = {
            name: os.environ[ENV_PREFIX + name.upper()] for name in names if ENV_PREFIX + name.upper() in os.environ
        }
        return grouped(found, self.group_of)


class ConfigFile(_GroupedSource):
    """The TOML file `--config` (or DTNODE_CONFIG) names, with errors that name `--config`: a file
    that cannot be read, is not TOML, or has keys that are no option. Keys may be written with
    dashes, like the flags, at the top level or in a table named for their group."""

    def __init__(self, settings_cls: type[BaseSettings], group_of: Mapping[str, str], path: Path):
        super().__init__(settings_cls, group_of)
        if not path.is_file() or not os.access(path, os.R_OK):
            reason = "no such file" if not path.exists() else "not a readable file"
            raise SettingsError("--config", f"cannot read {path}: {reason}")
        self.path = path

    def __call__(self) -> dict[str, Any]:
        try:
            with self.path.open("rb") as file:
                raw = tomllib.load(file)
        except OSError as e:
            raise SettingsError("--config", f"cannot read {self.path}: {e.strerror or e}") from None
        except tomllib.TOMLDecodeError as e:
            raise SettingsError("--config", f"{self.path} is not valid TOML: {e}") from None
        values: dict[str, Any] = {}
        unknown: list[str] = []
        groups = set(self.group_of.values())
        for key, value in raw.items():
            name = key.replace("-", "_")
            if name in groups and isinstance(value, dict):
                table = {k.replace("-", "_"): v for k, v in value.items()}
                unknown += [f"{name}.{k}" for k in table if self.group_of.get(k) != name]
                values |= table
            elif name in self.group_of:
                values[name] = value
            elif name not in TOP_LEVEL:
                unknown.append(name)
        if unknown:
            raise SettingsError("--config", f"{self.path} has unknown option(s): {', '.join(sorted(unknown))}")
        return grouped(values, self.group_of)
