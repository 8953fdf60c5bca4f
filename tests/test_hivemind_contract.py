"""What dtnode relies on in hivemind, beyond its public DHT API, checked in one place: an
upgrade that changes any of it fails here, by name, before it fails as a swarm that cannot
sign, validate or log. (pyproject pins hivemind==1.1.12; this is what a bump must keep.)"""

import inspect
import json
import logging

import pytest

import dtnode.peers.hivemind_adapter  # noqa: F401  (hivemind registered without its trainer stack first)


def test_the_pinned_version_is_the_one_installed():
    import importlib.metadata

    assert importlib.metadata.version("hivemind") == "1.1.12"


def test_an_rsa_key_is_a_cryptography_key_in_a_private_attribute():
    """peers/hivemind_adapter.py wraps a key read from the identity file by setting
    `_private_key` (`signing_key`), and reads it back for the TLS certificate (`key_of`);
    hivemind signs with it."""
    from cryptography.hazmat.primitives.asymmetric import rsa
    from hivemind.utils.crypto import RSAPrivateKey

    key = RSAPrivateKey()
    assert isinstance(key._private_key, rsa.RSAPrivateKey)
    assert key.get_public_key().to_bytes().startswith(b"ssh-rsa ")
    assert {"sign", "get_public_key"} <= set(dir(key))

    from dtnode.peers.hivemind_adapter import key_of, signing_key

    inner = rsa.generate_private_key(65537, 2048)
    wrapped = signing_key(inner)
    assert key_of(wrapped) is inner
    signature = wrapped.sign(b"record")
    assert wrapped.get_public_key().verify(b"record", signature)


def test_the_owner_marker_format_is_the_one_records_are_checked_against():
    from hivemind.dht.crypto import RSASignatureValidator

    assert RSASignatureValidator.PUBLIC_KEY_FORMAT == b"[owner:_key_]"
    assert {"validate", "sign_value", "strip_value", "merge_with"} <= set(dir(RSASignatureValidator))


def test_validators_see_records_with_these_fields():
    from hivemind.dht.validation import DHTRecord, RecordValidatorBase

    assert [f for f in DHTRecord.__dataclass_fields__] == ["key", "subkey", "value", "expiration_time"]
    assert {"validate", "sign_value", "strip_value", "priority", "merge_with"} <= set(dir(RecordValidatorBase))


def test_p2pd_log_lines_go_through_one_static_method_on_the_p2p_daemon_logger():
    """daemon/cli/main.py filters one p2pd ERROR line on the `hivemind.p2p.p2p_daemon` logger."""
    from hivemind.p2p.p2p_daemon import P2P

    assert "line" in inspect.signature(P2P._log_p2pd_message).parameters
    seen: list[logging.LogRecord] = []
    collect = logging.Handler()
    collect.emit = seen.append  # type: ignore[method-assign]
    logger = logging.getLogger("hivemind.p2p.p2p_daemon")
    logger.addHandler(collect)
    try:
        P2P._log_p2pd_message(
            json.dumps({"level": "error", "ts": "2026-11-29T09:00:00.000Z", "logger": "p", "caller": "c", "msg": "m"})
        )
    finally:
        logger.removeHandler(collect)
    assert [r.levelno for r in seen] == [logging.ERROR]


def test_the_dht_api_dtnode_calls_is_there():
    from hivemind.dht import DHT
    from hivemind.utils import MSGPackSerializer, get_dht_time
    from hivemind.utils.logging import use_hivemind_log_handler

    for name in ("run_coroutine", "get_visible_maddrs", "shutdown", "peer_id"):
        assert hasattr(DHT, name), name
    assert callable(get_dht_time) and callable(use_hivemind_log_handler)
    assert MSGPackSerializer.loads(MSGPackSerializer.dumps({"a": 1})) == {"a": 1}


def test_reads_and_writes_take_the_beam_and_replica_counts_dtnode_sets():
    """peers/dht_requests.py: reads of the latest value ask READ_BEAM nodes (`beam_size`, passed
    by DHT.get to DHTNode.get_many_by_id; a write's search as well), writes go to REPLICAS (`num_replicas` of DHTNode.create,
    passed by DHT's keyword arguments); hivemind's default read asks its whole bucket of 20."""
    from hivemind.dht import DHTNode

    assert "beam_size" in inspect.signature(DHTNode.get_many_by_id).parameters
    # a write's keyword arguments reach the search for its nearest nodes (DHTNode.store_many)
    assert "kwargs" in inspect.signature(DHTNode.store_many).parameters
    assert "beam_size" in inspect.signature(DHTNode.find_nearest_nodes).parameters
    create = inspect.signature(DHTNode.create).parameters
    assert create["num_replicas"].default == 5 and create["bucket_size"].default == 20


def test_the_node_sends_finds_and_stores_through_its_protocol_object_which_says_none_for_no_answer():
    """peers/dht_unanswered.py wraps `call_find` and `call_store` on the node's DHTProtocol
    object (`dtnode_dht_unanswered_total`): DHTNode must reach them through that object, and
    each must return None for a request that got no answer (tests/test_silent_dht_peer.py
    checks the count with a frozen peer)."""
    from hivemind.dht import DHTNode
    from hivemind.dht.protocol import DHTProtocol

    assert "self.protocol.call_find(" in inspect.getsource(DHTNode._call_find_with_blacklist)
    assert "self.protocol.call_store(" in inspect.getsource(DHTNode.store_many)
    for name in ("call_find", "call_store"):
        request = getattr(DHTProtocol, name)
        source = inspect.getsource(request)
        # a request that times out or fails is caught, and the method ends without a value
        assert "timeout=self.wait_timeout" in source and "except Exception:" in source, name
        assert str(inspect.signature(request).return_annotation).startswith("Optional["), name


@pytest.mark.parametrize("module", ["hivemind.dht", "hivemind.p2p", "hivemind.utils"])
def test_dtnode_loads_hivemind_without_its_trainer_stack(module):
    """peers/hivemind_adapter.py registers the package without its __init__ (over a second of start-up):
    the subpackages dtnode uses must load alone."""
    import importlib

    assert importlib.import_module(module) is not None


def test_a_peer_id_takes_its_base58_from_the_adapters_cache_and_is_the_same_object():
    """peers/hivemind_adapter.py replaces PeerID.__init__ so that the base58 form of an id seen
    before is not encoded again (hivemind's DHT makes a PeerID for every contact of every find).
    It relies on PeerID keeping its bytes and base58 form in `_bytes` and `_b58_str`."""
    import os

    import base58
    from hivemind.p2p import PeerID

    from dtnode.peers import hivemind_adapter

    assert set(inspect.signature(PeerID.__init__).parameters) == {"self", "peer_id_bytes"}
    raw = b"\x12\x20" + os.urandom(32)  # a sha256 multihash, as a peer's id
    made = PeerID(raw)
    before = hivemind_adapter._base58.cache_info().hits
    again = PeerID(raw)
    assert hivemind_adapter._base58.cache_info().hits == before + 1  # `made` put it in the cache
    assert again == made and hash(again) == hash(made) and str(again) == base58.b58encode(raw).decode()
    assert PeerID.from_base58(str(made)) == made and again._bytes == raw and again._b58_str == made.to_base58()
    assert str(PeerID(bytearray(raw))) == str(made)  # bytes-like ids too (the cache key is bytes)
