"""Swarm key and signed membership records: who gets in, and who cannot forge."""

import asyncio
import concurrent.futures
import hashlib
import threading
import time

import grpc
import hivemind
import pytest
import torch
from allreduce_harness import Peer, stop_peers, stream_status
from dht_harness import ready_dht, run_in_fresh_process
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from dtnode.peers.auth import GRPC_METADATA, HTTP_HEADER, AuthError, SwarmAuth, load_swarm_key
from dtnode.peers.butterfly import butterfly_allreduce
from dtnode.peers.channel_pool import ChannelPool
from dtnode.peers.identity import identity_key
from dtnode.peers.membership import Membership, PeerRecord
from dtnode.peers.plan import INT8, Member, make_plan
from dtnode.peers.reduction_registry import ReductionRegistry
from dtnode.peers.server import start_grpc_server
from dtnode.peers.service import AveragingService
from dtnode.peers.wire import chunk_message, max_message_bytes
from dtnode.proto import averaging_pb2_grpc as pb_grpc

KEY = load_swarm_key(None, {"DTNODE_SWARM_KEY": "correct horse battery staple"})
OTHER = load_swarm_key(None, {"DTNODE_SWARM_KEY": "another swarm's key, quite long"})


def test_tags_bind_purpose_subject_issuer_and_time_and_are_single_use():
    alice, bob = SwarmAuth(KEY, "alice"), SwarmAuth(KEY, "bob")
    tag = alice.issue("grpc", "run/1/0/ab/2")
    assert bob.verify("grpc", "run/1/0/ab/2", tag, peer_id="alice") == "alice"
    with pytest.raises(AuthError, match="replayed"):
        bob.verify("grpc", "run/1/0/ab/2", tag, peer_id="alice")
    for purpose, subject, issuer in [
        ("http", "run/1/0/ab/2", "alice"),
        ("grpc", "run/2/0/ab/2", "alice"),
        ("grpc", "run/1/0/ab/2", "mallory"),
    ]:
        with pytest.raises(AuthError):
            bob.verify(purpose, subject, alice.issue("grpc", "run/1/0/ab/2"), peer_id=issuer)
    with pytest.raises(AuthError, match="invalid"):
        bob.verify("grpc", "x", SwarmAuth(OTHER, "alice").issue("grpc", "x"))
    stale = f"alice.{int((time.time() - 3600) * 1000)}.{'0' * 64}"
    with pytest.raises(AuthError, match="stale"):
        bob.verify("grpc", "x", stale)
    for garbage in (None, "", "no-dots", "a.b.c", "x" * 600):
        with pytest.raises(AuthError):
            bob.verify("grpc", "x", garbage)


def test_swarm_key_sources(tmp_path):
    assert load_swarm_key(None, {}) is None
    with pytest.raises(AuthError, match="at least 16 bytes"):
        load_swarm_key(None, {"DTNODE_SWARM_KEY": "short"})
    path = tmp_path / "swarm.key"
    path.write_text("correct horse battery staple\n")
    assert load_swarm_key(str(path), {}) == KEY
    with pytest.raises(AuthError, match="cannot read"):
        load_swarm_key(str(tmp_path / "missing"), {})


async def _keyed_peers(n: int, auth_for) -> list[Peer]:
    peers = []
    for i in range(n):
        registry = ReductionRegistry()
        service = AveragingService(registry, "run", registration_wait=1.0, auth=auth_for(f"peer{i}"))
        server, port = await start_grpc_server(service, "127.0.0.1", 0, max_message_bytes(4096))
        peers.append(
            Peer(
                Member(f"peer{i}", f"127.0.0.1:{port}"), registry, server, ChannelPool(max_message_bytes(4096)), service
            )
        )
    return peers


