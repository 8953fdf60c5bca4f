"""The multiaddr parser of `--peer` and of a peer's /status (untrusted): any text is either a
peer address that prints back as given, or a PeerAddressError that shows a valid one."""

import hashlib

import base58
from fuzz_budget import inputs
from hypothesis import given
from hypothesis import strategies as st

from dtnode.peers.peer_address import EXAMPLE, PeerAddressError, is_peer_address, parse_peer_address

PARTS = ["", "ip4", "ip6", "dns", "dns4", "tcp", "udp", "p2p", "1.2.3.4", "::1", "7700", "0", "65536", "Qm", "x"]


def _peer_id(seed: bytes, ed25519: bool) -> str:
    if ed25519:  # an identity multihash of a protobuf'd Ed25519 key, as 12D3KooW... ids are
        return base58.b58encode(b"\x00\x24\x08\x01\x12\x20" + hashlib.sha256(seed).digest()).decode()
    return base58.b58encode(b"\x12\x20" + hashlib.sha256(seed).digest()).decode()


@inputs(3000)
@given(st.one_of(st.text(max_size=400), st.lists(st.sampled_from(PARTS), max_size=9).map("/".join)))
def test_any_text_is_a_peer_address_or_a_clear_refusal(text):
    try:
        address = parse_peer_address(text)
    except PeerAddressError as e:
        assert "a valid one looks like" in str(e) and EXAMPLE in str(e)
        assert not is_peer_address(text)
    else:
        assert str(address) == text and is_peer_address(text)


@inputs(1000)
@given(
    host=st.one_of(
        st.ip_addresses(v=4).map(lambda ip: ("ip4", str(ip))),
        st.ip_addresses(v=6).map(lambda ip: ("ip6", str(ip))),
        st.from_regex(r"\A[a-z][a-z0-9-]{0,20}[a-z0-9](\.[a-z]{2,6}){0,2}\Z").map(lambda name: ("dns4", name)),
    ),
    port=st.integers(1, 65535),
    seed=st.binary(max_size=16),
    ed25519=st.booleans(),
)
def test_every_address_a_node_announces_parses_to_its_parts(host, port, seed, ed25519):
    kind, name = host
    peer_id = _peer_id(seed, ed25519)
    address = parse_peer_address(f"/{kind}/{name}/tcp/{port}/p2p/{peer_id}")
    assert (address.kind, address.host, address.port, address.peer_id) == (kind, name, port, peer_id)


@inputs(500)
@given(seed=st.binary(max_size=16), cut=st.integers(1, 20))
def test_a_peer_id_cut_short_is_refused(seed, cut):
    peer_id = _peer_id(seed, ed25519=False)
    assert not is_peer_address(f"/ip4/1.2.3.4/tcp/7700/p2p/{peer_id[:-cut]}")


def test_the_example_in_every_message_is_itself_valid():
    assert is_peer_address(EXAMPLE)
