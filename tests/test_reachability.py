"""Can the swarm reach a node (daemon/swarm/reachability.py), and what a node behind NAT does.

The cross-region checklist of the README, on one host: two nodes on two loopback addresses,
each announcing its own with --announce-host and a DHT port picked at start (0), average
together and dial each other back; a node that announces an address nobody listens on is
reported unreachable; a --client-mode node trains in groups, runs the DHT as a client and
serves no joiner."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import pytest
from nodes import FAST, NodeProcess, dtnode_status, wait_until
from prometheus_client.parser import text_string_to_metric_families

from dtnode.daemon.config.settings import NodeSettings
from dtnode.daemon.swarm.reachability import announce_warning
from dtnode.peers.membership import PeerRecord


def test_an_address_other_hosts_cannot_dial_is_warned_about_unless_it_was_chosen():
    derived = NodeSettings()
    for host, kind in (("10.0.3.7", "private"), ("127.0.0.1", "loopback"), ("169.254.9.9", "link-local")):
        warning = announce_warning(derived, host)
        assert warning is not None and f"a {kind} address" in warning and "--announce-host" in warning
    assert announce_warning(derived, "8.8.4.4") is None  # public
    assert announce_warning(derived, "node1.example.org") is None  # a name, resolved by the peers
    assert announce_warning(NodeSettings(announce_host="10.0.3.7"), "10.0.3.7") is None  # chosen: a LAN swarm


def _keep(*nodes: NodeProcess) -> None:
    for node in nodes:
        node.stop()
    for node in nodes:
        try:
            node.wait(60)
        finally:
            node.kill()
            Path(str(node.state_dir) + ".log").write_text(node.output)


@pytest.mark.long_swarms
def test_two_nodes_on_two_addresses_announce_them_and_dial_each_other_back(tmp_path):
    a = NodeProcess.join("a", tmp_path, *FAST, "--announce-host", "127.0.0.2", host="127.0.0.2")
    b = None
    try:
        b = NodeProcess.join(
            "b", tmp_path, *FAST, "--announce-host", "127.0.0.3", "--peer", a.join_address, host="127.0.0.3"
        )
        wait_until(lambda: any(r["groups"] == [[2, 2]] for r in b.rounds), 180, "a round of a and b")
        records = {r["peer_id"]: r for r in b.get("/peers")}
        for node, host in ((a, "127.0.0.2"), (b, "127.0.0.3")):
            status = wait_until(lambda node=node: (s := node.status()) and s["reachability"] and s, 60, "dial-back")
            record = records[status["peer_id"]]
            assert record["grpc_addr"].startswith(host + ":") and record["http_addr"].startswith(f"http://{host}:")
            assert record["dht_addrs"] and all(f"/ip4/{host}/tcp/" in d for d in record["dht_addrs"]), record
            assert status["join_command"].startswith(f"dtnode join --peer /ip4/{host}/tcp/")
            found = status["reachability"]
            assert found["grpc_error"] is None and found["http_error"] is None, found
            assert found["checked_by"] != status["peer_id"]
            assert "announces" not in node.output  # the address was chosen: no warning
            shown = dtnode_status(node.http_url)
            assert "gRPC yes, HTTP yes" in shown.stdout, shown.stdout + shown.stderr  # `dtnode status` too
    finally:
        _keep(*(n for n in (a, b) if n is not None))
    for node in (a, b):
        assert "Traceback" not in node.output


@pytest.mark.long_swarms  # about 17 s: outside the default suite's 10 minutes, run by .ci/run
def test_a_node_that_cannot_be_dialled_back_is_reported_unreachable(tmp_path):
    a = NodeProcess.join("a", tmp_path, *FAST)
    c = None
    try:
        # listens on 127.0.0.1 but announces 127.0.0.9, where nothing listens: what a NAT does
        c = NodeProcess.join("c", tmp_path, *FAST, "--announce-host", "127.0.0.9", "--peer", a.join_address)
        local = c.http_url.replace("127.0.0.9", "127.0.0.1")  # its sidecar, where it really listens

        def local_status() -> dict | None:
            try:
                with urllib.request.urlopen(local + "/status", timeout=5) as resp:
                    return json.load(resp)
            except OSError:
                return None

        status = wait_until(lambda: (s := local_status()) and s["reachability"] and s, 120, "dial-back of c")
        found = status["reachability"]
        assert found["grpc_addr"].startswith("127.0.0.9:") and found["grpc_error"] == "unreachable", found
        assert found["http_error"] is not None
        c.wait_for_line(r"peers cannot reach this node; open those ports", 10)
        assert "announces 127.0.0.1, a loopback address" in a.output  # a derived its address: warned
    finally:  # no graceful stop: a's streams to c would wait out their deadlines first
        for node in (a, c):
            if node is not None:
                node.kill()
                Path(str(node.state_dir) + ".log").write_text(node.output)
    for node in (a, c):
        assert "Traceback" not in node.output


def _served(node: NodeProcess) -> float:
    with urllib.request.urlopen(node.http_url + "/metrics", timeout=5) as resp:
        families = text_string_to_metric_families(resp.read().decode())
        return sum(s.value for f in families for s in f.samples if s.name == "dtnode_checkpoint_served_bytes_total")


@pytest.mark.long_swarms
def test_a_client_mode_node_averages_and_is_never_a_donor(tmp_path):
    a = NodeProcess.join("a", tmp_path, *FAST)
    nat, late = None, None
    try:
        nat = NodeProcess.join("nat", tmp_path, *FAST, "--client-mode", "--peer", a.join_address)
        wait_until(lambda: any(r["groups"] == [[2, 2]] for r in nat.rounds), 180, "a round of nat with a")
        assert nat.status()["client_mode"] and nat.status()["reachability"] is None
        late = NodeProcess.join("late", tmp_path, *FAST, "--peer", a.join_address)
        wait_until(lambda: any(r["groups"] == [[3, 3]] for r in late.rounds), 180, "a round of three")
        assert _served(nat) == 0 and _served(a) > 0  # the joiner downloaded from a only
    finally:
        _keep(*(n for n in (a, nat, late) if n is not None))
    for node in (a, nat, late):
        assert "Traceback" not in node.output


def test_a_dial_back_follows_no_redirect_dials_once_per_id_at_a_rate_and_says_no_more_than_unreachable():
    """Issue 56, finding 11: /dialback was limited once a minute per peer id (ids are free),
    concurrent asks for one id each dialled, its HTTP dial followed redirects to any URL, and
    its answer carried the error text (a port scanner's oracle). Now asks for one id share one
    dial, all ids together get DIALS_PER_MINUTE, no redirect is followed (a redirect is an answer:
    the port is open), and a failed dial says "unreachable" and nothing else."""
    from aiohttp import web

    from dtnode.daemon.swarm import reachability
    from dtnode.daemon.swarm.reachability import DIALS_PER_MINUTE, DialBack, DialBusy

    async def main():
        followed = []
        app = web.Application()

        async def redirect(request):
            raise web.HTTPFound("http://127.0.0.1:9/elsewhere")

        async def elsewhere(request):
            followed.append(1)
            return web.Response(text="no")

        app.add_routes([web.get("/healthz", redirect), web.get("/elsewhere", elsewhere)])
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        records = {
            f"p{i}": PeerRecord(peer_id=f"p{i}", grpc_addr="127.0.0.1:9", http_addr=f"http://127.0.0.1:{port}")
            for i in range(DIALS_PER_MINUTE + 1)
        }
        dials = []
        original = reachability._dial_tcp

        async def counted(addr):
            dials.append(addr)
            await asyncio.sleep(0.2)
            return await original(addr)

        reachability._dial_tcp = counted

        async def members():
            return records

        try:
            server = DialBack("me", members)
            same = await asyncio.gather(*(server.dial("p0") for _ in range(5)))
            assert len(dials) == 1 and all(a == same[0] for a in same)  # five asks, one dial
            assert same[0].grpc_error == "unreachable" and same[0].http_error is None and not followed
            for i in range(1, DIALS_PER_MINUTE):
                await server.dial(f"p{i}")
            with pytest.raises(DialBusy):
                await server.dial(f"p{DIALS_PER_MINUTE}")
        finally:
            reachability._dial_tcp = original
            await runner.cleanup()

    asyncio.run(main())
