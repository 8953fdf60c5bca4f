"""What every group of node options shares: strict fields, and how `dtnode join --help` shows it.

NodeSettings nests one model per concern (the swarm, the network, the recipe's DiLoCo rounds,
averaging, ...), as prime's and torchtitan's configs do, so that code reads
`settings.diloco.inner_steps` and a reader sees which concern an option belongs to. Users keep
one flat name per option (--inner-steps, DTNODE_INNER_STEPS, `inner_steps` in a TOML file):
field names are unique across the groups, and config/sources.py places each where it lives.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict


class OptionGroup(BaseModel):
    """One concern's options. A typo in a field name is an error (extra="forbid"), and defaults
    are validated like given values, so a bad default fails the tests rather than a user."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    TITLE: ClassVar[str]  # the help section's title
    HELP: ClassVar[str]  # the help section's one-line description
    # Tuning and test knobs: parsed always, listed by `--help-all` only, so a newcomer reading
    # `--help` sees what a node needs and not what a benchmark turns
    ADVANCED: ClassVar[frozenset[str]] = frozenset()
