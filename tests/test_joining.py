"""Joining and rejoining: where a joiner enters the swarm, and how a restarted node finds it.

The first tests are pure (records in, a decision out); the last start real node processes
on loopback: a joiner arriving while the donors are in their outer phase, and the swarm's
first node killed and restarted with `--peer` naming its own old address.
"""

import json
import re
import signal
import time

import pytest
from nodes import FAST, NodeProcess, step_floor, wait_until

from dtnode.daemon.catchup.swarm_position import open_round, swarm_position
from dtnode.daemon.checkpoints.file_format import checkpoint_path
from dtnode.peers.known_peers import KnownPeers, peer_of
from dtnode.peers.membership import PeerRecord

MODEL = "m"


def _peer(name: str, outer_step: int, round_: int, phase: str, start: int | None = None, **extra) -> PeerRecord:
    return PeerRecord(
        peer_id=name,
        state="averaging" if phase in ("averaging", "outer") else "training",
        outer_step=outer_step,
        round=round_,
        phase=phase,
        round_checkpoint=round_ if start is None else start,
        model_hash=MODEL,
        **extra,
    )


def test_a_round_being_averaged_or_applied_is_closed_to_a_joiner():
    assert open_round(_peer("a", 4, 4, "inner")) == 4
    assert open_round(_peer("a", 4, 4, "matchmaking")) == 4  # its first group still forms: it waits for us
    assert open_round(_peer("a", 4, 4, "averaging")) == 5
    assert open_round(_peer("a", 5, 4, "outer")) == 5  # applied: θ_g of step 5 opens round 5
    assert open_round(PeerRecord(peer_id="old", outer_step=7, state="training")) == 7  # a record without phase


def test_the_joiner_waits_while_the_swarm_applies_and_downloads_the_step_that_opens_the_round():
    averaging = [_peer("a", 4, 4, "averaging"), _peer("b", 4, 4, "averaging")]
    position = swarm_position(averaging, "me", MODEL)
    assert (position.round, position.start_step, position.ready) == (5, 5, False)  # nobody holds θ_g(5) yet
    applying = [_peer("a", 5, 4, "outer"), _peer("b", 4, 4, "averaging")]
    position = swarm_position(applying, "me", MODEL)
    assert (position.round, position.start_step, position.ready) == (5, 5, True)
    training = [_peer("a", 5, 5, "inner"), _peer("b", 5, 5, "inner"), _peer("me", 0, 0, "inner")]
    position = swarm_position(training, "me", MODEL)
    assert (position.round, position.start_step, position.ready, position.peers) == (5, 5, True, 2)
    # --overlap peers train round r from θ_g of step r-1 (their outer step comes a round late)
    overlapped = [_peer("a", 4, 5, "inner", start=4), _peer("b", 4, 5, "inner", start=4)]
    assert swarm_position(overlapped, "me", MODEL).start_step == 4
    # a runaway minority and peers of another model move nothing
    mixed = [
        _peer("a", 5, 5, "inner"),
        _peer("b", 5, 5, "inner"),
        _peer("c", 21, 21, "inner"),
        PeerRecord(peer_id="x", outer_step=90, state="training", model_hash="other"),
    ]
    assert swarm_position(mixed, "me", MODEL).round == 5
    assert swarm_position([_peer("me", 3, 3, "inner")], "me", MODEL) is None


def _addr(peer_id: str, port: int = 7000) -> str:
    return f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer_id}"


