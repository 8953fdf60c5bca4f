"""The swarm's recipe (daemon/workload/recipe.py): its hash published in every record and the JSON at
the sidecar's /recipe, checked at join, carried by the printed join line, and taken from a peer's
sidecar with `--peer http://...`.

One node `a` of a non-default recipe (its own data file, H=12, seq-len 24, warm-up 5) serves
the module; joiners are real processes on loopback."""

from __future__ import annotations

import asyncio
import shlex
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from aiohttp import web
from nodes import NodeProcess, wait_until

from dtnode.daemon.catchup.admission import RecipeMismatch, RecipeReader, check_same_recipe
from dtnode.daemon.cli.main import EXIT_MISMATCH
from dtnode.daemon.config.settings import NodeSettings
from dtnode.daemon.workload.recipe import (
    SwarmRecipe,
    adopted_settings,
    check_same_protocol,
    differences,
    recipe_flags,
    recipe_of,
)
from dtnode.peers import wire
from dtnode.peers.membership import JoinError, PeerRecord

# FAST's flags that are not part of the recipe: a joiner that takes the recipe from a peer gives only these
NOT_RECIPE = [
    "--batch-size", "8", "--keep-checkpoints", "100", "--checkpoint-every", "1", "--matchmaking-window", "10",
    "--peer-ttl", "4", "--heartbeat-interval", "1", "--no-fused-kernels",
]  # fmt: skip
A_RECIPE = ["--inner-steps", "12", "--seq-len", "24", "--warmup-steps", "5", "--run-id", "recipe-test"]


def _text(path, seed: int):
    lines = [f"document {seed} line {i}: the quick brown fox {i * seed % 97} jumps" for i in range(400)]
    path.write_text("\n".join(lines))
    return path


DATA_OF_A: Path  # the file node `a` trains on (set by its fixture)


@pytest.fixture(scope="module")
def a(tmp_path_factory):
    global DATA_OF_A
    tmp = tmp_path_factory.mktemp("recipe")
    data = DATA_OF_A = _text(tmp / "corpus.txt", 1)
    node = NodeProcess.join("a", tmp, *NOT_RECIPE, *A_RECIPE, "--data", str(data))
    try:
        node.wait_for_round(timeout=120)
        yield node
    finally:
        node.stop()
        node.wait(60)
        node.kill()
        _keep(node)
    assert "Traceback" not in node.output


def _keep(node: NodeProcess) -> None:
    """The node's output beside its state dir (read after a run)."""
    Path(str(node.state_dir) + ".log").write_text(node.output)


def _recipe(**changes) -> SwarmRecipe:
    s = NodeSettings()
    return SwarmRecipe(data="synthetic (seed 0)", seq_len=64, **{k: s.value(k) for k in ("inner_steps", "pacing", "inner_optimizer", "inner_lr", "lr_schedule", "warmup_steps", "min_lr_ratio", "outer_lr", "outer_momentum", "compression", "quant_block_size")}).model_copy(update=changes)  # fmt: skip


def test_differences_name_the_field_both_values_and_the_flag():
    ours, theirs = _recipe(), _recipe(inner_steps=50, data="10 tokens, sha256 ab")
    lines = [d.line() for d in differences(ours, theirs)]
    assert lines == [
        (
            "  data: this node 'synthetic (seed 0)', the swarm '10 tokens, sha256 ab' (set by --data (and "
            "--eval-fraction or --eval-data: what is held out is not trained on))"
        ),
        "  inner_steps: this node 20, the swarm 50 (set by --inner-steps)",
    ]


