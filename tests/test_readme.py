"""The README's commands, as printed, in the order a newcomer meets them (`pytest -m readme`;
.ci/run runs it). Every shell command in a ```bash block is taken by one rule below, and a
command no rule takes fails the test, so a new README command comes with its check.

What runs here: `make swarm`; two hosts joining (on loopback: the documentation addresses
203.0.113.1 and node1.example.org stand for 127.0.0.1) with `dtnode status --watch` on them;
the Hugging Face workflow from a tokenizer to `from_pretrained`. What cannot run on this host is
checked as far as it can be: the GPU box's lines and the `docker run` line through dtnode's own
parser and settings; `docker`/`kubectl` lines against the files they name. `.ci/run` runs the
`make` targets and `.ci/git-install` the `pip install` lines.

Only DTNODE_* variables are added to the printed commands, to make a run end and fit a shared
host: ports, a state dir, a round limit, a small batch (each is named where it is set).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from nodes import typed_at_a_terminal

from dtnode.daemon.cli.main import _node_values, build_parser
from dtnode.daemon.config.settings import load_settings

pytestmark = pytest.mark.readme

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LOOPBACK = {"203.0.113.1": "127.0.0.1", "node1.example.org": "127.0.0.1"}
ENV_OF_TESTS = {k: v for k, v in os.environ.items() if not k.startswith("DTNODE_") or k.startswith("DTNODE_TEST_")}


def readme_commands() -> list[str]:
    """Every command of the README's ```bash blocks, in order: comments dropped, continued and
    quoted multi-line commands joined."""
    commands: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.DOTALL):
        pending = ""
        for line in block.splitlines():
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            pending = f"{pending}\n{line}" if pending else line
            if pending.endswith("\\"):
                pending = pending[:-1]
                continue
            try:
                shlex.split(pending, comments=True)
            except ValueError:  # an open quote: the command goes on
                continue
            commands.append(pending.strip())
            pending = ""
    return commands


def _words(command: str) -> list[str]:
    return shlex.split(command, comments=True)


def _env(**values: str) -> dict[str, str]:
    return {**ENV_OF_TESTS, **values, "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"}


def _loopback(command: str) -> str:
    for documented, here in LOOPBACK.items():
        command = command.replace(documented, here)
    return command


def _documents(count: int = 60) -> list[str]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.glob("*.py") if 2_000 < p.stat().st_size < 40_000)[:count]
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """Where a newcomer runs the commands: the clone's .venv, and the corpus files they name."""
    work = tmp_path_factory.mktemp("readme")
    (work / ".venv").symlink_to(ROOT / ".venv")
    docs = _documents()
    (work / "corpus.txt").write_text("\n\n".join(docs))
    (work / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return work


def _free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _run(command: str, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    result = subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stdout + result.stderr, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _start(command: str, cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        ["bash", "-c", f"exec {command}"], cwd=cwd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT
    )


def _history(state_dir: Path) -> list[dict]:
    path = state_dir / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _ci_runs(words: list[str]) -> bool:
    return " ".join(words) in (ROOT / ".ci" / "run").read_text()


def test_every_readme_command_is_taken_by_a_rule():
    for command in readme_commands():
        assert any(rule(command) for rule, _ in RULES), f"no check for the README command: {command}"


def test_the_make_targets_and_pip_installs_are_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    git_install = (ROOT / ".ci" / "git-install").read_text()
    for command in readme_commands():
        words = _words(command)
        if words[0] == "make" and words[1] != "swarm":
            assert _ci_runs(words), f".ci/run does not run {command}"
        if words[0] == "pip":
            assert "README.md" in git_install and "bash .ci/git-install" in ci  # it runs them as printed


def _skeleton(line: str) -> str:
    """A round line without its numbers, units and hashes: the fields and their order."""
    line = re.sub(r"^.*?dtnode: ", "", line)
    line = re.sub(r"\b[0-9a-f]{12}\b", "H", line)
    return re.sub(r"\d[\d.]*\s?(kB|MB|GB|B|bytes)?", "N", line)


def test_make_swarm_trains_three_nodes_to_the_round_limit():
    base = ROOT / "state" / "local"
    kept = base.with_name("local.before-readme-test")
    if base.exists():  # a developer's own run: set aside, and back after
        base.rename(kept)
    try:
        [command] = [c for c in readme_commands() if c.startswith("make swarm")]
        printed = _run(command, ROOT, _env(), timeout=600).stdout
        # the README's sample round line has the fields a round line has, in their order
        [sample] = re.findall(r"^ +node1 \| .*dtnode: round 3 .*$", README.read_text(), re.MULTILINE)
        rounds_printed = [line for line in printed.splitlines() if "dtnode: round 3 |" in line]
        assert rounds_printed and _skeleton(sample) == _skeleton(rounds_printed[0]), (sample, rounds_printed[:1])
        for node in ("node0", "node1", "node2"):
            rounds = _history(base / node)
            assert rounds and rounds[-1]["step"] == 8, (node, rounds[-1:] if rounds else None)
    finally:
        if base.exists():
            subprocess.run(["rm", "-rf", str(base)], check=False)
        if kept.exists():
            kept.rename(base)


def test_a_second_host_joins_and_status_watches_them(workdir):
    commands = [c for c in readme_commands() if "dtnode join --new-swarm --run-id my-run" in c]
    joiner = [c for c in readme_commands() if "dtnode join --peer http://203.0.113.1:7702" in c]
    watch = [c for c in readme_commands() if "dtnode status --watch" in c]
    assert len(commands) == len(joiner) == len(watch) == 1
    assert all(_free(p) for p in (7700, 7701, 7702)), "the README's host 1 takes ports 7700-7702"
    first_log, second_log = workdir / "host1.log", workdir / "host2.log"
    # host 1 waits for host 2 before its first round, and the run ends at outer step 3
    first = _start(
        commands[0],
        workdir,
        _env(DTNODE_HOST="127.0.0.1", DTNODE_STATE_DIR="host1", DTNODE_MAX_ROUNDS="3", DTNODE_MIN_PEERS="2"),
        first_log,
    )
    second = None
    try:
        _wait(lambda: "dtnode join --peer /ip4/" in first_log.read_text(), 120, "host 1's join line")
        printed = re.search(r"(dtnode join --peer \S+.*)", first_log.read_text()).group(1)
        assert re.match(r"dtnode join --peer /ip4/127\.0\.0\.1/tcp/7700/p2p/Qm\w{44} ", printed), printed
        # the README shows the line host 1 prints, its address aside
        [shown] = re.findall(
            r"#     (dtnode join --peer /ip4/203\.0\.113\.1/tcp/7700/p2p/Qm\S+ .*)", README.read_text()
        )
        printed_flags = printed.split(" ", 4)[4].replace(" --max-rounds 3", "")  # the test's DTNODE_MAX_ROUNDS
        assert printed_flags == shown.split(" ", 4)[4], (printed, shown)
        # no round limit here: the joiner takes host 1's from its sidecar, as it takes the recipe
        env = _env(DTNODE_HOST="127.0.0.1", DTNODE_STATE_DIR="host2", DTNODE_DHT_PORT="0", DTNODE_GRPC_PORT="0")
        second = _start(_loopback(joiner[0]), workdir, {**env, "DTNODE_HTTP_PORT": "0"}, second_log)
        _wait(lambda: bool(_history(workdir / "host2")), 240, "host 2's first round")
        # the README's command as typed at a terminal, SIGINT at its default: a shell's background
        # job (a runner started with `&`) hands it down ignored, and the Ctrl-C below did nothing
        watching = subprocess.Popen(
            typed_at_a_terminal(f"exec {watch[0]}"),
            cwd=workdir,
            env=_env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(5)
        watching.send_signal(signal.SIGINT)
        out, _ = watching.communicate(timeout=30)
        assert watching.returncode == 0 and "every 2s, Ctrl-C to stop" in out and "swarm: 2 peers" in out, out
        assert first.wait(300) == 0 and second.wait(300) == 0
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
    rounds = _history(workdir / "host2")
    assert rounds[-1]["step"] == 3 and any(r["groups"] and r["groups"][0][0] == 2 for r in rounds), rounds
    for log in (first_log, second_log):
        assert "Traceback" not in log.read_text() and " ERROR " not in log.read_text(), log.read_text()[-3000:]


def test_the_hugging_face_workflow_from_a_tokenizer_to_from_pretrained(workdir):
    transformers = pytest.importorskip("transformers")
    steps = [c for c in readme_commands() if c.startswith(".venv/bin/python -c") or "hf:llama" in c or " export " in c]
    assert len(steps) == 4, steps
    tokenizer, config, join, export = steps
    _run(tokenizer, workdir, _env(), timeout=300)
    _run(config, workdir, _env(), timeout=300)
    # one round of two small steps: the model is the README's, the batch a CPU's
    small = {"DTNODE_MAX_ROUNDS": "1", "DTNODE_INNER_STEPS": "2", "DTNODE_BATCH_SIZE": "2", "DTNODE_SEQ_LEN": "64"}
    ports = {"DTNODE_HOST": "127.0.0.1", "DTNODE_DHT_PORT": "0", "DTNODE_GRPC_PORT": "0", "DTNODE_HTTP_PORT": "0"}
    _run(join, workdir, _env(**small, **ports), timeout=600)
    _run(export, workdir, _env(), timeout=300)
    model = transformers.AutoModelForCausalLM.from_pretrained(workdir / "my-model")
    assert model.config.num_hidden_layers == 8 and model.config.vocab_size == 8192


def test_the_gpu_box_and_docker_lines_parse_as_dtnode_settings():
    """They need GPUs and a Docker engine; here they go through dtnode's parser and settings."""
    lines = [c for c in readme_commands() if _words(c)[0] in ("dtnode", "docker") and "join" in _words(c)]
    assert len(lines) >= 4
    for command in lines:
        words = _words(command)
        argv = words[words.index("join") :]
        load_settings(_node_values(build_parser().parse_args(argv)))
    docker = [_words(c) for c in readme_commands() if _words(c)[0] == "docker"]
    build = next(w for w in docker if w[1] == "build")
    assert (ROOT / build[build.index("-f") + 1]).is_file() and build[-1] == "."
    run = next(w for w in docker if w[1] == "run")
    assert "--ipc=host" in run and run[run.index("join") - 1] == build[build.index("-t") + 1]


def test_the_kubernetes_lines_name_what_the_manifests_read():
    kubectl = [_words(c) for c in readme_commands() if _words(c)[0] == "kubectl"]
    secret = next(w for w in kubectl if w[1:3] == ["create", "secret"])
    applied = next(w for w in kubectl if w[1] == "apply")
    manifest = (ROOT / applied[applied.index("-f") + 1]).read_text()
    assert f"name: {secret[4]}, key: key" in manifest and secret[5].startswith("--from-literal=key=")


RULES: list[tuple[Callable[[str], bool], str]] = [
    (lambda c: _words(c)[0] == "make", "the make targets (.ci/run, test_make_swarm...)"),
    (lambda c: _words(c)[0] == "pip", ".ci/git-install"),
    (lambda c: "dtnode join --new-swarm --run-id my-run" in c, "test_a_second_host_joins..."),
    (lambda c: "dtnode join --peer http://203.0.113.1:7702" in c, "test_a_second_host_joins..."),
    (lambda c: "dtnode status --watch" in c, "test_a_second_host_joins..."),
    (lambda c: c.startswith(".venv/bin/python -c") or "hf:llama" in c or " export " in c, "test_the_hugging_face..."),
    (lambda c: _words(c)[:2] == ["dtnode", "join"], "test_the_gpu_box_and_docker_lines..."),
    (lambda c: _words(c)[0] in ("docker", "kubectl"), "test_the_gpu_box... / test_the_kubernetes_lines..."),
]