def test_known_peers_are_bounded_aged_checked_and_never_include_this_node(tmp_path):
    path = tmp_path / "known-peers.json"
    known = KnownPeers(path, max_peers=3, max_age_s=100)
    records = [PeerRecord(peer_id=f"P{i}", dht_addrs=(_addr(f"P{i}", 7000 + i),)) for i in range(5)]
    records.append(PeerRecord(peer_id="liar", dht_addrs=(_addr("P0"), "not a multiaddr")))  # vouches for another
    records.append(PeerRecord(peer_id="me", dht_addrs=(_addr("me"),)))
    base = time.time() - 10
    for i, record in enumerate(records):
        known.remember([record], own_id="me", now=base + i)
    known.save()
    again = KnownPeers(path, max_peers=3, max_age_s=100).load()
    assert set(again.peers) == {"P2", "P3", "P4"}  # the 3 seen last; the liar and this node not at all
    assert again.addresses(exclude="P4") == [_addr("P3", 7003), _addr("P2", 7002)]
    assert peer_of(_addr("P3")) == "P3" and peer_of("/ip4/1.2.3.4/tcp/1") is None
    edited = json.loads(path.read_text())
    edited["peers"]["P2"]["seen"] = time.time() - 1000  # seen too long ago
    edited["peers"]["bad"] = {"addrs": [_addr("other")], "seen": time.time()}  # an address of someone else
    path.write_text(json.dumps(edited))
    assert set(KnownPeers(path, max_age_s=100).load().peers) == {"P3", "P4"}
    path.write_text("{not json")
    assert KnownPeers(path).load().peers == {}  # a torn file is ignored, never fatal


@pytest.mark.long_swarms  # about 35 s each: outside the default suite's 10 minutes, run by .ci/run
def test_a_joiner_arriving_in_the_outer_phase_starts_with_the_next_round_not_a_closed_one(tmp_path, cleanup):
    """Both donors hold their outer phase of round 2 for 8 s (a pausing failpoint, as a long
    eval or checkpoint write would); a joiner started then takes θ_g of step 3 and trains
    round 3 with them: its first round is averaged with both, and it never trains alone.
    Rounds are long enough (H=300 of the tiny model) that the joiner cannot finish one alone
    before the donors come back, as on any real model. The donors write no checkpoint files
    (a cadence of 1000): step 3 is served from their memory, byte for byte (on a GPU, where θ_g
    lives on the device, a donor writes the file on demand instead)."""
    args = [*FAST, "--inner-steps", "300", "--min-peers", "2", "--join-timeout", "90", "--checkpoint-every", "1000"]
    paced = step_floor(0.05)  # rounds of at least 15 s, a GPU host's too
    pause = {"DTNODE_TEST_FAILPOINT": "outer-phase@2:8", **paced}
    a = NodeProcess.join("a", tmp_path, *args, env=pause)
    cleanup.append(a)
    b = NodeProcess.join("b", tmp_path, *args, "--peer", a.join_address, env=pause)
    cleanup.append(b)
    a.wait_for_line(r"failpoint outer-phase@2 reached", timeout=120)
    c = NodeProcess.join("c", tmp_path, *args, "--peer", a.join_address, "--max-own-rounds", "2", env=paced)
    cleanup.append(c)
    assert c.wait(120) == 0, c.output
    rounds = [(r["round"], *r["groups"][0]) for r in c.rounds]
    # in sync at step 3: its first round is the one the swarm opened next, with both donors
    assert rounds[0] == (3, 3, 3), c.output
    assert all(g > 1 for _, g, _ in rounds), c.output  # no round alone
    # one download, of step 3, offered by both donors (the sha256 each announced: the same bytes)
    (download,) = [a for r in c.rounds for a in r["synced"]]
    assert (download["source"], download["step"], download["offered_by"]) == ("downloaded", 3, 2), c.rounds
    assert a.wait_for_round(lambda r: r["round"] == 3)["groups"][0] == [3, 3], a.output
    # from memory: neither wrote a file of step 3 (a GPU donor would, on demand), and what they
    # served is the file (the tiny model's is one range: one donor sends it)
    served = [donor.metric("dtnode_checkpoint_served_bytes_total") for donor in (a, b)]
    assert download["served_by"] >= 1 and sum(served) >= download["bytes"], (download, served)
    assert not any(checkpoint_path(donor.state_dir, 3).exists() for donor in (a, b))
    for node in (a, b, c):
        assert "Traceback" not in node.output, node.output


