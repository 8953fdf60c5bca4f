"""The node's settings: one pydantic model, nested by concern, for every option.

Precedence, lowest to highest: defaults < TOML file (`--config` / DTNODE_CONFIG) <
environment variables `DTNODE_<NAME>` < CLI flags. The CLI is generated from this model, so
every option has exactly one name, one type and one help text. The groups live in
membership_options.py, training_options.py and averaging_options.py; config/sources.py reads
the flat names users write into them.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from dtnode.daemon.config.averaging_options import AveragingOptions, CheckpointOptions, OperationsOptions, WireOptions
from dtnode.daemon.config.membership_options import NetworkOptions, SecurityOptions, SwarmOptions
from dtnode.daemon.config.option_group import OptionGroup
from dtnode.daemon.config.sources import (
    ENV_PREFIX,
    TOP_LEVEL,
    ConfigFile,
    FlatEnvironment,
    GroupedInit,
    SettingsError,
)
from dtnode.daemon.config.training_options import (
    DilocoOptions,
    EvaluationOptions,
    HardwareOptions,
    InnerOptimizerOptions,
    WorkloadOptions,
)

__all__ = ["ENV_PREFIX", "NodeSettings", "SettingsError", "flag", "load_settings", "unknown_environment"]

# --compression sparse changes these defaults (an explicit value, from any source, wins):
# SparseLoCo's outer step (error feedback replaces momentum), and no periodic fp32 re-sync
SPARSE_DEFAULTS: dict[str, float | int] = {"outer_lr": 1.0, "outer_momentum": 0.0, "consensus_every": 0}
# DTNODE_* variables that are not options: test hooks (DTNODE_TEST_*), a rank's spec from its
# host, and what CI hands the browser test. Any other DTNODE_* name is a misspelt option.
NOT_OPTIONS = ("DTNODE_TEST_", "DTNODE_LOCAL_RANK_SPEC", "DTNODE_REQUIRE_BROWSER", "DTNODE_SCREENSHOT_DIR")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class NodeSettings(BaseSettings):
    """Every option of a node, one group per concern (`settings.diloco.inner_steps`). The order of
    the groups is the order of `dtnode join --help`: what a newcomer sets first comes first."""

    model_config = SettingsConfigDict(extra="forbid", validate_default=True)

    config: Path | None = Field(
        None, description="TOML file with option values (keys as in this list, with underscores)."
    )
    swarm: SwarmOptions = Field(default_factory=SwarmOptions, description=SwarmOptions.__doc__)
    workload: WorkloadOptions = Field(default_factory=WorkloadOptions, description=WorkloadOptions.__doc__)
    hardware: HardwareOptions = Field(default_factory=HardwareOptions, description=HardwareOptions.__doc__)
    network: NetworkOptions = Field(default_factory=NetworkOptions, description=NetworkOptions.__doc__)
    security: SecurityOptions = Field(default_factory=SecurityOptions, description=SecurityOptions.__doc__)
    diloco: DilocoOptions = Field(default_factory=DilocoOptions, description=DilocoOptions.__doc__)
    inner: InnerOptimizerOptions = Field(
        default_factory=InnerOptimizerOptions, description=InnerOptimizerOptions.__doc__
    )
    averaging: AveragingOptions = Field(default_factory=AveragingOptions, description=AveragingOptions.__doc__)
    wire: WireOptions = Field(default_factory=WireOptions, description=WireOptions.__doc__)
    evaluation: EvaluationOptions = Field(default_factory=EvaluationOptions, description=EvaluationOptions.__doc__)
    checkpoints: CheckpointOptions = Field(default_factory=CheckpointOptions, description=CheckpointOptions.__doc__)
    operations: OperationsOptions = Field(default_factory=OperationsOptions, description=OperationsOptions.__doc__)

    # flat option name -> the group holding it; filled in below the class
    GROUP_OF: ClassVar[dict[str, str]] = {}

    @model_validator(mode="after")
    def _consistent(self) -> NodeSettings:
        """The checks that span groups (each group checks its own)."""
        if self.wire.compression == "sparse":
            for name, value in SPARSE_DEFAULTS.items():  # what a user did not set follows the sparse recipe
                group = getattr(self, self.GROUP_OF[name])
                if name not in group.model_fields_set:
                    setattr(group, name, value)
            if self.averaging.aggregation != "mean":
                raise ValueError(
                    f"aggregation: {self.averaging.aggregation} does not combine with --compression sparse (a value "
                    "only a few members kept would be trimmed away, and their error feedback would count it as sent)"
                )
        if self.evaluation.eval_data is not None and self.workload.data is None:
            raise ValueError("eval_data: needs --data (the synthetic language has its own eval set)")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        given = init_settings()
        path = given.get("config") or os.environ.get(ENV_PREFIX + "CONFIG")
        return (
            GroupedInit(settings_cls, cls.GROUP_OF, given),
            FlatEnvironment(settings_cls, cls.GROUP_OF),
            *((ConfigFile(settings_cls, cls.GROUP_OF, Path(path)),) if path else ()),
        )

    # The options by their flat names: for the CLI, the recipe and the status page, which
    # speak the names users write

    @classmethod
    def option(cls, name: str) -> FieldInfo:
        """The field of the option `name` (its type, default and help)."""
        if name in TOP_LEVEL:
            return cls.model_fields[name]
        return group_class(cls.GROUP_OF[name]).model_fields[name]

    @classmethod
    def default(cls, name: str) -> Any:
        return cls.option(name).get_default(call_default_factory=True)

    def value(self, name: str) -> Any:
        """The value of the option `name`."""
        return getattr(self, name) if name in TOP_LEVEL else getattr(getattr(self, self.GROUP_OF[name]), name)

    def given(self) -> set[str]:
        """The options set explicitly (by flag, environment or config file), not left at their default."""
        names = {name for name in TOP_LEVEL if name in self.model_fields_set}
        for group in set(self.GROUP_OF.values()) & self.model_fields_set:
            names |= getattr(self, group).model_fields_set
        return names

    def flat(self) -> dict[str, Any]:
        """Every option by its flat name."""
        return {name: self.value(name) for name in [*TOP_LEVEL, *self.GROUP_OF]}

    def replaced(self, **values: Any) -> NodeSettings:
        """A copy with these options (by flat name) changed, unvalidated like `model_copy`: for
        values that come from this node's own code, not from a user."""
        update: dict[str, Any] = {name: values.pop(name) for name in TOP_LEVEL if name in values}
        by_group: dict[str, dict[str, Any]] = {}
        for name, value in values.items():
            by_group.setdefault(self.GROUP_OF[name], {})[name] = value
        for group, changes in by_group.items():
            update[group] = getattr(self, group).model_copy(update=changes)
        return self.model_copy(update=update)


