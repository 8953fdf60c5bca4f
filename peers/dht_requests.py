"""The DHT reads and writes this process makes, counted by kind: what a node costs the DHT as
the swarm grows (`dtnode_dht_requests_total`, tests/bench/scale.py).

Counted where the node's code asks hivemind (membership records, registrations, member lists),
not inside hivemind: the routing traffic each request sets off there is measured from outside,
as the bytes through the node's DHT process and p2pd.
"""

from __future__ import annotations

from collections import Counter
from enum import StrEnum


class DhtOp(StrEnum):
    GET = "get"
    STORE = "store"


# one node per process: a process-wide count, as a metric of the process is
REQUESTS: Counter[str] = Counter(dict.fromkeys(DhtOp, 0))


def count(op: DhtOp) -> None:
    """One request of kind `op` is about to go to the DHT."""
    REQUESTS[op] += 1
