"""A closed swarm between real processes, and a flood that must not starve a node."""

import asyncio
import json
import os
import re
import subprocess
import sys

import grpc
import pytest
from dht_harness import ready_dht
from nodes import FAST, NodeProcess, dtnode_status, theta, wait_until

from dtnode.proto import averaging_pb2 as pb
from dtnode.proto import averaging_pb2_grpc as pb_grpc

KEY = {"DTNODE_SWARM_KEY": "a closed swarm's shared secret"}


@pytest.mark.long_swarms
def test_a_node_without_the_key_neither_joins_groups_nor_downloads_state(tmp_path, cleanup):
    a = NodeProcess.join("a", tmp_path, *FAST, "--min-peers", "2", env=KEY)
    cleanup.append(a)
    b = NodeProcess.join("b", tmp_path, *FAST, "--min-peers", "2", "--peer", a.join_address, env=KEY)
    cleanup.append(b)
    b.wait_for_round(lambda r: r["round"] >= 1 and r["groups"][0][0] == 2, timeout=90)
    intruder = NodeProcess.join("intruder", tmp_path, *FAST, "--peer", a.join_address, "--max-rounds", "3")
    cleanup.append(intruder)
    assert intruder.wait(90) == 0, intruder.output
    assert "this swarm is open" in intruder.output and "this swarm is open" not in a.output
    assert "offers no usable checkpoint" in intruder.output and "401" in intruder.output
    assert all(r["synced"] == [] for r in intruder.rounds), intruder.rounds  # it downloaded nothing
    assert [r["groups"][0][0] for r in intruder.rounds] == [1, 1, 1], intruder.output
    assert all(r["groups"][0][0] == 2 for r in a.rounds if r["round"] > 1), a.output
    # an operator without the key sees the node but not the closed swarm; with it, the peers
    env = {k: v for k, v in os.environ.items() if k != "DTNODE_SWARM_KEY"}
    table = dtnode_status(a.http_url, env=env)
    assert table.returncode == 0 and "swarm is closed" in table.stdout, table.stdout + table.stderr
    table = dtnode_status(a.http_url, "--json", env={**env, **KEY})
    assert table.returncode == 0 and len(json.loads(table.stdout)["peers"]) == 2, table.stdout
    for node in (a, b):
        node.stop()
        assert node.wait(30) == 0, node.output


@pytest.mark.long_swarms  # about 12 s: outside the default suite's 10 minutes, run by .ci/run
def test_a_flood_of_streams_and_requests_does_not_starve_training_or_status(tmp_path, cleanup):
    # plaintext, so that the flood reaches the stream limits (over TLS it ends at the handshake:
    # no record names the flooder's certificate)
    node = NodeProcess.join("target", tmp_path, *FAST, "--insecure-data-plane")
    cleanup.append(node)
    node.wait_for_round(lambda r: r["round"] >= 1, timeout=90)
    grpc_addr = node.get("/status")["grpc_addr"]
    rounds_before = node.get("/status")["outer_step"]

    async def flood() -> dict:
        codes: dict = {}

        async def one_stream(channel, i):
            msg = pb.PartChunk(
                run_id="dtnode-demo", round=10**6 + i, sender=f"flood{i}", weight=1.0, length=1, values=b"\0" * 1024
            )
            call = pb_grpc.AveragingStub(channel).Reduce(iter([msg]), timeout=20)
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as e:
                codes[e.code()] = codes.get(e.code(), 0) + 1

        async def one_request(session):
            try:
                async with session.get(node.http_url + "/peers") as resp:
                    await resp.read()
            except (TimeoutError, aiohttp.ClientError, OSError):  # a flooded node may drop some: it lives
                return

        import aiohttp

        async with grpc.aio.insecure_channel(grpc_addr) as channel, aiohttp.ClientSession() as session:
            await asyncio.gather(
                *(one_stream(channel, i) for i in range(300)), *(one_request(session) for _ in range(300))
            )
        return codes

    codes = asyncio.run(flood())
    assert sum(codes.values()) == 300, codes  # every bogus stream was refused
    # they name a round nobody is in: none is waited for (a reduction that never comes), each is
    # refused once its first chunk is read, or makes room for newer ones while it waits for it
    # (evicted: RESOURCE_EXHAUSTED, or UNAVAILABLE / INTERNAL where the reset beat the status). How
    # many get that far before an eviction is the host's timing: 48 to 170 of 300 on 2 cores
    # (7980f4a and after; bounds of 150, then 60, failed CI runs), so any one shows the refusal
    assert codes.get(grpc.StatusCode.DEADLINE_EXCEEDED, 0) == 0, codes
    assert set(codes) <= {
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
    }, codes
    assert codes.get(grpc.StatusCode.FAILED_PRECONDITION, 0) > 0, codes
    status = node.get("/status")  # still answering
    assert status["state"] in ("training", "averaging")
    # training went on through and after the flood (a hang guard, not a speed check)
    node.wait_for_round(lambda r: r["step"] >= rounds_before + 3, timeout=240)