def group_class(group: str) -> type[OptionGroup]:
    annotation = NodeSettings.model_fields[group].annotation
    assert isinstance(annotation, type) and issubclass(annotation, OptionGroup)
    return annotation


def option_groups() -> list[tuple[str, type[OptionGroup]]]:
    """(attribute, class) of every group, in the help's order."""
    return [(name, group_class(name)) for name in NodeSettings.model_fields if name not in TOP_LEVEL]


NodeSettings.GROUP_OF.update({field: group for group, cls in option_groups() for field in cls.model_fields})


def unknown_environment(environ: Mapping[str, str] | None = None) -> list[str]:
    """DTNODE_* variables that name no option (DTNODE_PEER for DTNODE_PEERS): each is an error,
    where it would otherwise be ignored and the node would start without what it says."""
    environ = os.environ if environ is None else environ
    options = {ENV_PREFIX + name.upper() for name in [*NodeSettings.GROUP_OF, *TOP_LEVEL]}
    return sorted(
        name
        for name in environ
        if name.startswith(ENV_PREFIX) and name not in options and not name.startswith(NOT_OPTIONS)
    )


def _closest_option(variable: str) -> str:
    names = [ENV_PREFIX + name.upper() for name in [*NodeSettings.GROUP_OF, *TOP_LEVEL]]
    close = difflib.get_close_matches(variable, names, n=1, cutoff=0.75)
    return f"; did you mean {close[0]}?" if close else ""


def _blamed_option(error: Any) -> tuple[str, str]:
    """(option name, message) of pydantic's first error: the innermost option named in its
    location, else the one a group's or the settings' own check names first in its message."""
    message = str(error["msg"]).removeprefix("Value error, ")
    names = [str(part) for part in error["loc"] if str(part) in NodeSettings.GROUP_OF or str(part) in TOP_LEVEL]
    if names:
        return names[-1], message
    name, _, message = message.partition(": ")
    return name, message


def load_settings(cli_values: dict[str, Any]) -> NodeSettings:
    """Build the settings; raise SettingsError naming the first bad option."""
    for variable in unknown_environment():
        raise SettingsError(variable, f"no option has this name{_closest_option(variable)}")
    try:
        return NodeSettings(**cli_values)
    except ValidationError as e:
        name, message = _blamed_option(e.errors()[0])
        option = "--peer" if name == "peers" else flag(name)
        if name not in cli_values and ENV_PREFIX + name.upper() in os.environ:
            option = f"{option} (from {ENV_PREFIX}{name.upper()})"
        raise SettingsError(option, message) from None