@pytest.mark.long_swarms  # about 35 s each: outside the default suite's 10 minutes, run by .ci/run
def test_a_joiner_whose_round_closes_during_its_first_step_takes_the_next_round(tmp_path, cleanup):
    """A joiner enters the swarm's open round, but its first step is slow (a cold start, here
    40 s: longer than a round of the donors, who train the joiner's share of its tokens too, and
    its door, on a slow 2-core host; 14 s was not) and the donors average that round without it
    (they hold their door open 10 s at most).
    It must not average that round alone: it takes θ_g of the next round and trains that one
    with the donors."""
    # rounds of a few seconds (H=200), long enough for records to show where the swarm is
    args = [*FAST, "--inner-steps", "200", "--min-peers", "2", "--join-timeout", "90"]
    a = NodeProcess.join("a", tmp_path, *args)
    cleanup.append(a)
    b = NodeProcess.join("b", tmp_path, *args, "--peer", a.join_address)
    cleanup.append(b)
    a.wait_for_round(lambda r: r["round"] >= 1 and r["groups"][0] == [2, 2], timeout=120)
    c = NodeProcess.join(
        "c",
        tmp_path,
        *args,
        "--peer",
        a.join_address,
        env={"DTNODE_TEST_FIRST_STEP_DELAY": "40"},
    )
    cleanup.append(c)
    c.wait_for_round(timeout=120)
    # the dropped round's steps are counted for the operator, its tokens are not
    metrics = c.get_text("/metrics")
    c.stop()
    assert c.wait(60) == 0, c.output
    # its first round's history says how it got there: the join's download, then the one that
    # replaced the round its peers closed under it (the round and the steps it dropped)
    joined, *reentries = c.rounds[0]["synced"]
    assert joined["source"] == "downloaded" and "dropped_round" not in joined, c.rounds[0]
    assert reentries and all(r["source"] == "downloaded" for r in reentries), c.rounds[0]
    entered = joined["step"]  # a download of step N: the node enters round N
    assert reentries[0]["dropped_round"] == entered and reentries[0]["step"] > entered, c.rounds[0]
    steps = sum(r["dropped_steps"] for r in reentries)
    dropped = [line for line in metrics.splitlines() if line.startswith("dtnode_dropped_inner_steps_total")]
    assert steps >= 1 and dropped == [f"dtnode_dropped_inner_steps_total {float(steps)}"], (dropped, c.rounds[0])
    rounds = [(r["round"], *r["groups"][0]) for r in c.rounds]
    assert rounds and rounds[0][0] > entered and rounds[0][1:] == (3, 3), c.output  # with both donors
    for node in (a, b, c):
        assert "Traceback" not in node.output, node.output


@pytest.mark.long_swarms  # about 25 s: outside the default suite's 10 minutes, run by .ci/run
def test_the_first_node_restarted_with_its_own_old_address_as_peer_finds_the_swarm(tmp_path, cleanup):
    """kill -9 of the node everyone joined through; it restarts on its state dir with
    --peer naming itself (as a script that started it that way would): it keeps its DHT
    port, bootstraps from the peers it knew, and is back in a full group within two rounds."""
    args = [*FAST, "--min-peers", "3", "--join-timeout", "60"]
    paced = step_floor(0.15)  # rounds of at least 2.25 s, a GPU host's too: a restart spans a few
    first = NodeProcess.join("first", tmp_path, *args, env=paced)
    cleanup.append(first)
    own_address = first.join_address
    others = [NodeProcess.join(name, tmp_path, *args, "--peer", own_address, env=paced) for name in ("b", "c")]
    cleanup.extend(others)
    first.wait_for_round(lambda r: r["round"] >= 1 and r["groups"][0] == [3, 3], timeout=120)
    known = first.state_dir / "known-peers.json"
    # the peers' addresses are saved every few seconds
    wait_until(lambda: known.exists() and len(json.loads(known.read_text())["peers"]) == 2, 120, "saved peers")
    first.stop(signal.SIGKILL)
    first.wait(10)
    last = others[0].rounds[-1]["round"]
    before = len(first.rounds)  # the restarted node appends to the same history
    again = NodeProcess.join("first", tmp_path, *args, "--peer", own_address, env=paced)
    cleanup.append(again)
    assert again.join_address == own_address  # the same port and identity: others' --peer still reach it
    again.wait_for_line(r"is this node's own address: joining through the peers it knew", timeout=30)
    back = again.wait_for_round(lambda r: r["groups"][0] == [3, 3], timeout=180, after=before)
    first_round = again.rounds[before]["round"]
    assert back["round"] <= first_round + 1, again.output  # a full group within two rounds
    assert back["round"] <= last + 4, again.output
    for node in [again, *others]:
        assert "Traceback" not in node.output, node.output