@pytest.mark.long_swarms
def test_a_flood_of_made_up_registrants_joins_no_group(tmp_path, cleanup):
    """Anyone can write a registration under any id in an open swarm. A flooder writes 150
    made-up registrants (pointing at a dead port) into each group key of the next rounds; the
    two real nodes keep grouping with each other only: a made-up registrant has no signed
    membership record, so it is never admitted (else each would get a part and fail it)."""
    from hivemind.utils import get_dht_time

    from dtnode.peers.matchmaking import Registration

    a = NodeProcess.join("a", tmp_path, *FAST, "--min-peers", "2", "--inner-steps", "30")
    cleanup.append(a)
    b = NodeProcess.join("b", tmp_path, *FAST, "--min-peers", "2", "--inner-steps", "30", "--peer", a.join_address)
    cleanup.append(b)
    a.wait_for_round(lambda r: r["groups"] == [[2, 2]], timeout=90)
    key = wait_until(lambda: (a.get("/status")["last_round"] or {}).get("group_key"), 30, "a's last group")
    run, _, step, rest = key.split(".", 3)
    first = int(step) + 2
    flooder = ready_dht(initial_peers=[a.join_address], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        value = Registration(grpc_addr="127.0.0.1:9").model_dump()
        futures = [
            flooder.store(
                f"{run}.group.{r}.{rest}",
                subkey=f"Qmfake{r}x{i}",
                value=value,
                expiration_time=get_dht_time() + 300,
                return_future=True,
            )
            for r in range(first, first + 4)
            for i in range(150)
        ]
        for future in futures:
            future.result(timeout=60)
        for node in (a, b):
            node.wait_for_round(lambda r: r["round"] >= first + 3, timeout=120)
    finally:
        flooder.shutdown()
    for node in (a, b):
        flooded = [node.round(r) for r in range(first, first + 4)]
        # the group is the two real nodes; the registrants counted include the made-up ones read
        assert all(r is not None and r["groups"][0][0] == 2 for r in flooded), (flooded, node.output)
        assert "127.0.0.1:9" not in node.output, node.output  # no part was ever sent to a made-up member


def test_status_port_keeps_state_off_the_public_port(tmp_path, cleanup):
    """--status-port: the dashboard, /status, /history, /metrics and /peers answer on the
    operator's listener only; the public port serves peers (checkpoints, /healthz, /dialback)."""
    import asyncio as _asyncio
    import urllib.error
    import urllib.request

    import aiohttp
    import pytest

    from dtnode.peers.sidecar_address import SidecarAddressError, fetch_status

    # no --max-own-rounds: a solo node of tiny rounds may finish them before the requests below
    # (seen under CI: "Connection refused" on the status listener); it is stopped at the end
    node = NodeProcess.join("private", tmp_path, *FAST, "--status-port", "0")
    cleanup.append(node)
    node.wait_for_round(lambda r: r["round"] >= 0)
    status = node.get("/status")  # http_url: the status listener, from the start-up line
    assert node.http_url.startswith("http://127.0.0.1:") and status["http_url"] != node.http_url
    for path in ("/history", "/metrics", "/peers", "/"):
        urllib.request.urlopen(node.http_url + path, timeout=5).close()
    public = status["http_url"].replace("0.0.0.0", "127.0.0.1")
    urllib.request.urlopen(public + "/healthz", timeout=5).close()
    urllib.request.urlopen(public + "/checkpoint", timeout=5).close()
    for path in ("/status", "/history", "/metrics", "/peers", "/"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(public + path, timeout=5)
        assert refused.value.code == 404, path

    async def join_through_public() -> str:
        async with aiohttp.ClientSession() as session:
            try:
                await fetch_status(session, public, timeout=1.0)
            except SidecarAddressError as e:
                return str(e)
        return ""

    assert "give its multiaddr" in _asyncio.run(join_through_public())
    # `dtnode status` finds the status listener where the node's own settings say it is
    port = node.http_url.rsplit(":", 1)[1]
    for args, env in ((["--status-port", port], {}), ([], {"DTNODE_STATUS_PORT": port})):
        shown = subprocess.run(
            [sys.executable, "-m", "dtnode", "status", "--json", *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **env},
            check=False,
        )
        assert shown.returncode == 0 and json.loads(shown.stdout)["status"]["peer_id"] == status["peer_id"], shown
    # a node alone is alive but not in the swarm
    urllib.request.urlopen(public + "/healthz", timeout=5).close()
    with pytest.raises(urllib.error.HTTPError) as not_ready:
        urllib.request.urlopen(public + "/readyz", timeout=5)
    assert not_ready.value.code == 503 and json.load(not_ready.value)["ok"] is False
    node.stop()
    assert node.wait(60) == 0, node.output


@pytest.mark.long_swarms  # about 40 s
def test_a_record_with_a_huge_token_count_does_not_end_every_round(tmp_path, cleanup):
    """Issue 31, finding 10. A peer with a signed record claims 1e15 tokens in every round
    the swarm is in, and a batch of 2^40 tokens: before, the two honest nodes saw the round's
    target reached and ended each round after their first step; now the claim counts
    PACING_SPREAD x the median report at most, and the rounds keep most of their steps."""
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.p2p import P2P
    from hivemind.utils import get_dht_time

    from dtnode.peers.identity import identity_key
    from dtnode.peers.membership import Membership, PeerRecord

    a = NodeProcess.join("a", tmp_path, *FAST, "--min-peers", "2", "--inner-steps", "40")
    cleanup.append(a)
    b = NodeProcess.join("b", tmp_path, *FAST, "--min-peers", "2", "--inner-steps", "40", "--peer", a.join_address)
    cleanup.append(b)
    a.wait_for_round(lambda r: r["groups"] == [[2, 2]], timeout=90)
    key_path = tmp_path / "liar.key"
    P2P.generate_identity(str(key_path))
    validator = RSASignatureValidator(identity_key(key_path))
    liar_dht = ready_dht(
        initial_peers=[a.join_address],
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        identity_path=str(key_path),
        record_validators=[validator],
    )
    run_id = a.get("/status")["run_id"]
    lied_from = a.get("/status")["outer_step"] + 1

    async def lie(until_round: int) -> None:
        liar = Membership(liar_dht, run_id, ttl=10, interval=0.3, validator=validator)
        while (step := a.get("/status")["outer_step"]) < until_round:
            for current in (step, step + 1):  # the round in training, and the next (--overlap peers)
                await liar.announce(
                    PeerRecord(
                        peer_id=liar.peer_id,
                        state="training",
                        outer_step=current,
                        round=current,
                        phase="inner",
                        round_tokens=10**15,
                        tokens_per_step=1 << 40,
                        tokens_per_s=1e15,
                        progress_at=get_dht_time(),
                    )
                )
                await asyncio.sleep(0.15)

    try:
        asyncio.run(asyncio.wait_for(lie(lied_from + 3), timeout=240))
    finally:
        liar_dht.shutdown()
    for node in (a, b):
        node.wait_for_round(lambda r: r["round"] >= lied_from + 2, timeout=60)  # its history entry lands after a's
        lied = [node.round(r) for r in range(lied_from + 1, lied_from + 3)]
        assert all(r is not None for r in lied), node.output
        # a fair round is 40 steps each; the clamped liar may shorten it, never to 1 or 2 steps
        assert all(r["inner_steps"] >= 4 for r in lied), ([r["inner_steps"] for r in lied], node.output)


@pytest.mark.long_swarms  # about 40 s
def test_a_member_forcing_a_1e12_weight_resync_cannot_replace_theta(tmp_path, cleanup):
    """Issue 31, finding 4. A member (the project's build with the `hostile-resync` failpoint)
    asks every group for a θ_g re-sync and sends θ_g x1000 there with weight 1e12: before, the
    re-sync was a plain weighted mean and its θ_g became the group's. Now every member counts
    the same in a re-sync, so its stream is refused, and the honest nodes keep a finite θ_g of
    the norm training gives it, apart by less than training moved them (not bit-identical: the
    parts the attacker reduces fail once its own θ_g is NaN, and each keeps its own values there).

    The swarm runs the trimmed mean: the attacker's own θ_g, which keeps its x1000 values where
    the re-sync refused it, soon gives it a huge Δ too, and in the plain mean a huge Δ moves the
    mean (README, "Security"; seen here as an honest eval loss of 17 in round 3 when its θ_g
    stayed finite). The plain mean's re-sync bounds are tested on the data plane
    (test_bounded_influence.py)."""
    import torch

    common = [*FAST, "--min-peers", "3", "--max-rounds", "4", "--inner-steps", "10", "--aggregation", "trimmed-mean"]
    a = NodeProcess.join("a", tmp_path, *common)
    cleanup.append(a)
    b = NodeProcess.join("b", tmp_path, *common, "--peer", a.join_address)
    cleanup.append(b)
    attacker = NodeProcess.join(
        "attacker", tmp_path, *common, "--peer", a.join_address, env={"DTNODE_TEST_FAILPOINT": "hostile-resync@1"}
    )
    cleanup.append(attacker)
    for node in (a, b):
        assert node.wait(180) == 0, node.output
        assert "Traceback" not in node.output, node.output
    attacker.stop()
    # its own θ_g makes its loss or Δ non-finite: a known cause, logged as one line without a traceback
    attacker.wait(30)
    assert "Traceback" not in attacker.output, attacker.output
    # Round 1: the attacker was in the group, and each honest node refused its 1e12 θ_g stream to
    # the part it reduced. A sender whose contribution was refused let the group down, so each
    # benched it (peers/absentees.py): in round 2 neither waits for it nor counts it missing. (It may
    # still be in a round-2 group: a closed list it wrote first and that names them stands.)
    attacked = a.round(1)
    assert attacked is not None and attacked["groups"][0][0] == 3, a.rounds
    for node in (a, b):
        # (1 announced, or 2^-20 where the two honest nodes' θ_g hash outvoted its own: forming.outvoted)
        assert re.search(r"weight \S+ is above the \S+ its registration announced", node.output), node.output
        after = node.round(2)
        assert after is not None and len(after["benched"]) == 1, node.rounds
    last = max(r["step"] for r in a.rounds)
    first, final = theta(a.state_dir, 1), theta(a.state_dir, last)
    assert float(final.norm()) < 2 * float(first.norm()), (float(first.norm()), float(final.norm()))
    assert bool(torch.isfinite(final).all())
    # the honest θ_g agree up to what the attacker's own parts cost: once its θ_g is NaN, a part it
    # reduces fails and each honest node keeps its own values there, which no re-sync can mend
    # while the attacker poisons that part of it; less than their training moved them since step 1
    spread = float((final - theta(b.state_dir, last)).norm())
    assert spread < float((final - first).norm()), (spread, float((final - first).norm()))
