"""How many generated inputs a parser of untrusted bytes takes from Hypothesis in one run.

Each test names its depth (`inputs(2000)`: the inputs of a deep run); the default suite takes
half of that, since it must finish in 10 minutes on 2 cores and these parsers took over a
minute of it at full depth, while each run draws new inputs (CI runs on a clean clone, without
Hypothesis's database), so the depth adds up over runs. `DTNODE_FUZZ_SCALE=1` gives the full
depth, `DTNODE_FUZZ_SCALE=10` a soak (docs/testing.md).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

DEFAULT_SCALE = 0.5


def fuzz_scale() -> float:
    """The factor on every test's named depth, from DTNODE_FUZZ_SCALE (a positive number)."""
    raw = os.environ.get("DTNODE_FUZZ_SCALE", str(DEFAULT_SCALE))
    try:
        scale = float(raw)
    except ValueError:
        scale = 0.0
    if not scale > 0 or scale == float("inf"):
        raise ValueError(f"DTNODE_FUZZ_SCALE must be a positive number, not {raw!r}")
    return scale


def inputs(depth: int) -> settings:
    """Hypothesis settings for `depth` inputs at full scale (at least one), with no deadline: a
    loaded 2-core box runs some inputs slowly, which is not what these tests are about."""
    return settings(
        max_examples=max(1, round(depth * fuzz_scale())),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
