"""dtnode: a fault-tolerant peer-to-peer DiLoCo training daemon.

The repository root is this package; `daemon`, `peers`, `ops` and `proto` are its layers
(see ARCHITECTURE in the README): ops is pure math, peers the network, daemon the node.
"""

__version__ = "0.1.0"
