"""What a swarm's DHT may hold (peers/dht_records.py): an outsider's values are neither kept
by our nodes nor read by them."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from dht_harness import ready_dht, run_in_fresh_process, signed_dhts
from fuzz_budget import inputs
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import P2P
from hivemind.utils import MSGPackSerializer, get_dht_time
from hypothesis import given
from hypothesis import strategies as st

from dtnode.peers.dht_records import MAX_EXPIRY_S, MAX_VALUE_BYTES, SwarmRecords, SwarmValidator, entry_digest, refusal
from dtnode.peers.identity import identity_key, signed_subkey
from dtnode.peers.matchmaking import Matchmaker
from dtnode.peers.membership import Membership, PeerRecord
from dtnode.peers.plan import Member

NOW = 1_000_000.0


def _owner(tmp_path, name: str) -> tuple[RSASignatureValidator, str]:
    path = tmp_path / f"{name}.key"
    P2P.generate_identity(str(path))
    validator = RSASignatureValidator(identity_key(path))
    from dtnode.peers.identity import peer_id_of_owner

    peer_id = peer_id_of_owner(validator.local_public_key)
    assert peer_id is not None
    return validator, peer_id


def _record(subkey: object, value: object, expiration: float = NOW + 60) -> DHTRecord:
    return DHTRecord(
        DHTID.generate(source="run.peers").to_bytes(),
        MSGPackSerializer.dumps(subkey),
        MSGPackSerializer.dumps(value),
        expiration,
    )


@pytest.fixture(scope="module")
def signed(tmp_path_factory) -> bytes:
    validator, peer_id = _owner(tmp_path_factory.mktemp("keys"), "writer")
    return signed_subkey(peer_id, validator.local_public_key)


def test_only_signed_small_maps_expiring_soon_are_kept(signed):
    assert refusal(_record(signed, {"peer_id": "x"}), NOW) is None
    assert refusal(_record(None, "shadow"), NOW) == "a plain value"
    assert refusal(_record(b"QmSomebody", {"a": 1}), NOW) == "an entry not signed by its writer's own key"
    assert refusal(_record("QmSomebody", {"a": 1}), NOW) == "an entry not signed by its writer's own key"
    assert refusal(_record(signed, {"a": 1}, NOW + MAX_EXPIRY_S + 1), NOW) == "an expiration too far ahead"
    assert refusal(_record(signed, {"a": "x" * MAX_VALUE_BYTES}), NOW).startswith("a value of")
    assert refusal(_record(signed, [1, 2, 3]), NOW) == "a value that is not a map"
    assert refusal(_record(signed, {1: 2}), NOW) is not None  # int keys: msgpack (strict) refuses them
    broken = DHTRecord(b"k", b"\xc1", b"\xc1", NOW)
    assert refusal(broken, NOW) == "malformed subkey"


@inputs(2000)
@given(subkey=st.binary(max_size=600), value=st.binary(max_size=2000), expiration=st.floats(allow_nan=True))
def test_any_bytes_are_judged_without_raising(subkey, value, expiration):
    """Peers send the subkey, value and expiration bytes as they like: the validator answers."""
    assert SwarmRecords().validate(DHTRecord(b"key", subkey, value, expiration)) in (True, False)


def test_a_plain_value_shadows_neither_membership_nor_groups(tmp_path):
    """Issue 56, finding 2: hivemind keeps the value with the latest expiration, and a plain
    value stored over a dictionary is kept in its place. An outsider with a plain hivemind DHT
    stored one under `{run_id}.peers` and under a group key, expiring in months: both honest
    nodes then listed nobody and averaged alone. Our nodes now refuse such values where they
    are asked to store them and where a lookup brings them back."""
    run_in_fresh_process(tmp_path, shadowing_scenario)


async def shadowing_scenario(folder):
    """The scenario of the test above, in a process of its own (dht_harness.run_in_fresh_process)."""
    honest = await signed_dhts(folder, ("a", "b"))
    # a hivemind DHT process, started off this loop: the honest DHTs run on it and answer its pings
    outsider = await asyncio.to_thread(
        ready_dht,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        initial_peers=[str(a) for a in honest[0][0].get_visible_maddrs()],
    )
    try:
        run_id = "shadowed"
        group_key = f"{run_id}.group.0.0.all"
        for key in (f"{run_id}.peers", group_key, f"{group_key}.closed"):
            await outsider.store(key, "shadow", expiration_time=get_dht_time() + 1e7, return_future=True)
        views = [Membership(dht, run_id, 60, 1, validator) for dht, validator in honest]
        for view in views:
            record = PeerRecord(peer_id=view.peer_id, grpc_addr="127.0.0.1:1", state="training")
            await view.announce(record)  # (its answer counts replicas; the outsider is one that refuses)
        for view in views:
            assert set(await view.members()) == {v.peer_id for v in views}
        makers = [
            Matchmaker(dht, run_id, Member(str(dht.peer_id), "127.0.0.1:1"), 0.05, owner=v.local_public_key)
            for dht, v in honest
        ]
        everyone = {m.own.peer_id for m in makers}

        async def expected():
            return everyone

        groups = await asyncio.gather(*(m.form_group(0, 0, expected, 10, 2) for m in makers))
        assert all({m.peer_id for m in g.members} == everyone for g in groups)
    finally:
        await asyncio.to_thread(outsider.shutdown)
        for dht, _ in reversed(honest):
            await dht.shutdown()


def _signed_entry(validator: RSASignatureValidator, subkey: bytes, value: object, expiration: float) -> DHTRecord:
    record = _record(subkey, value, expiration)
    return dataclasses.replace(record, value=validator.sign_value(record))


def test_an_entry_found_valid_is_remembered_and_nothing_else_passes_for_it(tmp_path):
    """Issue 60: a lookup brings back every entry from every node it asks, and the RSA check of
    each took a third of an idle DHT process's CPU. SwarmValidator remembers entries it found
    valid; an entry that differs in any byte, or in its expiration, is checked afresh and refused."""
    validator, peer_id = _owner(tmp_path, "writer")
    subkey = signed_subkey(peer_id, validator.local_public_key)
    now = get_dht_time()
    entry = _signed_entry(validator, subkey, {"peer_id": peer_id}, now + 60)
    checker = SwarmValidator(validator, remembered=4)
    assert checker.validate(entry) and checker.validate(entry)
    assert checker.remembered_count == 1
    tampered = dataclasses.replace(entry, value=entry.value.replace(peer_id.encode(), peer_id[::-1].encode()))
    assert not checker.validate(tampered)
    assert not checker.validate(dataclasses.replace(entry, expiration_time=entry.expiration_time + 1))
    other, other_id = _owner(tmp_path, "other")
    assert not checker.validate(
        dataclasses.replace(entry, subkey=_record(signed_subkey(other_id, other.local_public_key), 0).subkey)
    )
    # a signed entry of a shape dtnode never writes is refused, and not remembered
    too_far = _signed_entry(validator, subkey, {"a": 1}, now + MAX_EXPIRY_S + 60)
    assert not checker.validate(too_far)
    assert checker.remembered_count == 1
    # the memory is bounded; an entry pushed out of it is checked again, and still passes
    entries = [_signed_entry(validator, subkey, {"n": i}, now + 60) for i in range(6)]
    assert all(checker.validate(e) for e in entries)
    assert checker.remembered_count == 4
    assert checker.validate(entry) and checker.remembered_count == 4


@inputs(1500)
@given(
    parts=st.lists(
        st.tuples(
            st.binary(max_size=40),
            st.none() | st.binary(max_size=40),
            st.binary(max_size=40),
            st.floats(allow_nan=True),
        ),
        min_size=2,
        max_size=2,
    )
)
def test_entries_that_differ_have_different_digests(parts):
    """The memory's key: any two entries that differ in key, subkey (or its absence), value or
    expiration get different digests (the parts are length-prefixed: no two entries make one
    stream of bytes), and no bytes a peer sends make it raise."""
    one, two = (DHTRecord(*p) for p in parts)
    same = one.key == two.key and one.subkey == two.subkey and one.value == two.value
    same = same and repr(one.expiration_time) == repr(two.expiration_time)
    assert (entry_digest(one) == entry_digest(two)) == same
