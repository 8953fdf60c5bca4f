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

`SwarmValidator` runs both checks, the owner's signature and then the shapes, and remembers the
entries it found valid. A lookup of a dictionary brings back every entry from every node it
asks: the membership key holds one signed record per peer, each read n times a heartbeat, and
an RSA check, a key parse and a strip of about 3 kB each time took a third of an idle DHT
process's CPU (issue 60). The verdict depends only on the entry's bytes and its expiration
(and on this node's clock, through a bound that only ever loosens: a valid entry stays valid),
so an entry seen before is valid without a second check. Refusals are not remembered: they
are rare, and an entry refused for its expiration may pass later.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict

from .hivemind_adapter import DHTRecord, MSGPackSerializer, RecordValidatorBase, RSASignatureValidator, get_dht_time
from .identity import writer_of

MAX_VALUE_BYTES = 16384  # a membership record with a 4 KB certificate and a 2 KB recipe is about 8 KB
# an entry's longest honest life: a later hop's registration lives its window (up to 600 s) plus an
# all-reduce deadline (up to 3600 s) plus a minute; a record, --peer-ttl (up to 600 s)
MAX_EXPIRY_S = 7200.0
# entries remembered valid: a heartbeat's records and a round's registrations of a 1,000-peer
# swarm, at 40 bytes each; an entry pushed out is checked again the next time it is read
REMEMBERED_VALID = 4096


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


class SwarmValidator(RecordValidatorBase):
    """hivemind's owner-signature check, then `SwarmRecords`' shapes, with the entries found
    valid remembered (see the module). It signs and strips as the signature check does."""

    def __init__(self, signatures: RSASignatureValidator, remembered: int = REMEMBERED_VALID):
        self.signatures = signatures
        self.shapes = SwarmRecords()
        self.remembered = remembered
        self._valid: OrderedDict[bytes, None] = OrderedDict()

    def validate(self, record: DHTRecord) -> bool:
        digest = entry_digest(record)
        if digest in self._valid:
            self._valid.move_to_end(digest)
            return True
        if not self.signatures.validate(record):
            return False
        if not self.shapes.validate(dataclasses.replace(record, value=self.signatures.strip_value(record))):
            return False
        self._valid[digest] = None
        if len(self._valid) > self.remembered:
            self._valid.popitem(last=False)
        return True

    @property
    def remembered_count(self) -> int:
        """How many entries it remembers as valid now."""
        return len(self._valid)

    def sign_value(self, record: DHTRecord) -> bytes:
        return self.signatures.sign_value(record)

    def strip_value(self, record: DHTRecord) -> bytes:
        return self.signatures.strip_value(record)

    @property
    def priority(self) -> int:
        return self.signatures.priority

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, (SwarmValidator, RSASignatureValidator, SwarmRecords))  # it holds both


def entry_digest(record: DHTRecord) -> bytes:
    """A digest of everything a verdict depends on: key, subkey (or its absence), value and
    expiration, each length-prefixed so that no two entries share one stream of bytes."""
    digest = hashlib.blake2b(digest_size=20)
    for part in (record.key, record.subkey, record.value):
        if part is None:
            digest.update(b"\xff" * 8)
            continue
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    digest.update(repr(record.expiration_time).encode())  # the float as sent (repr: any type, no exception)
    return digest.digest()
