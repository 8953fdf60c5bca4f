"""Settings precedence and the CLI's handling of bad input, through the real entry point."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtnode.daemon.checkpoints.state_dir import holder_running
from dtnode.daemon.config.settings import SettingsError, load_settings


def test_precedence_defaults_toml_env_cli(tmp_path, monkeypatch):
    config = tmp_path / "node.toml"
    config.write_text('inner_steps = 11\nrun_id = "from-toml"\ngrpc_port = 9001\nhttp-port = 9002\n')
    monkeypatch.setenv("DTNODE_INNER_STEPS", "22")
    monkeypatch.setenv("DTNODE_GRPC_PORT", "9101")
    s = load_settings({"config": str(config), "grpc_port": "9201"})
    assert s.swarm.run_id == "from-toml"  # TOML over default
    assert s.network.http_port == 9002  # TOML, dashed key accepted
    assert s.diloco.inner_steps == 22  # env over TOML
    assert s.network.grpc_port == 9201  # CLI over env
    assert s.diloco.outer_lr == 0.7  # default
    assert s.given() == {"config", "inner_steps", "run_id", "grpc_port", "http_port"}
    monkeypatch.setenv("DTNODE_CONFIG", str(config))
    assert load_settings({}).swarm.run_id == "from-toml"


def test_a_toml_file_may_group_options_in_tables_named_for_their_groups(tmp_path, monkeypatch):
    """Tables and top-level keys mix; each source fills its own fields, so a flag for one option
    of a group leaves the file's value of another in force."""
    config = tmp_path / "node.toml"
    config.write_text(
        'inner_steps = 11\n[diloco]\nouter-lr = 0.5\npacing = "fixed"\n[averaging]\ntarget_group_size = 3\n'
    )
    monkeypatch.setenv("DTNODE_OUTER_MOMENTUM", "0.8")
    s = load_settings({"config": str(config), "pacing": "swarm"})
    assert (s.diloco.inner_steps, s.diloco.outer_lr, s.diloco.outer_momentum) == (11, 0.5, 0.8)
    assert s.diloco.pacing == "swarm" and s.averaging.target_group_size == 3
    assert s.value("outer_lr") == 0.5 and s.flat()["target_group_size"] == 3
    misplaced = tmp_path / "misplaced.toml"
    misplaced.write_text("[diloco]\ntarget_group_size = 3\n")
    with pytest.raises(SettingsError, match=r"diloco\.target_group_size") as e:
        load_settings({"config": str(misplaced)})
    assert e.value.option == "--config"


def test_every_option_has_one_flat_name_in_exactly_one_group():
    from dtnode.daemon.config.settings import NodeSettings, option_groups

    names = [name for _, group in option_groups() for name in group.model_fields]
    assert len(names) == len(set(names)) == len(NodeSettings.GROUP_OF)
    for _, group in option_groups():
        assert group.ADVANCED <= set(group.model_fields) and group.TITLE and group.HELP
        assert all(field.description for field in group.model_fields.values())


def test_replaced_changes_an_option_by_its_flat_name_and_counts_it_as_given():
    s = load_settings({})
    changed = s.replaced(max_rounds=40, model="small")
    assert (changed.diloco.max_rounds, changed.workload.model, s.diloco.max_rounds) == (40, "small", None)
    assert {"max_rounds", "model"} <= changed.given() and not s.given()


