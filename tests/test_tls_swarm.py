"""The authenticated data plane between real node processes (TLS on, as by default).

One closed 3-node swarm serves the module. Node c listens on 127.0.0.3 and announces
127.0.0.2, where a proxy in this process forwards each of its ports: the gRPC one flips one
byte of the first stream that carries enough data, as an attacker on the path would. Node b
lies about its checkpoints (the `wrong-checkpoint` failpoint: files it writes hold a shifted
θ_g under a hash it announces as if right), so a joiner must take the others' file.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from allreduce_harness import stream_status
from cryptography.hazmat.primitives.asymmetric import rsa
from nodes import FAST, NodeProcess, theta
from path_tampering import forward
from prometheus_client.parser import text_string_to_metric_families

from dtnode.daemon.cli.main import EXIT_MISMATCH
from dtnode.peers.auth import GRPC_METADATA, SwarmAuth, load_swarm_key, stream_subject
from dtnode.peers.identity import identity_key
from dtnode.peers.tls import TLS_NAME, NodeIdentity, pem
from dtnode.proto import averaging_pb2 as pb
from dtnode.proto import averaging_pb2_grpc as pb_grpc

SECRET = "a closed swarm's shared secret, for TLS tests"
KEY = {"DTNODE_SWARM_KEY": SECRET}
RUN = ["--run-id", "tls-test"]
FLIP_AFTER = 12_000  # bytes of one connection: past the TLS and HTTP/2 handshakes, inside Δ's first chunks


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class PathProxy:
    """Forwards 127.0.0.2:port to 127.0.0.3:port for each port; flips one byte on `flip_port`."""

    def __init__(self, ports: list[int], flip_port: int):
        self.ports, self.flip_port, self.flipped = ports, flip_port, threading.Event()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> None:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self.loop).result(10)

    async def _listen(self) -> None:
        self.servers = [
            await asyncio.start_server(lambda r, w, p=port: self._forward(r, w, p), "127.0.0.2", port)
            for port in self.ports
        ]

    async def _forward(self, reader, writer, port: int) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.3", port)
        except OSError:
            writer.close()
            return

        await asyncio.gather(
            forward(reader, up_writer, FLIP_AFTER if port == self.flip_port else None, self.flipped),
            forward(up_reader, writer),
        )

    def stop(self) -> None:
        async def close() -> None:
            for server in getattr(self, "servers", []):
                server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls")
    ports = {flag: _free_port("127.0.0.3") for flag in ("--dht-port", "--grpc-port", "--http-port")}
    proxy = PathProxy(list(ports.values()), ports["--grpc-port"])
    proxy.start()
    nodes: list[NodeProcess] = []
    try:
        a = NodeProcess.join("a", tmp, *FAST, *RUN, "--min-peers", "3", env=KEY)
        nodes.append(a)
        b = NodeProcess.join(
            "b",
            tmp,
            *FAST,
            *RUN,
            "--min-peers",
            "3",
            "--peer",
            a.join_address,
            env={**KEY, "DTNODE_TEST_FAILPOINT": "wrong-checkpoint@1"},
        )
        nodes.append(b)
        c = NodeProcess.join(
            "c",
            tmp,
            *FAST,
            *RUN,
            "--min-peers",
            "3",
            "--peer",
            a.join_address,
            *[v for flag, port in ports.items() for v in (flag, str(port))],
            "--host",
            "127.0.0.3",
            "--announce-host",
            "127.0.0.2",
            env=KEY,
        )
        nodes.append(c)
        for node in nodes:
            node.wait_for_round(lambda r: r["round"] >= 3, timeout=150)
        yield a, b, c, proxy
    finally:
        for node in nodes:
            node.stop()
        for node in nodes:
            try:
                node.wait(60)
            finally:
                node.kill()
                Path(str(node.state_dir) + ".log").write_text(node.output)
        proxy.stop()


def _metric(node: NodeProcess, name: str, **labels: str) -> float:
    with urllib.request.urlopen(node.http_url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_a_byte_flipped_on_the_path_breaks_one_stream_and_no_round_loses_a_peer(swarm):
    a, b, c, proxy = swarm
    assert proxy.flipped.wait(30), "no stream to c carried enough bytes to flip"
    c_id = c.get("/status")["peer_id"]
    broken = [
        (n, m)
        for n in (a, b)
        for m in re.finditer(
            rf"round (\d+) hop \d+: stream of part \d+ to reducer "
            rf"{c_id} broke \((\w+)",
            n.output,
        )
    ]
    assert broken, "the altered stream was not refused:\n" + a.output + "\n" + b.output
    node, m = broken[0]
    round_no, code = int(m.group(1)), m.group(2)
    assert code in ("INTERNAL", "UNAVAILABLE"), m.group(0)
    assert _metric(node, "dtnode_stream_retries_total", reason=code.lower()) >= 1
    # sent again on a new connection: that round, and every one after it, averaged by all three
    for n in (a, b, c):
        assert all(r["groups"][0][0] == 3 for r in n.rounds if r["round"] >= round_no), n.output
        assert "Traceback" not in n.output, n.output


def _stream(target: str, identity: NodeIdentity, server_cert: bytes, sender: str, auth: SwarmAuth) -> grpc.StatusCode:
    """One Reduce stream to `target` over TLS as `identity`, claiming `sender`; the status it ends with."""

    async def main() -> grpc.StatusCode:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=server_cert, private_key=identity.key_pem, certificate_chain=identity.cert_pem
        )
        async with grpc.aio.secure_channel(
            target, credentials, options=[("grpc.ssl_target_name_override", TLS_NAME)]
        ) as channel:
            group = b"\x01" * 32
            chunk = pb.PartChunk(
                run_id="tls-test",
                round=10**6,
                hop=0,
                group_id=group,
                part=0,
                sender=sender,
                weight=1.0,
                length=1,
                values=b"\0" * 4,
            )
            tag = auth.issue("grpc", stream_subject("tls-test", 10**6, 0, group, 0))
            return await stream_status(
                pb_grpc.AveragingStub(channel).Reduce(iter([chunk]), timeout=20, metadata=((GRPC_METADATA, tag),))
            )

    return asyncio.run(main())


def test_a_key_holder_cannot_speak_as_another_peer_nor_connect_with_another_certificate(swarm):
    a, b, c, _ = swarm
    status = a.get("/status")
    target, a_cert = status["grpc_addr"], (a.state_dir / "tls.crt").read_bytes()
    c_id, b_id = c.get("/status")["peer_id"], b.get("/status")["peer_id"]
    key = load_swarm_key(None, KEY)
    # b's own key and certificate (a member's), and a valid swarm-key tag for c's id: refused
    b_identity = NodeIdentity.from_key(identity_key(b.state_dir / "identity.key")._private_key, b_id)
    assert pem(b_identity.cert_der) == (b.state_dir / "tls.crt").read_bytes()
    assert _stream(target, b_identity, a_cert, c_id, SwarmAuth(key, c_id)) == grpc.StatusCode.PERMISSION_DENIED
    # the same stream as b itself passes the certificate check (and finds no such round)
    assert _stream(target, b_identity, a_cert, b_id, SwarmAuth(key, b_id)) == grpc.StatusCode.FAILED_PRECONDITION
    # a certificate no member announces: the handshake fails
    stranger = NodeIdentity.from_key(rsa.generate_private_key(65537, 2048), b_id)
    assert _stream(target, stranger, a_cert, b_id, SwarmAuth(key, b_id)) == grpc.StatusCode.UNAVAILABLE
    # a server that is not the pinned peer: a's address, but c's certificate expected
    c_cert = (c.state_dir / "tls.crt").read_bytes()
    assert _stream(target, b_identity, c_cert, b_id, SwarmAuth(key, b_id)) == grpc.StatusCode.UNAVAILABLE
    assert "refused a stream claiming peer " + c_id in a.output


@pytest.mark.long_swarms  # about 18 s: outside the default suite's 10 minutes, run by .ci/run
def test_a_joiner_skips_a_donor_whose_checkpoint_the_others_contradict(swarm, tmp_path):
    a, b, _, _ = swarm
    joiner = NodeProcess.join("j", tmp_path, *FAST, *RUN, "--peer", a.join_address, "--max-own-rounds", "1", env=KEY)
    try:
        assert joiner.wait(120) == 0, joiner.output
    finally:
        joiner.kill()
        Path(str(joiner.state_dir) + ".log").write_text(joiner.output)
    b_id = b.get("/status")["peer_id"]
    downloads = [x for r in joiner.rounds for x in r["synced"] if x["source"] == "downloaded"]
    # each download's history names the donors its fetch passed over: b, as contradicted by the
    # others, or (when its record had not announced the lying step yet) as serving a file no signed
    # record vouches for, or one its step's other files outnumber while records come in
    passed_over = [(p["why"], p["peers"]) for x in downloads for p in x["passed_over"]]
    assert any(why in ("contradicted", "unannounced", "not_yet") and b_id in peers for why, peers in passed_over), (
        passed_over,
        joiner.output,
    )
    # b, which serves a wrong file of every step, is never counted among the donors of a download;
    # the two honest ones offered one of them together (a joiner that arrives as the swarm closes
    # a round downloads twice, the first time from the one donor whose record announced the step)
    offered = [x["offered_by"] for x in downloads]
    assert offered and max(offered) == 2 and all(o <= 2 for o in offered), joiner.rounds
    step = downloads[0]["step"]
    assert torch.equal(theta(joiner.state_dir, step), theta(a.state_dir, step))
    assert not torch.equal(theta(b.state_dir, step), theta(a.state_dir, step))  # b's file lies
    assert "Traceback" not in joiner.output


@pytest.mark.long_swarms  # about 13 s: outside the default suite's 10 minutes, run by .ci/run
def test_a_plaintext_node_is_refused_by_a_tls_swarm_with_the_fix_named(swarm, tmp_path):
    a, _, _, _ = swarm
    plain = NodeProcess.join("plain", tmp_path, *FAST, *RUN, "--peer", a.join_address, "--insecure-data-plane", env=KEY)
    try:
        code = plain.wait(60)
    finally:
        plain.kill()
    assert code == EXIT_MISMATCH, plain.output
    assert "--insecure-data-plane: pseudo-gradients travel in plaintext" in plain.output
    assert re.search(
        r"error: \d+ peers \(\S+, \.\.\.\) of this swarm average over a TLS data plane and this node "
        r"over plaintext: .*drop --insecure-data-plane",
        plain.output,
    ), plain.output
    assert "Traceback" not in plain.output
