"""Everything dtnode takes from hivemind, in one module: its DHT, its record validators, its
peer ids (made faster: `_peer_ids_with_remembered_base58`) and keys, its clock, and two pieces
of its logging.

dtnode uses hivemind for the DHT only. Every other module imports these names from here (an
import-linter contract in pyproject.toml holds that), so an upgrade of hivemind is read in
one file, and `tests/test_hivemind_contract.py` says by name what a new version must keep.

hivemind's package `__init__` imports its whole trainer stack (averaging, MoE, optimizers,
scipy): over a second of CPU at every start, which a joiner pays while its donors keep the
cores busy. The package is registered here without running that `__init__`, before the
imports below, so that `hivemind.dht`, `hivemind.p2p` and `hivemind.utils` load alone; only if
nothing imported hivemind first (then the whole package is already there and is used as it
is). A name of the package's own (`hivemind.DHT`, `hivemind.__version__`) still works: its
first use runs the real `__init__`.
"""

from __future__ import annotations

import functools
import importlib.util
import os
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
# Where a `hivemind.DHT` process runs (the tests' harness; a node runs its DHT on its own loop,
# dht_in_process.py, and makes no such futures), hivemind's futures share one byte each across
# its two processes (utils/mpfuture.py), through torch's "file_system" strategy unless told
# otherwise: that starts a torch_shm_manager process, 107 MB resident (it links all of libtorch)
# for a few bytes. Passed as file descriptors instead, the bytes need no manager. A user's own
# choice stands.
os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")


import base58
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht import DHT, DHTNode
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import crypto_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.logging import use_hivemind_log_handler
from hivemind.utils.multiaddr import Multiaddr

__all__ = [
    "DHT",
    "DHTID",
    "P2P",
    "P2P_DAEMON_LOGGER",
    "CompositeValidator",
    "DHTNode",
    "DHTRecord",
    "MSGPackSerializer",
    "Multiaddr",
    "PeerID",
    "RSAPrivateKey",
    "RSASignatureValidator",
    "RecordValidatorBase",
    "crypto_pb2",
    "get_dht_time",
    "key_of",
    "log_through_root",
    "signing_key",
]

P2P_DAEMON_LOGGER = "hivemind.p2p.p2p_daemon"  # where p2pd's own lines are logged (one line per message)


# distinct peer ids whose base58 form is remembered (a swarm's peers and the DHT's contacts;
# ids a hostile contact makes up only take turns in it)
PEER_IDS_REMEMBERED = 4096


@functools.lru_cache(maxsize=PEER_IDS_REMEMBERED)
def _base58(peer_id_bytes: bytes) -> str:
    return base58.b58encode(peer_id_bytes).decode()


def _peer_id_init(self: PeerID, peer_id_bytes: bytes) -> None:
    self._bytes = peer_id_bytes
    self._b58_str = _base58(bytes(peer_id_bytes))


def _peer_ids_with_remembered_base58() -> None:
    """hivemind's PeerID encodes its bytes to base58 when it is made (a pure-Python big-integer
    loop), and its DHT makes one for every contact in every answer to a find: with 32 nodes on 2
    cores, 7.5% of a node's CPU samples during its rounds were that encoding (py-spy, `tests.bench.scale`),
    of a few dozen ids seen over and over. The same ids now take their base58 from a bounded
    cache; the PeerID is the same object with the same fields (`tests/test_hivemind_contract.py`)."""
    PeerID.__init__ = _peer_id_init


_peer_ids_with_remembered_base58()


def signing_key(key: rsa.RSAPrivateKey) -> RSAPrivateKey:
    """hivemind's RSA key around a cryptography key (hivemind signs DHT records with it). Its
    constructor only generates new keys: the key it wraps is a private attribute, set here."""
    wrapped = RSAPrivateKey.__new__(RSAPrivateKey)
    wrapped._private_key = key
    return wrapped


def key_of(key: RSAPrivateKey) -> rsa.RSAPrivateKey:
    """The cryptography key inside hivemind's (the one that also signs this node's TLS certificate)."""
    inner = key._private_key
    assert isinstance(inner, rsa.RSAPrivateKey)
    return inner


def log_through_root() -> None:
    """hivemind's loggers hand their lines to the root logger's handlers (the node's format)."""
    use_hivemind_log_handler("nowhere")