@pytest.mark.parametrize(
    "values,option",
    [
        ({"grpc_port": "70000"}, "--grpc-port"),
        ({"inner_steps": "0"}, "--inner-steps"),
        ({"device": "tpu"}, "--device"),
        ({"config": "/nonexistent/x.toml"}, "--config"),
        ({"model": "huge"}, "--model"),
        ({"chunk_elements": "1000", "quant_block_size": "256"}, "--chunk-elements"),
        ({"compression": "zstd"}, "--compression"),
        ({"compression": "sparse", "sparse_block_size": "8192"}, "--sparse-block-size"),
        ({"compression": "sparse", "sparse_block_size": "1024", "sparse_top_k": "2048"}, "--sparse-top-k"),
        ({"compression": "sparse", "chunk_elements": "6144"}, "--chunk-elements"),
        ({"compression": "sparse", "aggregation": "trimmed-mean"}, "--aggregation"),
        ({"compression": "sparse", "aggregation": "median"}, "--aggregation"),
        ({"feedback_decay": "0"}, "--feedback-decay"),
        ({"matchmaking_window": "5", "matchmaking_window_min": "9"}, "--matchmaking-window-min"),
        ({"heartbeat_interval": "9", "peer_ttl": "6"}, "--peer-ttl"),
        ({"device": "cuda:1", "nproc_per_node": "2"}, "--nproc-per-node"),
        ({"warmup_steps": "100", "total_steps": "50"}, "--total-steps"),
        ({"peers": ["http://ok:7702", "nonsense"]}, "--peer"),
    ],
)
def test_bad_values_name_the_option(values, option):
    with pytest.raises(SettingsError) as e:
        load_settings(values)
    assert e.value.option == option


def test_compression_names_a_wire_format_and_none_still_means_fp32():
    assert load_settings({"compression": "none"}).wire.compression == "fp32"
    wire = load_settings({"compression": "sparse", "sparse_top_k": "32"}).wire.wire_format()
    assert (wire.compression, wire.block_size, wire.top_k) == ("sparse", 4096, 32)


def test_sparse_takes_its_own_outer_step_unless_one_is_given(monkeypatch):
    """Error feedback takes momentum's place (SparseLoCo), and no periodic fp32 re-sync spends
    hundreds of sparse rounds' bytes; a value given by flag, env var or file still wins."""
    s = load_settings({"compression": "sparse"})
    assert (s.diloco.outer_lr, s.diloco.outer_momentum, s.averaging.consensus_every) == (1.0, 0.0, 0)
    assert load_settings({"compression": "sparse", "outer_momentum": "0.5"}).diloco.outer_momentum == 0.5
    plain = load_settings({})
    assert (plain.diloco.outer_lr, plain.diloco.outer_momentum, plain.averaging.consensus_every) == (0.7, 0.9, 25)
    monkeypatch.setenv("DTNODE_OUTER_LR", "2.0")
    assert load_settings({"compression": "sparse"}).diloco.outer_lr == 2.0