def test_keyed_group_averages_and_streams_without_a_valid_tag_are_refused():
    async def main():
        peers = await _keyed_peers(2, lambda p: SwarmAuth(KEY, p))
        plan = make_plan("run", 3, 0, [p.member for p in peers], 8192, 64, 4096, INT8)
        values = [torch.randn(8192) for _ in peers]
        outs = [torch.empty(8192) for _ in peers]

        async def intruder(tag):
            part = plan.index_of("peer0")
            _, length = plan.parts[part]
            msg = chunk_message(plan, part, "peer1", 1.0, 0, values[1][: min(length, 4096)])
            async with grpc.aio.insecure_channel(peers[0].member.grpc_addr) as channel:
                return await stream_status(
                    pb_grpc.AveragingStub(channel).Reduce(
                        iter([msg]), metadata=((GRPC_METADATA, tag),) if tag else None
                    )
                )

        try:
            codes = [await intruder(None), await intruder(SwarmAuth(OTHER, "peer1").issue("grpc", "anything"))]
            reports = await asyncio.gather(
                *(
                    butterfly_allreduce(
                        plan,
                        p.member.peer_id,
                        v,
                        1.0,
                        o,
                        p.registry,
                        p.channels,
                        10.0,
                        auth=SwarmAuth(KEY, p.member.peer_id),
                    )
                    for p, v, o in zip(peers, values, outs)
                )
            )
        finally:
            await stop_peers(peers)
        assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 2
        assert all(not r.failed_parts for r in reports)
        expected = (values[0] + values[1]) / 2
        assert float((outs[0] - expected).norm() / expected.norm()) < 0.02

    asyncio.run(main())


def test_sidecar_requires_the_key_for_state_and_membership_but_not_for_health(tmp_path):
    import aiohttp
    from test_sync import FileView, _checkpoint

    from dtnode.daemon.catchup.admission import RecipeReader
    from dtnode.daemon.serve.sidecar import Sidecar

    async def main():
        info, _ = _checkpoint(tmp_path, 2)
        sidecar = Sidecar(FileView([info]), auth=SwarmAuth(KEY, "donor"))
        port = await sidecar.start("127.0.0.1", 0)
        base = f"http://127.0.0.1:{port}"
        joiner, stranger = SwarmAuth(KEY, "joiner"), SwarmAuth(OTHER, "joiner")
        try:
            async with aiohttp.ClientSession() as session:

                async def status(path, headers=None):
                    async with session.get(base + path, headers=headers or {}) as resp:
                        return resp.status

                assert await status("/healthz") == 200 and await status("/metrics") == 200
                assert await status("/checkpoint") == 401 and await status("/checkpoint/2") == 401
                assert await status("/peers") == 401 and await status("/recipe") == 401
                assert await status("/checkpoint/2", {HTTP_HEADER: stranger.issue("http", "/checkpoint/2")}) == 401
                assert await status("/checkpoint/2", {HTTP_HEADER: joiner.issue("http", "/checkpoint")}) == 401
                tag = joiner.issue("http", "/checkpoint/2")
                assert await status("/checkpoint/2", {HTTP_HEADER: tag}) == 200
                assert await status("/checkpoint/2", {HTTP_HEADER: tag}) == 401  # replayed
            # a joiner whose recipe differs reads the swarm's with the key (admission.py)
            view = sidecar.node
            announced = hashlib.sha256(view.recipe_json.encode()).hexdigest()
            holder = PeerRecord(peer_id="donor", http_addr=base)
            assert await RecipeReader(None).recipe(announced, [holder]) is None  # 401
            recipe = await RecipeReader(SwarmAuth(KEY, "joiner")).recipe(announced, [holder])
            assert recipe is not None and recipe.to_record() == view.recipe_json
        finally:
            await sidecar.stop()

    asyncio.run(main())