DEAD = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWHtocysUnWZKdxsM8xACZXMk7LHDHgwug2T9DkWuWw9kA"  # nobody listens
GONE = "/ip4/127.0.0.1/tcp/2/p2p/12D3KooWGo1eDuKfRycwGfHdy2NS5KinGm3pDx5GSBa1bU7fVnGz"


@pytest.mark.long_swarms  # about 30 s: outside the default suite's 10 minutes, run by .ci/run
def test_a_joiner_started_before_its_peer_listens_keeps_dialling_until_it_does(tmp_path, cleanup):
    """`dtnode join --peer A` while A is down (a compose file starting both at once, A
    restarting): one failed dial used to end the joiner with exit 3 at once (CI saw it when a
    busy host answered a first dial too late). It dials again until --join-timeout, and joins
    A's swarm once A is back at the address it had."""
    args = [*FAST, "--min-peers", "2", "--max-rounds", "1"]  # --join-timeout 120 (NodeProcess.join)
    first = NodeProcess.join("a", tmp_path, *args)
    address = first.join_address
    first.stop()
    assert first.wait(60) == 0, first.output
    joiner = NodeProcess.join("b", tmp_path, *args, "--peer", address)
    cleanup.append(joiner)
    joiner.wait_for_line(r"could not reach \S+ yet .*failed to connect to bootstrap peers\); trying again", 60)
    again = NodeProcess.join("a", tmp_path, *args)  # its state dir keeps its peer id and DHT port
    cleanup.append(again)
    assert again.join_address == address
    for node in (joiner, again):
        assert node.wait(120) == 0, node.output
        assert "Traceback" not in node.output, node.output
    assert joiner.round(0)["groups"][0][0] == 2, joiner.rounds


@pytest.mark.long_swarms  # about 40 s: outside the default suite's 10 minutes, run by .ci/run
def test_a_joiner_whose_peer_connects_but_does_not_answer_keeps_dialling(tmp_path, cleanup):
    """A peer's p2pd may take the connection while the DHT behind it is too busy to answer the
    ping (the first node of a 32-node swarm on one box): hivemind then says "none of the
    initial_peers responded to a ping", and the joiner ended with an error at once, 15 minutes of
    its --join-timeout left. It dials again until the DHT answers, and joins."""
    import psutil

    args = [*FAST, "--min-peers", "2", "--max-rounds", "1"]  # --join-timeout 120 (NodeProcess.join)
    first = NodeProcess.join("a", tmp_path, *args)
    cleanup.append(first)
    address = first.join_address
    node = psutil.Process(first.proc.pid)
    p2pd = [p for p in node.children() if p.name() == "p2pd"]
    assert len(p2pd) == 1, [p.cmdline() for p in node.children()]
    node.suspend()  # the DHT runs on the node's loop; its p2pd, a process of its own, still takes connections
    try:
        joiner = NodeProcess.join("b", tmp_path, *args, "--peer", address)
        cleanup.append(joiner)
        time.sleep(20)  # several pings unanswered
        assert joiner.proc.poll() is None, joiner.output  # still dialling, not given up
    finally:
        node.resume()
    for each in (first, joiner):
        assert each.wait(120) == 0, each.output
        assert "Traceback" not in each.output, each.output
    assert joiner.round(0)["groups"][0][0] == 2, joiner.rounds