def test_bad_toml_and_unknown_keys(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("inner_steps = [\n")
    with pytest.raises(SettingsError, match="not valid TOML"):
        load_settings({"config": str(bad)})
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("inner_stepz = 3\n")
    with pytest.raises(SettingsError, match="inner_stepz"):
        load_settings({"config": str(unknown)})


def dtnode(*args, timeout=60, env=None):
    return subprocess.run(
        [sys.executable, "-m", "dtnode", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        check=False,
    )


@pytest.mark.parametrize(
    "args,option",
    [
        (["join", "--grpc-port", "70000"], "--grpc-port"),
        (["join", "--inner-steps", "0"], "--inner-steps"),
        (["join", "--device", "quantum"], "--device"),
        (["join", "--config", "/nonexistent.toml"], "--config"),
        (["local", "--nodes", "0"], "--nodes"),
        (["join", "--peer", "not-a-multiaddr"], "--peer"),
        (["join", "--precision", "fp8"], "--precision"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(args, option):
    result = dtnode(*args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dtnode: error: {option}:"), result.stderr


def test_a_second_dtnode_local_after_its_run_ended_says_so_and_starts_nothing(tmp_path):
    """`make swarm` twice: the second run's nodes found the first one's state at the run's last
    outer step and stopped at once, with no word to a newcomer of why."""
    (tmp_path / "node0").mkdir()
    (tmp_path / "node0" / "ckpt-00000003.safetensors").write_bytes(b"")  # only its name is read
    result = dtnode("local", "--nodes", "1", "--max-rounds", "3", "--base-dir", str(tmp_path))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dtnode: error: --max-rounds:"), result.stderr
    assert "already reached outer step 3" in lines[0] and str(tmp_path) in lines[0]
    assert not (tmp_path / "node0" / "history.jsonl").exists()  # no node started

    from dtnode.daemon.cli.local_swarm import finished_before

    assert finished_before(tmp_path, 4) is None  # a round left: the swarm goes on
    assert finished_before(tmp_path, None) is None  # no last round
    assert finished_before(tmp_path / "elsewhere", 3) is None  # a fresh base dir


def test_cli_env_var_is_validated_too():
    result = dtnode("join", env={"DTNODE_HTTP_PORT": "-1"})
    assert result.returncode == 2 and "--http-port" in result.stderr


def test_version_and_help():
    assert dtnode("--version").stdout.startswith("dtnode ")
    help_text = dtnode("join", "--help").stdout
    for option in (
        "--run-id",
        "--peer",
        "--state-dir",
        "--announce-host",
        "--grpc-port",
        "--http-port",
        "--model",
        "--inner-steps",
        "--target-group-size",
        "--client-mode",
        "--max-rounds",
        "--device",
        "--config",
    ):
        assert option in help_text


@pytest.mark.parametrize(
    "peer",
    [
        "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWHtocysUnWZKdxsM8xACZXMk7LHDHgwug2T9DkWuWw9kA",  # nobody listens
        "http://127.0.0.1:1",  # a sidecar address nobody serves
    ],
)
def test_unreachable_or_malformed_peer_fails_clearly(tmp_path, peer):
    """Exit status 3 and a message naming the peer, after --join-timeout at most (the
    subprocess timeout only guards against a hang)."""
    result = dtnode(
        "join",
        "--peer",
        peer,
        "--host",
        "127.0.0.1",
        "--dht-port",
        "0",
        "--grpc-port",
        "0",
        "--http-port",
        "0",
        "--state-dir",
        str(tmp_path),
        "--join-timeout",
        "4",
        timeout=60,
    )
    assert result.returncode == 3, result.stderr
    assert "dtnode: error:" in result.stderr and peer in result.stderr


def test_peers_in_the_environment_are_comma_separated_or_a_json_list(monkeypatch):
    """DTNODE_PEERS=http://node1:7702 failed with "a JSON list"; a list is written as an operator
    writes one, and a JSON list still works."""
    monkeypatch.setenv("DTNODE_PEERS", "http://node1:7702, http://node2:7702")
    assert load_settings({}).swarm.peers == ["http://node1:7702", "http://node2:7702"]
    monkeypatch.setenv("DTNODE_PEERS", '["http://node1:7702"]')
    assert load_settings({}).swarm.peers == ["http://node1:7702"]


def test_a_dtnode_variable_that_names_no_option_is_an_error_with_the_closest_name():
    """DTNODE_PEER (no S) was silently ignored and the node trained alone."""
    result = dtnode("join", "--new-swarm", env={"DTNODE_PEER": "http://node1:7702"})
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "dtnode: error: DTNODE_PEER: no option has this name; did you mean DTNODE_PEERS?"
    ]


@pytest.mark.parametrize(
    "peer,problem",
    [
        ("/ip4/1.2.3.4/tcp/7700/p2p/Qm", "cut short"),
        ("/ip4/1.2.3.4/tcp/7700/p2p/abc", "not a libp2p peer id"),
        ("/ip4/1.2.3.4/tcp/7700/p2p/QmQRUdNjhvgreSjaK29cZzbpN4uZbLwShCFzQvGncCmj", "cut short"),
        ("/ip4/1.2.3.4/tcp/77000/p2p/QmQRUdNjhvgreSjaK29cZzbpN4uZbLwShCFzQvGncCmjDx", "port"),
        ("/ip4/1.2.3/tcp/7700/p2p/QmQRUdNjhvgreSjaK29cZzbpN4uZbLwShCFzQvGncCmjDx", "not an ip4 address"),
        ("1.2.3.4:7700", "neither a sidecar address"),
    ],
)
def test_a_malformed_peer_is_refused_at_once_with_what_a_valid_one_looks_like(peer, problem):
    """A malformed multiaddr took 16 s and ended in Go's "multihash length inconsistent": the
    settings refuse it now, before the DHT starts (its errors would name no --peer, nor a valid
    address)."""
    result = dtnode("join", "--peer", peer)
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("dtnode: error: --peer:") and problem in line
    assert "/ip4/" in line.split(problem, 1)[1] or "http://" in line  # shows a valid address


def test_join_without_a_peer_asks_for_one_or_for_new_swarm(tmp_path):
    """`join` without --peer silently started a new swarm and trained alone."""
    result = dtnode("join", "--state-dir", str(tmp_path / "s"))
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("dtnode: error: --peer: no swarm to join") and "--new-swarm" in line
    assert not (tmp_path / "s").exists()  # refused before anything was made


def test_errors_name_the_allowed_values_in_words_never_a_regex():
    for args, words in (
        (["--compression", "int4"], "'int8', 'sparse' or 'fp32'"),
        (["--gpus", "zero"], "write all, or GPU indices"),
        (["--run-id", "my run"], "letters, digits"),
        (["--aggregation", "mode"], "'mean', 'trimmed-mean' or 'median'"),
    ):
        result = dtnode("join", "--new-swarm", *args)
        assert result.returncode == 2 and words in result.stderr, result.stderr
        assert "^" not in result.stderr and "pattern" not in result.stderr


def test_gpus_takes_indices_as_cuda_numbers_them():
    assert load_settings({"gpus": "0"}).hardware.gpus == "0"
    assert load_settings({"gpus": "0,3,5"}).hardware.gpus == "0,3,5"


def test_an_on_off_option_given_a_value_says_how_it_is_written():
    """`--client-mode yes` printed the top-level usage."""
    result = dtnode("join", "--client-mode", "yes")
    assert result.returncode == 2
    assert result.stderr.startswith("usage: dtnode join")
    assert "--client-mode takes no value" in result.stderr and "--no-client-mode" in result.stderr


def test_help_is_grouped_like_the_settings_with_knobs_behind_help_all():
    from dtnode.daemon.config.settings import option_groups

    short, full = dtnode("join", "--help").stdout, dtnode("join", "--help-all").stdout
    titles = ["\n" + group.TITLE + ":" for _, group in option_groups()]
    assert [short.index(title) for title in titles] == sorted(short.index(title) for title in titles)
    swarm = short.index("\nswarm:")
    assert swarm < short.index("--peer ADDRESS", swarm) < short.index("\nmodel and data:")
    for knob in ("--chunk-elements", "--in-flight-chunks", "--fused-kernels", "--max-own-rounds"):
        assert knob not in short and knob in full
    assert len(short.splitlines()) < len(full.splitlines())
    local_full = dtnode("local", "--help-all").stdout  # local's own options too, beside every group
    assert "--nodes" in local_full and "--chunk-elements" in local_full and "--new-swarm" not in local_full


def test_every_option_but_the_secret_is_a_flag():
    from dtnode.daemon.cli.main import ENV_ONLY, build_parser
    from dtnode.daemon.config.settings import NodeSettings

    join = build_parser()._subparsers._group_actions[0].choices["join"]
    dests = {action.dest for action in join._actions}
    assert dests >= set(NodeSettings.GROUP_OF) - ENV_ONLY | {"config"} and not dests & ENV_ONLY


PORTS = ["--host", "127.0.0.1", "--dht-port", "0", "--grpc-port", "0", "--http-port", "0"]


def test_a_state_dir_that_cannot_be_written_is_one_line_and_exit_2(tmp_path):
    """Root ignores file modes, so 'read-only' is made two ways that stop root too: a state dir
    under a regular file, and a node that must write its TLS certificate where a directory is."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = dtnode("join", "--new-swarm", *PORTS, "--state-dir", str(blocker / "state"))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dtnode: error: --state-dir: cannot use"), result.stderr
    assert "writable directory" in lines[0]
    state = tmp_path / "state"
    (state / "tls.crt").mkdir(parents=True)  # written after the DHT started: its shutdown must still run
    result = dtnode("join", "--new-swarm", *PORTS, "--model", "tiny", "--state-dir", str(state), timeout=120)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("dtnode: error:")]
    assert errors == [errors[0]] and "--state-dir: cannot use" in errors[0] and "tls.crt" in errors[0]
    assert "Traceback" not in result.stderr


def test_a_state_dir_on_a_read_only_file_system_is_one_line_and_exit_2(tmp_path):
    """A real read-only file system (a tmpfs mounted ro; root needed to mount, as CI has)."""
    mount = tmp_path / "ro"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)], check=False, capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {done.stderr.decode().strip()}")
    try:
        result = dtnode("join", "--new-swarm", *PORTS, "--state-dir", str(mount / "state"))
    finally:
        subprocess.run(["umount", str(mount)], check=True)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dtnode: error: --state-dir: cannot use"), result.stderr
    assert "Read-only file system" in lines[0]


def test_a_second_node_on_a_held_state_dir_is_refused(tmp_path):
    """Refused at once, naming the holder: the lock names a live pid (a killed holder's DHT
    process, which holds the lock while it goes down, is waited for instead)."""
    from nodes import NodeProcess, wait_until

    first = NodeProcess.join("first", tmp_path, "--model", "tiny", "--no-fused-kernels")
    try:
        pid = str(first.proc.pid)
        lock = first.state_dir / "lock"
        wait_until(lambda: lock.is_file() and lock.read_text().strip() == pid, 120, "lock naming the first node")
        assert holder_running(pid)  # the lock's holder counts as running: refused at once, not after LOCK_WAIT_S
        second = dtnode("join", "--new-swarm", *PORTS, "--state-dir", str(first.state_dir), timeout=60)
        assert second.returncode == 2, second.stderr
        assert second.stderr.strip().splitlines() == [
            (
                f"dtnode: error: --state-dir: {first.state_dir} is in use by another dtnode (pid {pid}); "
                "give each node its own --state-dir"
            )
        ]
    finally:
        first.kill()


def test_a_lock_whose_holder_is_dead_or_a_zombie_is_waited_for_and_a_live_one_is_not():
    """A restart after a kill -9 names a pid that is gone (or a zombie not yet reaped by its
    parent) while a process the killed node started may still hold the lock: that is waited for.
    A live pid is a running node: refused at once."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert holder_running(str(child.pid))
        child.kill()
        # not reaped yet: a zombie until wait()
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the killed child never became a zombie"
            time.sleep(0.05)
        assert not holder_running(str(child.pid))
    finally:
        child.kill()
        child.wait()
    assert not holder_running(str(child.pid))  # reaped: gone
    assert not holder_running(str(os.getpid()))  # this process's own earlier claim
    assert not holder_running("?") and not holder_running("")


def test_a_node_that_requires_a_swarm_key_refuses_to_start_without_one(tmp_path):
    """Issue 31, finding 15: a cluster whose key secret is missing must not start an open swarm
    (the manifests set DTNODE_REQUIRE_SWARM_KEY): one line, exit 2, before any network starts."""
    env = {"DTNODE_REQUIRE_SWARM_KEY": "true", "DTNODE_SWARM_KEY": ""}
    result = dtnode(
        "join", "--new-swarm", *PORTS, "--model", "tiny", "--state-dir", str(tmp_path / "s"), env=env, timeout=120
    )
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("dtnode: error:")]
    assert errors and errors[0].startswith("dtnode: error: --require-swarm-key: no swarm key"), result.stderr
    assert "Traceback" not in result.stderr


def test_dtnode_local_shares_the_hosts_cores_among_its_nodes_ranks():
    from dtnode.daemon.cli.local_swarm import threads_per_rank

    assert threads_per_rank(nodes=3, ranks_per_node=1, cores=2) == 1  # never 0
    assert threads_per_rank(nodes=2, ranks_per_node=1, cores=16) == 8
    assert threads_per_rank(nodes=2, ranks_per_node=2, cores=16) == 4


def test_debug_logging_keeps_grpcs_internals_out(monkeypatch):
    """--log-level DEBUG is for dtnode's own lines: grpc's debug logger wrote a "Loaded running
    loop" line per call and, after a reducer refused a stream, the traceback of the cut request
    iterator, which read like a bug of ours in every node's log."""
    import logging

    from dtnode.daemon.cli.main import configure_logging

    for name in ("", "grpc", "dtnode", "hivemind", "asyncio", "aiohttp.access"):
        monkeypatch.setattr(logging.getLogger(name), "level", logging.getLogger(name).level)
    configure_logging("DEBUG")
    assert logging.getLogger("grpc").level == logging.WARNING  # and so its children, grpc.aio._call...
    assert logging.getLogger("dtnode").level == logging.NOTSET  # dtnode's lines follow --log-level


def test_a_clean_stop_logs_no_error_for_p2pd_closing_its_listener():
    """Every clean stop logged `ERROR hivemind.p2p.p2p_daemon: error accepting connection: ...
    use of closed network connection` (p2pd's listener closed under it at shutdown)."""
    import json as json_module
    import logging

    from hivemind.p2p.p2p_daemon import P2P

    from dtnode.daemon.cli.main import ClosedListenerFilter

    p2pd = logging.getLogger("hivemind.p2p.p2p_daemon")
    line = json_module.dumps(
        {
            "level": "error",
            "ts": "2026-11-29T09:00:00.000Z",
            "logger": "p2pd",
            "caller": "p2pd/main.go:1",
            "msg": "error accepting connection",
            "error": "accept unix /tmp/hivemind-p2pd.sock: use of closed network connection",
        }
    )
    records: list[logging.LogRecord] = []
    listener_filter, collect = ClosedListenerFilter(), logging.Handler()
    collect.emit = records.append  # type: ignore[method-assign]
    p2pd.addFilter(listener_filter)
    p2pd.addHandler(collect)
    try:
        P2P._log_p2pd_message(line)
        P2P._log_p2pd_message(line.replace("use of closed network connection", "too many open files"))
    finally:
        p2pd.removeFilter(listener_filter)
        p2pd.removeHandler(collect)
    errors = [r.getMessage() for r in records if r.levelno >= logging.ERROR]
    assert errors == ["error accepting connection: accept unix /tmp/hivemind-p2pd.sock: too many open files"]


def test_dtnode_status_finds_the_nodes_ports_in_its_config_file_flat_or_grouped(tmp_path, monkeypatch):
    from dtnode.daemon.cli.status import local_node_url

    monkeypatch.delenv("DTNODE_HTTP_PORT", raising=False)
    monkeypatch.delenv("DTNODE_STATUS_PORT", raising=False)
    flat, grouped = tmp_path / "flat.toml", tmp_path / "grouped.toml"
    flat.write_text("http-port = 9100\n")
    grouped.write_text('[network]\nstatus_port = 9200\nstatus-host = "10.0.0.5"\n')
    assert local_node_url(str(flat), None, None, None) == "http://127.0.0.1:9100"
    assert local_node_url(str(grouped), None, None, None) == "http://10.0.0.5:9200"
    assert local_node_url(str(grouped), None, 9300, None) == "http://10.0.0.5:9300"  # a flag wins
