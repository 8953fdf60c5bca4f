"""A subkey entry stored straight on the DHT nodes nearest its key that this node already knows.

hivemind's `DHTNode.store` first searches the DHT for the nodes nearest the key (its beam of
`dht_requests.READ_BEAM` nodes, each asked in turn), then writes to the `REPLICAS` nearest. Each
node it asks during that search answers with the key's whole value too, so a heartbeat's store
of one membership record brought every record of the swarm back from eight nodes: eight of a
beat's thirteen requests, and what the swarm's idle CPU went on (issue 60). A node that reads
the membership key every second or two (the pacer, the wait for --min-peers, matchmaking) has
just met the nodes nearest it: each node that answers a lookup is put into the routing table.
`store_near` writes to those nodes from the table, without the search: the same replicas,
five requests instead of thirteen. A node that left a request unanswered is skipped for a while
(hivemind's ban, which its searches honour too): one that is paused, or busy starting up, would
otherwise cost every beat of every peer that writes to it a 3 s wait. The caller (`Membership.announce`) still makes every few
beats a full store, which refreshes the table where this node reads nothing, and falls back to
one when the table is too thin or no replica took the entry.

It runs on the DHT's loop (`SwarmDHT.run_coroutine`), as hivemind's own store does, with the
same signing: the entry is signed with this node's record key before it leaves.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from .hivemind_adapter import DHTID, DHTNode, DHTRecord, PeerID

# candidates a failed replica may be replaced from (the nearest first), as hivemind's store
# tries the next nearest node when one does not answer
SPARE_REPLICAS = 3


async def store_near(
    key: str,
    subkey: Any,
    value: Any,
    expiration_time: float,
    replicas: int,
    _dht: object,
    node: DHTNode,
) -> int | None:
    """Store one subkey entry on the `replicas` nodes nearest `key` in this node's routing table
    (this node itself when it is among them); returns how many took it, or None when the table
    knows fewer than `replicas` other nodes (the caller searches the DHT instead)."""
    protocol = node.protocol
    key_id = DHTID.generate(source=key)
    known = [
        (near, peer)
        for near, peer in protocol.routing_table.get_nearest_neighbors(
            key_id, replicas + SPARE_REPLICAS, exclude=node.node_id
        )
        if peer not in node.blacklist  # a node that left a request unanswered lately, as a search skips it
    ]
    if len(known) < replicas:
        return None
    record = DHTRecord(
        key_id.to_bytes(), protocol.serializer.dumps(subkey), protocol.serializer.dumps(value), expiration_time
    )
    validator = protocol.record_validator
    signed = validator.sign_value(record) if validator is not None else record.value
    peers: dict[DHTID, PeerID] = dict(known)
    # this node is a replica when it is among the nearest, as in hivemind's store; but no reader
    # asks a node in client mode for anything, so one behind NAT sends every replica out
    here = (
        not protocol.client_mode and node.node_id in sorted([*peers, node.node_id], key=key_id.xor_distance)[:replicas]
    )
    remote = sorted(peers, key=key_id.xor_distance)
    chosen, spares = remote[: replicas - here], remote[replicas - here :]
    stored = 0
    valid_here = here and (validator is None or validator.validate(dataclasses.replace(record, value=signed)))
    if valid_here and protocol.storage.store(key_id, signed, expiration_time, subkey=subkey):
        stored += 1
    while chosen:
        answers = await asyncio.gather(
            *(
                protocol.call_store(
                    peers[n], keys=[key_id], values=[signed], expiration_time=[expiration_time], subkeys=[subkey]
                )
                for n in chosen
            )
        )
        for near, answer in zip(chosen, answers, strict=True):
            if answer is None:  # banned for a while, as hivemind's search bans a node that did not answer
                node.blacklist.register_failure(peers[near])
            else:
                node.blacklist.register_success(peers[near])
        stored += sum(1 for answer in answers if answer is not None and all(answer))
        unanswered = sum(1 for answer in answers if answer is None)
        chosen, spares = spares[:unanswered], spares[unanswered:]
    if stored and key_id in protocol.cache:  # as hivemind's store keeps a cached dictionary current
        protocol.cache.store_subkey(key_id, subkey, signed, expiration_time)
    return stored
