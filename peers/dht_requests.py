"""The DHT reads and writes this process makes, counted by kind: what a node costs the DHT as
the swarm grows (`dtnode_dht_requests_total`, tests/bench/scale.py).

Counted where the node's code asks hivemind (membership records, registrations, member lists),
not inside hivemind: the routing traffic each request sets off there is measured from outside,
as the bytes through the node's p2pd daemon.
"""

from __future__ import annotations

from collections import Counter
from enum import StrEnum

# A write goes to the REPLICAS nodes nearest its key (hivemind's default, set explicitly). A read
# of the latest value (every dictionary we read: membership, registrations, lists) asks the
# READ_BEAM nearest, and a write looks for its REPLICAS among as many: hivemind's own default
# asks its whole bucket, 20 nodes, for both, so that below 21 peers every read and every
# heartbeat's write asked every peer, and each answered with every entry under the key (a
# write's search for the nearest nodes brings the key's value back too): n² record checks a
# read (issue 60). A few past REPLICAS cover routing tables that disagree for a moment.
REPLICAS = 5
READ_BEAM = REPLICAS + 3
# Every read of the membership key brings back all n records. Polls of it (the pacer's, the
# wait for --min-peers) run at their own rate up to this many peers, and proportionally less
# often above, so that what a node reads per second stays flat as the swarm grows
FULL_RATE_PEERS = 8


def poll_stretch(peers: int) -> float:
    """The factor a membership poll's interval is stretched by in a swarm of `peers` (see above)."""
    return max(1.0, peers / FULL_RATE_PEERS)


class DhtOp(StrEnum):
    GET = "get"
    STORE = "store"


class DhtKey(StrEnum):
    """Which of the swarm's keys a request is for: what each costs is known by kind (a read of
    the membership brings every peer's record back, one of a group key that group's entries)."""

    MEMBERSHIP = "membership"  # `{run_id}.peers`: one record per peer
    REGISTRATIONS = "registrations"  # a group key: one registration per registrant
    CLOSED = "closed"  # `{group key}.closed`: the member lists leaders closed
    FORMED = "formed"  # `{group key}.formed`: the group each registrant ended up in
    DECLINED = "declined"  # `{group key}.declined`: lists on hold each member will not take


# one node per process: a process-wide count, as a metric of the process is; every pair present
# from the start (at zero), so that rate() works from the first scrape
REQUESTS: Counter[tuple[str, ...]] = Counter(dict.fromkeys(((op, key) for op in DhtOp for key in DhtKey), 0))


def count(op: DhtOp, key: DhtKey) -> None:
    """One request of kind `op` for a key of kind `key` is about to go to the DHT."""
    REQUESTS[(op, key)] += 1