def test_the_dht_starts_while_other_threads_start_processes():
    """A 2-rank node hung at its start (1 in 12 here, once in CI) when hivemind's DHT was a
    forked child that never exec'd: forked while the training thread's Popen started a rank, it
    kept that Popen's pipes open, and Popen waited for ever. The DHT now runs on the node's own
    loop (peers/dht_in_process.py) and forks nothing but p2pd, which execs: threads starting
    processes without a pause go on while DHTs start and stop beside them."""
    import asyncio
    import subprocess
    import threading

    from dtnode.peers.dht_start import start_dht
    from dtnode.peers.forks import popen

    stop = threading.Event()
    started: list[int] = []

    def start_processes() -> None:
        while not stop.is_set():
            child = popen(["true"], stdout=subprocess.PIPE)
            child.communicate()
            started.append(child.returncode)

    async def start_dhts() -> None:
        for _ in range(4):
            dht = await start_dht([], "127.0.0.1", 0, None, timeout=30)
            try:
                count = len(started)
                await asyncio.to_thread(wait_until, lambda n=count: len(started) > n + 5, 10, "processes started")
            finally:
                await dht.shutdown()

    spawners = [threading.Thread(target=start_processes, daemon=True) for _ in range(3)]
    for spawner in spawners:
        spawner.start()
    try:
        asyncio.run(start_dhts())
    finally:
        stop.set()
        for spawner in spawners:
            spawner.join(30)
    assert not any(s.is_alive() for s in spawners) and set(started) == {0}


def _remembering(state_dir, addr: str) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "known-peers.json").write_text(
        json.dumps({"peers": {addr.rsplit("/", 1)[1]: {"addrs": [addr], "seen": time.time()}}})
    )


def test_a_node_whose_peer_and_known_peers_are_all_gone_says_which_it_tried(tmp_path):
    import subprocess
    import sys

    _remembering(tmp_path / "n", GONE)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dtnode",
            "join",
            "--peer",
            DEAD,
            "--host",
            "127.0.0.1",
            "--dht-port",
            "0",
            "--grpc-port",
            "0",
            "--http-port",
            "0",
            "--state-dir",
            str(tmp_path / "n"),
            "--join-timeout",
            "4",  # --peer is dialled until then
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 3, result.stderr
    assert DEAD in result.stderr and GONE in result.stderr and "1 peer(s) it knew" in result.stderr, result.stderr


def test_the_first_node_whose_known_peers_are_gone_starts_alone(tmp_path, cleanup):
    _remembering(tmp_path / "first", GONE)
    node = NodeProcess.join("first", tmp_path, *FAST, "--max-rounds", "1")
    cleanup.append(node)
    assert node.wait(60) == 0, node.output
    assert re.search(r"none of the 1 peer\(s\) it knew \(\S+\) answered", node.output) and GONE in node.output, (
        node.output
    )
    assert [r["groups"] for r in node.rounds] == [[[1, 1]]], node.rounds


def test_a_sidecar_address_is_asked_again_until_its_node_listens():
    """`--peer http://HOST:PORT` of a node that starts a moment later (compose, a StatefulSet):
    the first asks fail, a later one gets its multiaddrs; garbage in its answer is dropped."""
    import asyncio
    import socket

    from aiohttp import web

    from dtnode.peers import sidecar_address
    from dtnode.peers.sidecar_address import SidecarAddressError, resolve_peers

    good = "/ip4/127.0.0.1/tcp/7700/p2p/QmQRUdNjhvgreSjaK29cZzbpN4uZbLwShCFzQvGncCmjDx"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def status(request: web.Request) -> web.Response:
        return web.json_response({"dht_addrs": [good, "not a multiaddr", 7, good[:-3]]})

    async def main() -> list[str]:
        app = web.Application()
        app.add_routes([web.get("/status", status)])
        runner = web.AppRunner(app)
        await runner.setup()

        async def start_late() -> None:
            await asyncio.sleep(0.3)  # after the first ask has failed
            await web.TCPSite(runner, "127.0.0.1", port).start()

        starting = asyncio.ensure_future(start_late())
        try:
            return await resolve_peers([f"http://127.0.0.1:{port}"], timeout=20)
        finally:
            await starting
            await runner.cleanup()

    sidecar_address.RETRY_S = 0.2
    try:
        assert asyncio.run(main()) == [good]
        with pytest.raises(SidecarAddressError, match="not reachable"):
            asyncio.run(resolve_peers([f"http://127.0.0.1:{port}"], timeout=0.5))  # nobody there any more
    finally:
        sidecar_address.RETRY_S = 2.0