@contextmanager
def _sidecars(answers: list[str]) -> Iterator[list[str]]:
    """Loopback HTTP servers answering /recipe with these bodies, each on its own port (what a
    peer's sidecar serves, or what a hostile peer's does), on a loop in a thread: their URLs."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start(body: str) -> web.AppRunner:
        app = web.Application()
        app.router.add_get("/recipe", lambda _r: web.Response(text=body, content_type="application/json"))
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner

    runners = [asyncio.run_coroutine_threadsafe(start(body), loop).result(10) for body in answers]
    try:
        yield [f"http://127.0.0.1:{runner.addresses[0][1]}" for runner in runners]
    finally:
        for runner in runners:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _peer(name: str, sha256: str, http_addr: str = "http://127.0.0.1:9") -> PeerRecord:
    return PeerRecord(peer_id=name, state="training", model_hash="m", recipe_sha256=sha256, http_addr=http_addr)


def test_a_record_carries_the_recipes_hash_and_a_joiner_reads_the_fields_only_when_it_differs():
    """Issue 60: the recipe's JSON was a fifth of every record, and every read of the membership
    brings every record back. A record carries its sha256; a joiner whose hash is not the swarm's
    reads the JSON from a holder's sidecar (it must hash to the signed record's value), names the
    fields that differ, and joins when the values are its own in another version's JSON."""
    ours, other = _recipe(), _recipe(outer_lr=0.5, inner_steps=50)
    foreign = other.to_record()[:-1] + ', "a_field_of_a_later_version": 1}'  # other's values, another JSON
    same_values = ours.to_record()[:-1] + ', "a_field_of_a_later_version": 1}'
    sha = {
        t: SwarmRecipe.from_record(t) and __import__("hashlib").sha256(t.encode()).hexdigest()
        for t in (foreign, same_values)
    }
    assert PeerRecord(peer_id="p", recipe_sha256=ours.sha256).recipe_sha256 == ours.sha256

    def check(view: dict[str, PeerRecord], reader: RecipeReader | None = None) -> None:
        asyncio.run(check_same_recipe(view, "me", "m", ours, reader or RecipeReader(None, timeout=2.0)))

    # a liar serves this node's own recipe as the swarm's: taken, it would let this node in
    with _sidecars([other.to_record(), ours.to_record(), foreign, same_values]) as (a, liar, b, c):
        # one peer that trains with ours is enough; peers of another model or none said are not counted
        check({"x": _peer("x", other.sha256), "y": _peer("y", ours.sha256), "z": _peer("z", "")})
        check({"x": _peer("x", "", a), "w": PeerRecord(peer_id="w", model_hash="other", recipe_sha256=other.sha256)})
        with pytest.raises(RecipeMismatch) as refused:
            check({"x": _peer("x", other.sha256, liar), "y": _peer("y", other.sha256, a), "z": _peer("z", "0" * 64)})
        assert "(2 peer(s))" in str(refused.value)
        assert "inner_steps: this node 20, the swarm 50 (set by --inner-steps)" in str(refused.value)
        assert "outer_lr: this node " in str(refused.value)
        with pytest.raises(RecipeMismatch) as refused:  # every holder's answer hashes to something else
            check({"x": _peer("x", other.sha256, liar), "y": _peer("y", other.sha256, "http://127.0.0.1:9")})
        assert "their sidecars did not say" in str(refused.value) and "inner_steps" not in str(refused.value)
        with pytest.raises(RecipeMismatch) as refused:  # another version's JSON of other values
            check({"x": _peer("x", sha[foreign], b)})
        assert "inner_steps: this node 20, the swarm 50" in str(refused.value)
        reader = RecipeReader(None, timeout=2.0)
        check({"x": _peer("x", sha[same_values], c)}, reader)  # our values in another version's JSON
    check({"x": _peer("x", sha[same_values], c)}, reader)  # read once: its sidecar is gone now


def test_a_record_of_before_the_inner_optimizer_field_is_adamws_and_adamw_is_carried_by_the_join_line():
    """Muon is the default; a swarm of AdamW (one started before, or by choice) prints it in its
    join line and a joiner by sidecar takes it."""
    legacy = {k: v for k, v in _recipe().model_dump().items() if k != "inner_optimizer"}
    assert SwarmRecipe.model_validate(legacy).inner_optimizer == "adamw"
    assert _recipe().inner_optimizer == "muon" and recipe_flags(_recipe(), None) == ["--seq-len", "64"]
    assert recipe_flags(_recipe(inner_optimizer="adamw"), None) == ["--seq-len", "64", "--inner-optimizer", "adamw"]
    assert adopted_settings(NodeSettings(), _recipe(inner_optimizer="adamw")) == {
        "inner_optimizer": "adamw",
        "seq_len": 64,
    }
    assert SwarmRecipe.from_record(_recipe().to_record().replace('"muon"', '"lion"')) is None  # unreadable


def test_only_fields_not_given_are_adopted():
    theirs = _recipe(inner_steps=50, outer_lr=0.5, seq_len=24)
    given = NodeSettings(inner_steps=30)
    assert adopted_settings(given, theirs) == {"outer_lr": 0.5, "seq_len": 24}


def test_a_swarm_of_another_wire_protocol_is_refused_with_both_versions_named():
    """Peers of two data-plane protocols (two dtnode versions) cannot average: each refuses the
    other's chunks. A joiner finds out at the door, in one line, not part after part."""
    ours = recipe_of(NodeSettings(), 64, "synthetic (seed 0)")
    assert ours.wire_protocol == wire.PROTOCOL
    older = ours.model_copy(update={"wire_protocol": 1})
    legacy = {k: v for k, v in ours.model_dump().items() if k != "wire_protocol"}  # a record of before the field
    assert SwarmRecipe.model_validate(legacy).wire_protocol == 1

    def peer(name: str, recipe: SwarmRecipe | None, version: str = "0.0.9") -> PeerRecord:
        return PeerRecord(peer_id=name, version=version, wire_protocol=recipe.wire_protocol if recipe else 0)

    with pytest.raises(JoinError) as refused:
        check_same_protocol([peer("a", older), peer("b", older), peer("c", None)])
    assert "data-plane protocol 1 (2 peer(s), dtnode 0.0.9)" in str(refused.value)
    assert f"this node with protocol {wire.PROTOCOL}" in str(refused.value)
    check_same_protocol([peer("a", older), peer("b", ours)])  # one peer speaks ours: a group can form
    check_same_protocol([peer("c", None), peer("b", ours)])
    check_same_protocol([])
    # a record that names no protocol is an older dtnode's (before records carried only the
    # recipe's hash and the certificate's signature): neither side could learn the other's certificate
    with pytest.raises(JoinError) as refused:
        check_same_protocol([peer("c", None), peer("d", None)])
    assert "an older record format that names no data-plane protocol (2 peer(s), dtnode 0.0.9)" in str(refused.value)
    # it names the version, not a flag; and a joiner never takes it from a peer's recipe
    (difference,) = differences(ours, older)
    assert difference.line().startswith(
        f"  wire_protocol: this node {wire.PROTOCOL}, the swarm 1 (set by the dtnode version"
    )
    assert "wire_protocol" not in adopted_settings(NodeSettings(), older)
    assert not any("protocol" in f for f in recipe_flags(older, None))


