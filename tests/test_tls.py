"""Mutual TLS on the data plane, in one process: real gRPC servers and streams on loopback.

What TLS must refuse is shown with the real parts: a client whose certificate no record
names, a server that is not the peer the client pinned, a member's stream that claims
another member's id, and a stream whose bytes a proxy on the path altered.
"""

from __future__ import annotations

import asyncio
import base64
from functools import cache

import pytest
import torch
from allreduce_harness import allreduce, start_peers, stop_peers, tls_stores
from cryptography.hazmat.primitives.asymmetric import rsa
from hypothesis import given, settings
from hypothesis import strategies as st
from path_tampering import FlippingProxy

from dtnode.peers.butterfly import butterfly_allreduce
from dtnode.peers.channel_pool import ChannelPool
from dtnode.peers.membership import PeerRecord
from dtnode.peers.plan import INT8, Member, make_plan
from dtnode.peers.tls import (
    NodeIdentity,
    TlsError,
    TrustStore,
    certificate_from_signature,
    certificate_signature,
    decode_certificate,
    encode_certificate,
    make_certificate,
)
from dtnode.peers.wire import max_message_bytes


def test_the_certificate_is_a_function_of_the_key_and_fits_a_record():
    key = rsa.generate_private_key(65537, 2048)
    first, again = make_certificate(key, "peer-a"), make_certificate(key, "peer-a")
    assert first == again  # a restarted node presents the same fingerprint
    text = encode_certificate(first)
    assert decode_certificate(text) == first
    for bad in ("", "not base64!", encode_certificate(b"\x30\x03garbage"), "A" * 10_000):
        with pytest.raises(TlsError):
            decode_certificate(bad)


@cache
def _signed(bits: int = 2048) -> tuple[rsa.RSAPrivateKey, bytes]:
    key = rsa.generate_private_key(65537, bits)
    return key, make_certificate(key, "peer-a")


@pytest.mark.parametrize("bits", [2048, 3072])
def test_a_record_carries_the_signature_and_a_reader_rebuilds_the_very_certificate(bits):
    """Issue 60: a record carried its certificate whole (1,180 characters of its 2,259) and every
    read brings every record back. It carries the signature; the rest follows from the record's
    key and peer id, and the rebuilt certificate is the node's own byte for byte (its
    fingerprint is what a server checks a stream against)."""
    key, der = _signed(bits)
    sig = certificate_signature(der)
    assert len(sig) <= 4 * bits // 24 + 4 < len(encode_certificate(der)) // 2
    PeerRecord(peer_id="peer-a", tls_sig=sig)  # within the record's bound
    assert certificate_from_signature(key.public_key(), "peer-a", sig) == der
    other = rsa.generate_private_key(65537, 2048).public_key()
    refused = [
        (key.public_key(), "peer-b", sig),  # another id's certificate: another to-be-signed part
        (other, "peer-a", sig),  # another key's record
        (key.public_key(), "peer-a", certificate_signature(make_certificate(key, "peer-b"))),
        (key.public_key(), "peer-a", ""),
        (key.public_key(), "peer-a", "A" * 5000),
        (key.public_key(), "peer-a", "not base64!"),
    ]
    for public, peer_id, text in refused:
        with pytest.raises(TlsError):
            certificate_from_signature(public, peer_id, text)


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(max_size=1100), st.binary(max_size=600).map(lambda b: base64.b64encode(b).decode())))
def test_any_signature_text_a_peer_announces_is_refused_or_the_certificate(text):
    """A record's signature field is untrusted: whatever it holds, the reader gets the node's
    certificate or a TlsError, never another exception."""
    key, der = _signed()
    try:
        assert certificate_from_signature(key.public_key(), "peer-a", text) == der
    except TlsError:
        pass


def test_a_record_tag_covers_its_certificate():
    plain = PeerRecord(peer_id="p", grpc_addr="h:1")
    assert plain.auth_subject() != plain.model_copy(update={"tls_sig": "QUJD"}).auth_subject()