def _dht_with_identity(tmp_path, name: str, initial_peers=()) -> tuple[hivemind.DHT, RSASignatureValidator]:
    """A DHT whose records are signed with its own identity key, as a node's are.

    hivemind's DHT is a forked child of this (threaded) test process; once in a while one
    starts but never answers its parent (seen once in the suite: 300 s in get_visible_maddrs,
    then the timeout; once never ready, 300 s in its constructor). One that is not ready or does
    not answer within 30 s is stopped and another started."""
    path = tmp_path / f"{name}.key"
    P2P.generate_identity(str(path))
    validator = RSASignatureValidator(identity_key(path))
    for _ in range(3):
        dht = ready_dht(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            initial_peers=list(initial_peers),
            identity_path=str(path),
            record_validators=[validator],
        )
        probe = concurrent.futures.Future()
        threading.Thread(target=lambda d=dht, f=probe: f.set_result(d.get_visible_maddrs()), daemon=True).start()
        try:
            probe.result(timeout=30)
            return dht, validator
        except concurrent.futures.TimeoutError:
            dht.kill()
    raise AssertionError(f"three DHTs for {name} in a row did not answer")


def test_a_forged_membership_record_is_rejected(tmp_path):
    """Issue 31, findings 1 and 2. Mallory files records for Alice's id before Alice announces:
    one under his own key, one under no key at all; a fresh reader ignores both (the peer id is
    the hash of the key that must sign its record). Then Alice announces, and Mallory tries to
    overwrite her record (her subkey, his signature): everyone keeps Alice's."""
    run_in_fresh_process(tmp_path, forged_record_scenario)


async def forged_record_scenario(folder):
    """The scenario of the test above, in a process of its own (dht_harness.run_in_fresh_process)."""
    alice_dht, alice_validator = _dht_with_identity(folder, "alice")
    mallory_dht, mallory_validator = _dht_with_identity(
        folder, "mallory", [str(a) for a in alice_dht.get_visible_maddrs()]
    )
    validators = {alice_dht: alice_validator, mallory_dht: mallory_validator}
    alice = Membership(alice_dht, "run", ttl=60, interval=1, validator=alice_validator)
    honest = PeerRecord(
        peer_id=alice.peer_id, grpc_addr="10.0.0.1:7701", http_addr="http://10.0.0.1:7702", state="training"
    )
    forged = honest.model_copy(update={"grpc_addr": "6.6.6.6:7701"}).model_dump()
    expires = get_dht_time() + 120
    for subkey in (alice.peer_id.encode() + mallory_validator.local_public_key, alice.peer_id.encode()):
        await mallory_dht.store(alice.key, subkey=subkey, value=forged, expiration_time=expires, return_future=True)
    first_reader = Membership(mallory_dht, "run", ttl=60, interval=1, validator=mallory_validator)
    assert alice.peer_id not in await first_reader.members()  # the forged-first records count for nothing
    assert await alice.announce(honest)
    overwrite = await mallory_dht.store(
        alice.key, subkey=alice.subkey, value=forged, expiration_time=expires, return_future=True
    )
    assert not overwrite  # the signature cannot match Alice's key
    first_reader._read_at = -1.0
    assert (await first_reader.members())[alice.peer_id].grpc_addr == "10.0.0.1:7701"
    for dht, validator in validators.items():
        view = await Membership(dht, "run", 60, 1, validator=validator).members()
        assert view[alice.peer_id].grpc_addr == "10.0.0.1:7701"
    for dht in validators:
        dht.shutdown()


def test_unkeyed_records_are_invisible_to_a_keyed_swarm(tmp_path):
    run_in_fresh_process(tmp_path, unkeyed_records_scenario)


async def unkeyed_records_scenario(folder):
    """The scenario of the test above, in a process of its own (dht_harness.run_in_fresh_process)."""
    dht, validator = _dht_with_identity(folder, "node")
    keyed = Membership(dht, "run2", 60, 1, validator=validator, auth=SwarmAuth(KEY, str(dht.peer_id)))
    open_reader = Membership(dht, "run2", 60, 1, validator=validator)
    await open_reader.announce(PeerRecord(peer_id=str(dht.peer_id), state="training"))
    assert str(dht.peer_id) in await open_reader.members()
    assert await keyed.members() == {}
    await keyed.announce(PeerRecord(peer_id=str(dht.peer_id), state="training"))
    assert str(dht.peer_id) in await keyed.members()
    dht.shutdown()
