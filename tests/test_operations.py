"""What an operator sees: metrics, history, the dashboard, JSON logs, clear errors at start.

One 2-node swarm serves every test of the module (real processes on loopback): node a starts
it, node b joins through a's sidecar address (no peer id) after a's first round, so b
downloads a's state and a serves it. The browser test drives a real headless Chromium.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from nodes import FAST, NodeProcess, typed_at_a_terminal, wait_until
from prometheus_client.parser import text_string_to_metric_families

from dtnode.daemon.catchup.joiner import MAX_REENTRIES
from dtnode.daemon.checkpoints.arrivals import Skip

ROUNDS_TOGETHER = 2


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("operations")
    a = NodeProcess.join("a", tmp, *FAST, "--run-id", "ops-test")
    b = None
    try:
        a.wait_for_round(timeout=120)
        b = NodeProcess.join("b", tmp, *FAST, "--run-id", "ops-test", "--peer", a.http_url, "--log-format", "json")

        # rounds averaged together, `full` (whole groups of two, no part cut at its deadline) in
        # each node's own history: b can record a round while a is still in its outer step, and
        # on a loaded host one node's part may miss its deadline, so b's rounds are not a's
        def together(node: NodeProcess) -> int:
            return sum(r["groups"] == [[2, 2]] and r["outcome"] == "full" for r in node.rounds)

        for node, timeout in ((b, 240), (a, 120)):
            wait_until(
                lambda node=node: together(node) >= ROUNDS_TOGETHER,
                timeout,
                f"rounds of two in {node.name}'s history",
            )
        yield a, b
    finally:
        for node in (a, b):
            if node is not None:
                node.stop()
        for node in (a, b):
            if node is not None:
                try:
                    node.wait(60)
                finally:
                    node.kill()
                    Path(str(node.state_dir) + ".log").write_text(node.output)


def _families(node: NodeProcess) -> dict[str, dict[tuple, float]]:
    with urllib.request.urlopen(node.http_url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):  # prometheus-client's own parser
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def _value(families, name: str, **labels) -> float:
    return families[name][tuple(sorted(labels.items()))]


def _settled(node: NodeProcess) -> tuple[dict, list[dict]] | None:
    """The node's metrics with its history, read while no round ended in between (the swarm runs
    on: read the history, the metrics, the history again, and keep the pair when both agree)."""
    before = node.get("/history")["rounds"]
    families = _families(node)
    after = node.get("/history")["rounds"]
    if before != after or not after or _value(families, "dtnode_outer_step") != after[-1]["step"]:
        return None
    if sum(families["dtnode_rounds_total"].values()) != len(after):  # a round counted, its entry not yet in
        return None
    return families, after


def test_metrics_an_alert_can_use(swarm):
    """The metrics of a scripted run, value for value: every round a node's history records
    is counted once, by outcome, with its tokens, bytes and phases; FAST's steps are 8 x 32
    tokens; b joined from a, whose served bytes are the bytes b downloaded."""
    a, b = swarm
    # the peer gauges are refreshed every few heartbeats (REMEMBER_PEERS_EVERY_S)
    wait_until(lambda: all(_value(_families(n), "dtnode_peers_live") == 2 for n in (a, b)), 60, "peer gauges")
    for node in (a, b):
        f, rounds = wait_until(lambda node=node: _settled(node), 120, f"settled metrics of {node.name}")
        outcomes = [r["outcome"] for r in rounds]
        for outcome in ("full", "partial", "alone", "failed"):  # present at zero too, for rate()
            assert _value(f, "dtnode_rounds_total", outcome=outcome) == outcomes.count(outcome), (outcome, rounds)
        assert outcomes.count("full") >= ROUNDS_TOGETHER, [(r["groups"], r["outcome"], r["reasons"]) for r in rounds]
        assert (("reason", "incomplete_group"),) in f["dtnode_hop_failures_total"]  # present at zero
        assert _value(f, "dtnode_allreduce_sent_bytes_total") == sum(r["bytes_sent"] for r in rounds) > 0
        assert _value(f, "dtnode_allreduce_received_bytes_total") == sum(r["bytes_received"] for r in rounds) > 0
        tokens = sum(r["tokens"] for r in rounds)
        assert _value(f, "dtnode_tokens_total") == tokens == rounds[-1]["tokens_total"]
        # steps of a joiner's first round that closed under it are dropped with the round (joiner.py)
        dropped = _value(f, "dtnode_dropped_inner_steps_total")
        assert sum(r["inner_steps"] for r in rounds) == tokens / (8 * 32)
        assert _value(f, "dtnode_inner_step") == sum(r["inner_steps"] for r in rounds) + dropped
        assert dropped == 0 or (node is b and _value(f, "dtnode_catchups_total") >= 2)
        for phase in ("inner", "matchmaking", "allreduce", "waiting", "eval", "outer"):
            assert _value(f, "dtnode_round_phase_seconds_count", phase=phase) == len(rounds)
        assert _value(f, "dtnode_round_phase_seconds_sum", phase="inner") == pytest.approx(
            sum(r["phases_s"]["inner"] for r in rounds), abs=1e-3 * len(rounds)
        )
        assert _value(f, "dtnode_round_seconds_count") == len(rounds)
        assert _value(f, "dtnode_group_size") == rounds[-1]["groups"][0][0] == 2
        assert _value(f, "dtnode_checkpoint_write_seconds_count") >= len(rounds) - 1  # FAST writes every step
        assert _value(f, "dtnode_last_round_timestamp_seconds") == pytest.approx(rounds[-1]["time"], abs=1.0)
        assert _value(f, "dtnode_peers_live") == 2 and _value(f, "dtnode_peers_seen") == 2
        assert (
            _value(f, "dtnode_state", dtnode_state="training") + _value(f, "dtnode_state", dtnode_state="averaging")
            == 1
        )
        assert _value(f, "process_resident_memory_bytes") > 50e6
        # every round reads the membership and its group keys, and writes a registration at least
        dht = f["dtnode_dht_requests_total"]
        assert len(dht) == 10  # (get, store) x (membership, registrations, closed, formed, declined), at zero too
        assert _value(f, "dtnode_dht_requests_total", op="get", key="membership") >= len(rounds)
        assert _value(f, "dtnode_dht_requests_total", op="get", key="registrations") >= len(rounds)
        assert _value(f, "dtnode_dht_requests_total", op="store", key="membership") >= len(rounds)
        assert _value(f, "dtnode_dht_requests_total", op="store", key="registrations") >= len(rounds)
        assert _value(f, "dtnode_dht_requests_total", op="store", key="formed") >= len(rounds)
        assert set(f["dtnode_dht_unanswered_total"]) == {(("call", "find"),), (("call", "store"),)}  # at zero too
        newest = max(int(p.name[5:13]) for p in node.state_dir.glob("ckpt-*.safetensors"))
        assert _value(f, "dtnode_checkpoint_newest_step") in (newest, newest - 1)  # a write may be landing
        assert _value(f, "dtnode_checkpoint_write_failures_total") == 0
        # donors a download passed over, by why (checkpoints/arrivals.py `Skip`): every reason present, at zero
        # too; one honest donor is never contradicted, nor its file refused by a judge
        assert {dict(k)["why"] for k in f["dtnode_checkpoint_skips_total"]} == {s.value for s in Skip}
        assert _value(f, "dtnode_checkpoint_skips_total", why="contradicted") == 0
        assert _value(f, "dtnode_checkpoint_skips_total", why="refused") == 0
        assert _value(f, "dtnode_state_dir_free_bytes") > 0
        assert _value(f, "dtnode_device_memory_bytes", device="cpu", kind="resident") > 50e6
        assert any(dict(k).get("run_id") == "ops-test" for k in f["dtnode_build_info"])
    # b joined by downloading a's checkpoint (again each time a's round closed under b's first
    # steps, at most MAX_REENTRIES times in a row: CI saw 3 downloads), a never: the bytes a
    # served are the bytes b downloaded
    fa, fb = _families(a), _families(b)
    assert 1 <= _value(fb, "dtnode_catchups_total") <= 1 + MAX_REENTRIES and _value(fa, "dtnode_catchups_total") == 0
    assert _value(fa, "dtnode_checkpoint_served_bytes_total") == _value(fb, "dtnode_checkpoint_downloaded_bytes_total")
    assert _value(fb, "dtnode_checkpoint_downloaded_bytes_total") > 0
    # and each node's history says so: b's first round began from the download(s), a's never synced
    rounds_of_b = b.get("/history")["rounds"]
    assert rounds_of_b[0]["synced"] and all(x["source"] == "downloaded" for x in rounds_of_b[0]["synced"])
    assert sum(len(r["synced"]) for r in rounds_of_b) == _value(fb, "dtnode_catchups_total"), rounds_of_b
    assert all(r["synced"] == [] for r in a.get("/history")["rounds"])


def test_history_covers_the_whole_run_and_pages(swarm):
    a, _ = swarm
    rounds = a.get("/history")["rounds"]
    assert len(rounds) >= ROUNDS_TOGETHER + 1 and rounds[0]["step"] == 1  # from the first round on
    assert [r["step"] for r in rounds] == sorted(r["step"] for r in rounds)
    assert rounds[0]["outcome"] == "alone" and rounds[-1]["outcome"] == "full"
    last = rounds[-1]
    assert last["groups"] == [[2, 2]] and last["bytes_sent"] > 0 and last["tokens_total"] > last["tokens"] > 0
    assert set(last["phases_s"]) == {"inner", "matchmaking", "allreduce", "waiting", "eval", "outer"}
    later = a.get(f"/history?since={rounds[0]['step']}&limit=1")
    assert later["rounds"] == [rounds[1]] and later["more"] is True
    for bad in ("since=x", "limit=0", "limit=999999"):
        with pytest.raises(urllib.error.HTTPError) as e:
            a.get(f"/history?{bad}")
        assert e.value.code == 400
    saved = [json.loads(line) for line in (a.state_dir / "history.jsonl").read_text().splitlines()]
    assert [r["step"] for r in saved][: len(rounds)] == [r["step"] for r in rounds]


def test_status_and_peers_say_how_the_node_and_swarm_are(swarm):
    a, _b = swarm
    status = a.get("/status")
    assert status["condition"] == "ok" and status["dht_addrs"]
    peers = a.get("/peers")
    assert len(peers) == 2 and all("last_seen_s" in p and "lag" in p for p in peers)
    # what an operator compares across peers is in each signed record: θ_g's hash at its step,
    # its loss and its condition (dtnode status shows them side by side). A record made while its
    # node hashes θ_g after an outer step says "" for it, and one made after a round cut on a
    # loaded host may say `failing`: each is waited out, a record that never says so fails
    last_read = [peers]

    def described() -> list[dict] | None:
        records = last_read[0] = a.get("/peers")
        return (
            records
            if all(len(p["theta_sha256"]) == 64 and p["condition"] in ("ok", "alone", "starting") for p in records)
            else None
        )

    records = wait_until(described, 60, lambda: f"records with θ_g's hash and a healthy condition: {last_read[0]}")
    assert all(p["loss"] is None or 0 < p["loss"] < 20 for p in records), records

    def in_step() -> bool:
        records = a.get("/peers")
        return len({p["outer_step"] for p in records}) == 1 and len({p["theta_sha256"] for p in records}) == 1

    wait_until(in_step, 60, "both records at one step with one θ_g")  # (a heartbeat may lag a round)
    # the agreement gauge follows the records every few heartbeats; the dial-back happens once a
    # peer answers one (b joined after a asked its first time)
    wait_until(lambda: _value(_families(a), "dtnode_theta_agreement_ratio") == 1.0, 60, "agreement gauge")
    wait_until(lambda: _value(_families(a), "dtnode_reachable") == 1, 60, "a peer's dial-back of a")


def test_ready_is_in_the_swarm_and_healthy_is_alive(swarm):
    """/healthz: the process works; /readyz: it averaged with a peer in one of its last rounds.
    Both nodes averaged together, so both are ready."""
    for node in swarm:
        with urllib.request.urlopen(node.http_url + "/readyz", timeout=5) as resp:
            ready = json.load(resp)
        assert ready["ok"] is True and ready["detail"].startswith("last round ")
        with urllib.request.urlopen(node.http_url + "/healthz", timeout=5) as resp:
            assert json.load(resp)["ok"] is True


def test_status_watch_redraws_until_ctrl_c(swarm):
    import signal

    a, _ = swarm
    # Ctrl-C is SIGINT, which a shell's background job ignores and hands down ignored: the watch
    # runs as typed at a terminal, so the test runs however its runner was started
    command = shlex.join([sys.executable, "-m", "dtnode", "status", "--url", a.http_url, "--watch", "0.5"])
    watch = subprocess.Popen(
        typed_at_a_terminal(f"exec {command}"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(4)
    watch.send_signal(signal.SIGINT)
    out, err = watch.communicate(timeout=30)
    assert watch.returncode == 0, err
    frames = out.count("every 0.5s, Ctrl-C to stop")
    assert frames >= 2 and out.count("swarm: 2 peers") >= 2, out[-2000:]


def test_json_logs_are_one_object_per_line(swarm):
    _, b = swarm
    entries = [json.loads(line) for line in b.lines if line.strip()]
    assert entries and all({"time", "level", "logger", "message"} <= set(e) for e in entries)
    assert any("--peer http://" in e["message"] and "/p2p/" in e["message"] for e in entries)  # resolved
    assert any(e["message"].startswith("in sync at outer step") for e in entries)
    assert not any("traceback" in e for e in entries)


def _chromium() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def test_dashboard_in_a_real_browser(swarm, tmp_path):
    """Headless Chromium renders the dashboard of a running swarm: charts with points and axes,
    the peers table with both nodes. CI installs Chromium (.ci/run) and sets
    DTNODE_REQUIRE_BROWSER=1, so there a missing browser fails instead of skipping."""
    found = _chromium()
    if found is None:
        if os.environ.get("DTNODE_REQUIRE_BROWSER") == "1":
            pytest.fail("Chromium and chromedriver are required (apt-get install chromium chromium-driver)")
        pytest.skip("no Chromium/chromedriver on this host (apt-get install chromium chromium-driver)")
    selenium = pytest.importorskip("selenium")  # noqa: F841
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    a, b = swarm
    options = webdriver.ChromeOptions()
    options.binary_location = found[0]
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1800",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(found[1]), options=options)
    try:
        driver.get(a.http_url + "/")
        WebDriverWait(driver, 30).until(
            lambda d: d.execute_script(
                "return document.querySelectorAll('#loss-step .point').length > 0"
                " && document.querySelectorAll('#peers tr.peer').length == 2"
            )
        )
        counts = driver.execute_script("""return {
            step: document.querySelectorAll('#loss-step .point').length,
            tokens: document.querySelectorAll('#loss-tokens .point').length,
            allreduce: document.querySelectorAll('#allreduce .point').length,
            xlabels: [...document.querySelectorAll('svg .x-label')].map(e => e.textContent),
            ylabels: [...document.querySelectorAll('svg .y-label')].map(e => e.textContent),
            ticks: document.querySelectorAll('#loss-step .axis text').length,
            peers: [...document.querySelectorAll('#peers tr.peer')].map(r => r.textContent),
            health: document.getElementById('health').textContent,
        }""")
        assert counts["step"] >= ROUNDS_TOGETHER and counts["tokens"] >= ROUNDS_TOGETHER and counts["allreduce"] > 0
        assert {"outer step", "tokens"} <= set(counts["xlabels"]) and "loss" in counts["ylabels"]
        assert counts["ticks"] >= 6
        peer_ids = {a.get("/status")["peer_id"][-10:], b.get("/status")["peer_id"][-10:]}
        assert all(any(p in row for row in counts["peers"]) for p in peer_ids), counts["peers"]
        assert "full rounds" in counts["health"]
        shot = tmp_path / "dashboard.png"
        driver.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
        keep = os.environ.get("DTNODE_SCREENSHOT_DIR")
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            shutil.copy(shot, Path(keep) / "dashboard.png")
    finally:
        driver.quit()


# ---- clear errors at start ------------------------------------------------------------------


def _dtnode(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dtnode", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.mark.parametrize("option", ["--dht-port", "--grpc-port", "--http-port"])
def test_a_port_in_use_ends_at_once_naming_the_option(tmp_path, option):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = {"--dht-port": "0", "--grpc-port": "0", "--http-port": "0", option: str(port)}
        result = _dtnode(
            "join",
            "--new-swarm",
            "--host",
            "127.0.0.1",
            *[x for kv in ports.items() for x in kv],
            "--state-dir",
            str(tmp_path),
        )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dtnode: error: {option}: port {port} "), result.stderr
    assert "in use" in lines[0]


def test_local_says_which_port_is_in_use(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _dtnode("local", "--nodes", "2", "--http-port", str(port - 1), "--base-dir", str(tmp_path))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        f"dtnode: error: --http-port: port {port} (node1) on 127.0.0.1 is in use "
        "(another dtnode local?); choose another base port, or 0 for any free ones"
    )


# ---- the round history's file -----------------------------------------------------------------


def test_round_history_survives_a_torn_line_and_stays_bounded(tmp_path):
    from dtnode.daemon.records.history import RoundHistory

    path = tmp_path / "history.jsonl"
    history = RoundHistory(path, limit=3)
    for step in range(1, 8):
        history.persist(history.append({"step": step, "loss": float("nan"), "tokens_total": 10 * step}))
    assert len(path.read_text().splitlines()) <= 2 * 3 + 1  # rewritten to the newest 3 past twice that
    with path.open("a") as f:
        f.write('{"step": 8, "lo')  # a crash mid-line
    again = RoundHistory(path, limit=3)
    again.load()
    assert [e["step"] for e in again.entries] == [5, 6, 7] and again.tokens_total == 70
    assert again.entries[-1]["loss"] is None  # NaN is not JSON
    assert [e["step"] for e in again.since(5, 10)] == [6, 7] and again.since(5, 1) == [again.entries[1]]


def test_hivemind_loads_without_its_trainer_stack():
    """dtnode imports hivemind's DHT only (see dtnode.peers): a second of start-up on a busy host."""
    code = (
        "import sys, dtnode.daemon.node; "
        "print(any(m.startswith(('hivemind.averaging', 'hivemind.moe', 'hivemind.optim', 'scipy')) "
        "for m in sys.modules)); import hivemind; print(hivemind.DHT.__name__, hivemind.__version__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "DHT", "1.1.12"]
