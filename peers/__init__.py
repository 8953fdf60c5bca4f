"""The network layer: DHT membership and matchmaking, the gRPC data plane.

hivemind's package `__init__` imports its whole trainer stack (averaging, MoE, optimizers,
scipy) although dtnode uses only its DHT: over a second of CPU at every start, which a
joiner pays while its donors keep the cores busy. Registering the package without running
that `__init__` lets `hivemind.dht`, `hivemind.p2p` and `hivemind.utils` load alone. It is
done here, before any module of this layer imports hivemind, and only if nothing imported
hivemind first (then the whole package is already there and is used as it is). A name of
the package's own (`hivemind.DHT`, `hivemind.__version__`) still works: its first use runs
the real `__init__`.
"""

import importlib.util
import sys
import types


def _register_hivemind_without_its_trainer_stack() -> None:
    if "hivemind" in sys.modules:
        return
    spec = importlib.util.find_spec("hivemind")
    if spec is None or not spec.submodule_search_locations or spec.loader is None:
        return  # not installed: the import that needs it reports that
    loader = spec.loader
    package = types.ModuleType("hivemind")
    package.__spec__ = spec
    package.__path__ = list(spec.submodule_search_locations)
    package.__file__ = spec.origin
    package.__package__ = "hivemind"

    def load_the_rest(name: str) -> object:
        submodule = sys.modules.get(f"hivemind.{name}")
        if submodule is not None:  # `import hivemind.x.y as z` while hivemind.x is still loading
            return submodule
        if name.startswith("__") and name != "__version__":
            raise AttributeError(name)
        delattr(package, "__getattr__")  # the real __init__ defines what it defines; no second pass
        loader.exec_module(package)
        return getattr(package, name)

    setattr(package, "__getattr__", load_the_rest)  # noqa: B010  (a module attribute mypy would refuse)
    sys.modules["hivemind"] = package


_register_hivemind_without_its_trainer_stack()
