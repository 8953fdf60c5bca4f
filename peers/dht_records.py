"""What a swarm's DHT may hold, checked where our nodes store a value and where they read one.

Every entry dtnode writes is a subkey entry signed by its writer's own key (identity.py): a
small map, expiring within minutes or hours. hivemind keeps, for a key, the value with the
latest expiration, and a plain value (no subkey) stored over a dictionary with a later
expiration is kept in its place: an outsider's plain hivemind DHT could store one under the
membership key or a group key, expiring in years, and every member would read nobody there.

`SwarmRecords`, installed in every node's DHT beside hivemind's signature validator, refuses:
- a plain value, under any key (dtnode never writes one);
- an entry whose subkey names no owner key of its writer's peer id (`identity.writer_of`;
  hivemind's `RSASignatureValidator`, which runs first, has checked that the owner signed it);
- a value larger than MAX_VALUE_BYTES, or one that is not a map with string keys;
- an expiration more than MAX_EXPIRY_S ahead of this node's clock.

hivemind applies it to every store another peer asks of this node, and to every value a lookup
brings back (a dictionary holding one refused entry is dropped whole, from that peer's answer),
so an outsider's values are neither kept by our nodes nor read by them. Readers still validate
every field of what they take (membership.py, matchmaking.py): this validator checks shapes only.
"""

from __future__ import annotations

from .hivemind_adapter import DHTRecord, MSGPackSerializer, RecordValidatorBase, get_dht_time
from .identity import writer_of

MAX_VALUE_BYTES = 16384  # a membership record with a 4 KB certificate and a 2 KB recipe is about 8 KB
# an entry's longest honest life: a later hop's registration lives its window (up to 600 s) plus an
# all-reduce deadline (up to 3600 s) plus a minute; a record, --peer-ttl (up to 600 s)
MAX_EXPIRY_S = 7200.0


class SwarmRecords(RecordValidatorBase):
    """Refuses what dtnode never writes (see the module)."""

    def validate(self, record: DHTRecord) -> bool:
        return refusal(record, get_dht_time()) is None

    @property
    def priority(self) -> int:
        return 5  # after hivemind's signature check (10), on the value stripped of its signature

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, SwarmRecords)  # one is enough


def refusal(record: DHTRecord, now: float) -> str | None:
    """Why a record is refused, or None when it has a shape dtnode writes."""
    try:
        subkey = MSGPackSerializer.loads(record.subkey)
    except Exception:  # noqa: BLE001  (msgpack raises many types on untrusted bytes)
        return "malformed subkey"
    if subkey is None:
        return "a plain value"
    if writer_of(subkey) is None:
        return "an entry not signed by its writer's own key"
    if len(record.value) > MAX_VALUE_BYTES:
        return f"a value of {len(record.value)} bytes"
    if not record.expiration_time <= now + MAX_EXPIRY_S:
        return "an expiration too far ahead"
    try:
        value = MSGPackSerializer.loads(record.value)
    except Exception:  # noqa: BLE001
        return "a malformed value"
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        return "a value that is not a map"
    return None