def test_tls_all_reduce_gives_the_plaintext_result():
    async def main():
        values = [torch.randn(50_000, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        results = []
        for tls in (False, True):
            peers = await start_peers(3, tls=tls)
            try:
                outs, reports = await allreduce(peers, [v.clone() for v in values], [1.0, 1.0, 1.0])
            finally:
                await stop_peers(peers)
            assert all(not r.failed_parts for r in reports), reports
            results.append(outs)
        for plain, secure in zip(*results):  # equal up to the order senders' chunks were folded in
            assert torch.allclose(plain, secure, rtol=0, atol=1e-6)

    asyncio.run(main())


async def _one_part_to(target, sender_id: str, channels: ChannelPool, peers, numel: int = 4096):
    """`sender_id` streams its part to `target`'s reducer through `channels`; the failed parts' errors."""
    plan = make_plan("test-run", 0, 0, [p.member for p in peers], numel, 64, 1 << 12, INT8)
    values = torch.ones(numel)
    out = torch.empty_like(values)
    target_index = plan.index_of(target.member.peer_id)
    report = await butterfly_allreduce(
        plan, sender_id, values, 1.0, out, peers[target_index].registry, channels, timeout=3.0
    )
    return [p.error for p in report.failed_parts if p.reducer == target.member.peer_id]


def test_a_member_cannot_speak_as_another_member():
    async def main():
        peers = await start_peers(3, tls=True)
        try:
            # peer02 (a member, known to every server) claims to be peer01 on its stream to peer00
            errors = await _one_part_to(peers[0], "peer01", peers[2].channels, peers[:2])
            assert errors and "PERMISSION_DENIED" in errors[0] and "peer01" in errors[0], errors
        finally:
            await stop_peers(peers)

    asyncio.run(main())


def test_a_client_whose_certificate_no_record_names_is_refused():
    async def main():
        peers = await start_peers(2, tls=True)
        stranger = tls_stores(["peer01", "peer00"])[0]  # a fresh key claiming peer01's id
        stranger.learn("peer00", encode_certificate(peers[0].channels.trust.own.cert_der))  # and pinning peer00
        channels = ChannelPool(max_message_bytes(1 << 12), stranger)
        try:
            errors = await _one_part_to(peers[0], "peer01", channels, peers)
            assert errors and "UNAVAILABLE" in errors[0], errors  # the handshake itself fails
        finally:
            await channels.close()
            await stop_peers(peers)

    asyncio.run(main())


def test_a_server_that_is_not_the_pinned_peer_is_refused():
    async def main():
        peers = await start_peers(2, tls=True)
        # peer01's pool believes peer00's certificate is a stranger's: the real peer00 cannot prove it
        impostor = NodeIdentity.from_key(rsa.generate_private_key(65537, 2048), "peer00")
        trust: TrustStore = peers[1].channels.trust
        trust.learn("peer00", encode_certificate(impostor.cert_der))
        try:
            errors = await _one_part_to(peers[0], "peer01", peers[1].channels, peers)
            assert errors and "UNAVAILABLE" in errors[0], errors
        finally:
            await stop_peers(peers)

    asyncio.run(main())


def test_one_flipped_byte_on_the_path_breaks_the_stream_and_it_is_sent_again():
    async def main():
        peers = await start_peers(2, tls=True)
        port = int(peers[0].member.grpc_addr.rsplit(":", 1)[1])
        proxy = FlippingProxy(port, offset=6_000)  # past the handshake, inside the first chunk
        proxy_port = await proxy.start()
        via_proxy = [Member(peers[0].member.peer_id, f"127.0.0.1:{proxy_port}"), peers[1].member]
        values = [torch.full((200_000,), float(i)) for i in range(2)]
        try:
            outs, reports = await allreduce(
                peers, values, [1.0, 1.0], chunk_elements=1 << 14, timeout=5.0, members=via_proxy
            )
        finally:
            proxy.server.close()
            await stop_peers(peers)
        assert proxy.flipped
        # gRPC core reports a TLS record that fails its MAC as INTERNAL (or the reset as UNAVAILABLE)
        assert len(reports[1].retried) == 1 and reports[1].retried[0] in ("INTERNAL", "UNAVAILABLE"), reports[1]
        assert proxy.connections == 2  # sent again on a connection dialled afresh, not the one that broke
        assert not reports[0].failed_parts and not reports[1].failed_parts, reports
        for out in outs:  # no altered byte reached anyone: both hold the exact mean
            assert torch.allclose(out, torch.full_like(out, 0.5), atol=1e-2)
        assert torch.equal(outs[0], outs[1])

    asyncio.run(main())


@pytest.mark.parametrize("tls", [False, True])
def test_a_renewed_channel_dials_a_new_connection_and_the_pool_closes_it(tls):
    async def main():
        peers = await start_peers(2, tls=tls)
        port = int(peers[0].member.grpc_addr.rsplit(":", 1)[1])
        proxy = FlippingProxy(port, offset=1 << 40)  # counts connections, flips nothing
        proxy_address = f"127.0.0.1:{await proxy.start()}"
        via_proxy = [Member(peers[0].member.peer_id, proxy_address), peers[1].member]
        values = [torch.full((20_000,), float(i)) for i in range(2)]
        pool = peers[1].channels
        try:
            for round_no in range(3):
                _, reports = await allreduce(
                    peers, [v.clone() for v in values], [1.0, 1.0], members=via_proxy, round=round_no
                )
                assert not any(r.failed_parts for r in reports), reports
                # one long-lived connection, then a new one once renewed (gRPC's global subchannel
                # pool would hand the new channel the old connection: it must not)
                assert proxy.connections == (1 if round_no < 2 else 2)
                if round_no == 1:
                    pool.renew(proxy_address, peers[0].member.peer_id, grace=5.0)
        finally:
            proxy.server.close()
            await stop_peers(peers)
        assert not pool._retiring  # closed with the pool

    asyncio.run(main())


def test_the_trust_store_forgets_peers_gone_and_a_full_one_still_learns():
    """Issue 56, finding 10: the trust store never forgot a peer and stopped learning at 16,384,
    so Sybil records filled it once and locked every later joiner out of the data plane. It now
    forgets peers whose record was not read for a while, and a full store forgets the least
    recently seen peer to learn a new one (its own certificate stays)."""
    own_key = rsa.generate_private_key(65537, 2048)
    store = TrustStore(NodeIdentity.from_key(own_key, "me"), "me")
    store.MAX_PEERS = 3
    certs = {p: encode_certificate(make_certificate(rsa.generate_private_key(65537, 2048), p)) for p in "abcd"}
    for p in "abc":
        assert store.learn(p, certs[p])
    assert store.learn("d", certs["d"])  # full: "a", seen least recently, makes room
    assert store.certificate("a") is None and store.certificate("d") is not None and store.size == 3
    store.forget_unseen(0.0)  # nobody's record was read just now
    assert store.size == 1 and store.certificate("me") is not None


def test_the_channel_pool_keeps_one_channel_per_peer_and_drops_peers_gone():
    """Issue 56, finding 10: the channel pool never dropped a channel, so a member announcing a
    new address with every registration left a connection open in each group-mate per hop."""
    from dtnode.peers.channel_pool import ChannelPool

    async def main():
        pool = ChannelPool(1 << 20)
        for port in range(20):
            pool.stub(f"127.0.0.1:{10000 + port}", "shifty")
        pool.stub("127.0.0.1:9999", "steady")
        assert pool.size == 2  # each new address replaced the peer's old channel
        pool.retain({"steady"})
        assert pool.size == 1
        await pool.close()

    asyncio.run(main())