def test_join_flags_carry_every_non_default_field_and_the_data(tmp_path):
    flags = recipe_flags(_recipe(inner_steps=50, overlap=True, round_seconds=30.0), tmp_path / "d.txt")
    assert flags == ["--seq-len", "64", "--inner-steps", "50", "--round-seconds", "30", "--overlap"] + [
        "--data",
        str(tmp_path / "d.txt"),
    ]


def test_a_joiner_with_other_data_h_and_seq_len_is_refused_with_the_fields_named(a, tmp_path):
    other = _text(tmp_path / "other.txt", 2)
    b = NodeProcess.join(
        "b", tmp_path, *NOT_RECIPE, "--inner-steps", "9", "--seq-len", "16", "--warmup-steps", "5",
        "--run-id", "recipe-test", "--data", str(other), "--peer", a.join_address, "--inner-optimizer", "adamw",
    )  # fmt: skip
    assert b.wait(120) == EXIT_MISMATCH, b.output
    _keep(b)
    assert "recipe differs from the swarm's (1 peer(s))" in b.output
    for field, ours, theirs in (("inner_steps", "9", "12"), ("seq_len", "16", "24")):
        assert f"{field}: this node {ours}, the swarm {theirs} (set by --{field.replace('_', '-')})" in b.output
    assert "data: this node '" in b.output and "(set by --data" in b.output
    assert "inner_optimizer: this node 'adamw', the swarm 'muon' (set by --inner-optimizer)" in b.output
    assert "Traceback" not in b.output


@pytest.mark.long_swarms  # about 12 s: outside the default suite's 10 minutes, run by .ci/run
def test_the_printed_join_line_pasted_joins_with_the_same_recipe(a, tmp_path):
    line = a.status()["join_command"]
    words = shlex.split(line)
    assert words[:3] == ["dtnode", "join", "--peer"] and "--data" in words, line
    # /status names the file, not where it lies on a's host (issue 56, finding 12): b brings its copy
    assert words[words.index("--data") + 1] == "corpus.txt"
    words[words.index("--data") + 1] = str(DATA_OF_A)
    b = NodeProcess.join("b", tmp_path, *NOT_RECIPE, *words[2:])
    try:
        wait_until(lambda: any(r["groups"] == [[2, 2]] for r in b.rounds), 180, "a round of b with a")
        assert b.status()["recipe"] == a.status()["recipe"]
    finally:
        b.stop()
        assert b.wait(60) == 0, b.output
        _keep(b)
    assert "Traceback" not in b.output


def test_a_joiner_through_a_sidecar_address_takes_the_recipe_and_brings_only_its_data(a, tmp_path):
    data = str(DATA_OF_A)  # its own copy of the same file (here the very one)
    c = NodeProcess.join("c", tmp_path, *NOT_RECIPE, "--peer", a.http_url, "--data", data)
    try:
        wait_until(lambda: any(r["groups"] == [[2, 2]] for r in c.rounds), 180, "a round of c with a")
        status = c.status()
        assert status["recipe"] == a.status()["recipe"] and status["run_id"] == "recipe-test"
        assert "taking the swarm's settings from http://" in c.output
    finally:
        c.stop()
        assert c.wait(60) == 0, c.output
        _keep(c)
    assert "Traceback" not in c.output


def test_a_wrong_run_id_against_a_sidecar_peer_exits_with_both_run_ids(a, tmp_path):
    d = NodeProcess.join("d", tmp_path, *NOT_RECIPE, "--run-id", "another-run", "--peer", a.http_url)
    assert d.wait(60) == EXIT_MISMATCH, d.output
    assert "--run-id another-run: the peer at http://" in d.output and "trains run 'recipe-test'" in d.output
    assert "Traceback" not in d.output


@pytest.mark.parametrize(
    "value,taken",
    [(30, 30), (None, None), (True, None), (0, None), (-5, None), ("30", None), (1 << 63, None), (3.0, None)],
)
def test_a_peers_run_end_is_taken_only_when_well_formed(value, taken):
    """A joiner by sidecar address takes the run's --max-rounds from the peer it names, as it
    takes the recipe: without it, it trained on alone once the swarm had stopped."""
    from dtnode.daemon.workload.recipe import _run_end

    assert _run_end({"max_rounds": value}) == taken
