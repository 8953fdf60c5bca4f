"""dtnode: a fault-tolerant peer-to-peer DiLoCo training daemon.

The repository root is this package; `daemon`, `peers`, `ops` and `proto` are its layers
(see ARCHITECTURE.md): ops is pure math, peers the network, daemon the node.
"""

__version__ = "0.1.0"

# Before anything imports hivemind: dtnode uses its DHT only, and `dtnode.peers` registers the
# package so that its trainer stack (a second of imports at every start) is never loaded.
from dtnode import peers as _peers  # noqa: F401  (imported for its effect, before any hivemind import)
