"""The Hugging Face workflow: a tokenizer trained here, data in jsonl/parquet/bin, a transformers
model trained by a real 2-node swarm, exported and loaded with from_pretrained."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from nodes import FAST, NodeProcess

from dtnode.daemon.checkpoints.file_format import (
    Layout,
    LocalState,
    TrainingState,
    checkpoint_path,
    read_checkpoint,
    read_local_state,
    write_checkpoint,
)
from dtnode.daemon.cli.export import export_checkpoint
from dtnode.daemon.cli.main import EXIT_MISMATCH
from dtnode.daemon.config.settings import SettingsError, load_settings
from dtnode.daemon.training.outer_replica import Replica
from dtnode.daemon.training.schedule import LearningRateSchedule
from dtnode.daemon.training.trainer import Trainer
from dtnode.daemon.workload.corpus import LLMC_MAGIC
from dtnode.daemon.workload.data import DataStream, check_token_ids, open_sources, stable_seed
from dtnode.daemon.workload.model import build_model, config_hash, export_format
from dtnode.daemon.workload.sources import write_bin
from dtnode.daemon.workload.tokenizer import LocalTokenizer, check_vocabulary
from dtnode.ops.flat import FlatParameters


def _stdlib_documents(count: int = 40) -> list[str]:
    """Real text: modules of this Python's standard library, one document each."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.glob("*.py") if 2_000 < p.stat().st_size < 40_000)[:count]
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> dict[str, Path]:
    """A BPE tokenizer trained on local text, a tiny Llama config sized to it, and the text as jsonl."""
    root = tmp_path_factory.mktemp("hf")
    docs = _stdlib_documents()
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(docs, trainer)
    tok_dir = root / "tokenizer"
    tok_dir.mkdir()
    tokenizer.save(str(tok_dir / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size()
    model_dir = root / "llama"
    transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    ).save_pretrained(model_dir)
    jsonl = root / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return {"root": root, "tokenizer": tok_dir, "model": model_dir, "jsonl": jsonl, "docs": docs}


def _parquet(path: Path, docs: list[str]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": docs}), path)
    return path


def _bin(path: Path, tokens: np.ndarray) -> Path:
    write_bin(path, iter([tokens]), np.uint16)
    return path


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "bin"])
def test_sources_give_peers_disjoint_ordered_shards_and_the_position_survives_a_restart(workspace, tmp_path, kind):
    tok = LocalTokenizer(workspace["tokenizer"])
    field = "text"
    if kind == "jsonl":
        data = workspace["jsonl"]
    elif kind == "parquet":
        data, field = _parquet(tmp_path / "corpus.parquet", workspace["docs"]), "body"
    else:
        data = _bin(tmp_path / "corpus.bin", np.arange(60_000) % 400)
        assert np.fromfile(data, np.int32, 1)[0] == LLMC_MAGIC  # llm.c's header, read back by its magic
    sources = open_sources(
        "run",
        0,
        data,
        None,
        eval_fraction=0.0,
        seq_len=32,
        tokenizer=tok,
        text_field=field,
        cache_dir=tmp_path / "cache",
    )
    corpus = sources.train
    a, b = (DataStream(sources, "run", peer, 4, 32) for peer in ("peer-a", "peer-b"))
    drawn = {}
    for name, stream in (("a", a), ("b", b)):
        drawn[name] = [stream.next_batch() for _ in range(5)]
        windows = [stream.reader.window_index(i) for i in range(20)]
        for i, row in enumerate(torch.cat(drawn[name])):  # each row is the corpus window read at that position
            assert torch.equal(row, torch.from_numpy(corpus.window(windows[i] * stream.reader.stride, 33)))
        drawn[name + "-windows"] = set(windows)
    assert not drawn["a-windows"] & drawn["b-windows"]  # disjoint shards
    epoch = {a.reader.window_index(i) for i in range(a.reader.windows)}
    assert len(epoch) == a.reader.windows  # one epoch reads every window once: no draws with replacement

    # the position goes into the node's own checkpoint and comes back after a restart
    layout = Layout(("w",), ((4,),))
    generator, sequences = a.position()
    zeros = torch.zeros(4)
    local = LocalState(
        zeros, zeros, generator, inner_step=5, adam_steps=5, batches_drawn=sequences // 4, sequences_drawn=sequences
    )
    write_checkpoint(
        tmp_path / "state", 1, layout, TrainingState(zeros, zeros, local), {"run_id": "run", "model_hash": "m"}
    )
    restored = read_local_state(tmp_path / "state", 1, layout, "run", "m")
    again = DataStream(
        open_sources(
            "run",
            0,
            data,
            None,
            eval_fraction=0.0,
            seq_len=32,
            tokenizer=tok,
            text_field=field,
            cache_dir=tmp_path / "cache",
        ),
        "run",
        "peer-a",
        4,
        32,
    )
    assert restored.sequences_drawn == sequences
    again.seek(restored.generator_state, restored.sequences_drawn)
    assert torch.equal(again.next_batch(), a.next_batch())


def test_held_out_documents_are_never_trained_on(tmp_path):
    corpus = tmp_path / "docs"
    corpus.mkdir()
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    for i, letter in enumerate(letters):  # each document one letter: a window shows its documents
        (corpus / f"doc{i:02d}.txt").write_text(letter * 300)
    sources = open_sources("run", 0, corpus, None, eval_fraction=0.3, seq_len=16, cache_dir=tmp_path / "cache")
    stream = DataStream(sources, "run", "peer", 8, 16, eval_sequences=32)
    trained = set()
    for _ in range(stream.reader.windows // 8 + 1):  # a whole epoch
        trained |= set(stream.next_batch().unique().tolist())
    held = set(stream.eval_set.unique().tolist())
    newline = ord("\n")
    assert trained - {newline} and held - {newline}
    assert not (trained & held) - {newline}  # no held-out document's byte reaches training
    assert (trained | held) - {newline} == set(letters.encode())  # every document is in one part or the other
    # a fraction under one document: the document of lowest hash is held out, whole
    few = open_sources("run", 0, corpus, None, eval_fraction=0.001, seq_len=16, cache_dir=tmp_path / "cache2")
    assert few.eval is not None and len(set(few.eval.tokens.tolist()) - {newline}) == 1
    assert not set(few.eval.tokens.tolist()) - {newline} & set(few.train.tokens.tolist())
    bad = tmp_path / "rows.jsonl"
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(SettingsError, match="--data.*no field 'text'.*--text-field"):
        open_sources("run", 0, bad, None, seq_len=16, cache_dir=tmp_path / "cache3")


FROZEN_MODEL = """
import torch
class FrozenAndNormed(torch.nn.Module):
    vocab_size = 256
    context_length = 16
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(256, 16)
        self.embed.weight.requires_grad_(False)
        self.mix = torch.nn.Linear(16, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(16, 256)
    def forward(self, tokens):
        x = self.mix(self.embed(tokens))
        x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        return self.head(torch.relu(x))
def make():
    return FrozenAndNormed()
"""


def _trainer(seed_peer: str, data: Path) -> Trainer:
    model, _ = build_model("frozen_models:make", seed=3)
    stream = DataStream(open_sources("run", 0, data, None, seq_len=16), "run", seed_peer, 4, 16)
    return Trainer(
        model, stream, torch.device("cpu"), schedule=LearningRateSchedule(1e-2), weight_decay=0.1, grad_clip=1.0
    )


def test_frozen_parameters_and_buffers_train_and_resume_with_aligned_optimizer_state(tmp_path, monkeypatch):
    (tmp_path / "frozen_models.py").write_text(FROZEN_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "text.txt"
    data.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    trainer = _trainer("a", data)
    model = trainer.model
    frozen_before = model.embed.weight.detach().clone()
    assert "embed.weight" not in trainer.flat.names  # frozen: not averaged
    assert {"norm.running_mean", "norm.running_var"} <= set(trainer.flat.names)  # learned buffers: averaged
    trainer.run(4, threading.Event())
    assert torch.equal(model.embed.weight, frozen_before) and model.embed.weight not in trainer.optimizer.state
    views = trainer.flat.views(trainer.parameters_flat)
    assert torch.equal(views["norm.running_mean"], model.norm.running_mean)  # the buffer lives in the flat buffer
    assert not torch.equal(model.norm.running_mean, torch.zeros(16))  # ...and training moved it

    replica = Replica(trainer, outer_lr=0.7, outer_momentum=0.9)
    delta = replica.pseudo_gradient().clone()
    replica.apply_outer_step(delta)  # a group of one applies its own Δ: θ_g (buffers too) takes the round
    torch.testing.assert_close(replica.theta_g, trainer.parameters_flat)

    exp_avg, exp_avg_sq, _steps = trainer.inner_state()
    layout = Layout(tuple(trainer.flat.names), tuple(trainer.flat.shapes))
    gen, batches = trainer.stream.position()
    local = LocalState(exp_avg, exp_avg_sq, gen, trainer.inner_step, trainer.adam_steps, batches)
    write_checkpoint(
        tmp_path / "state",
        1,
        layout,
        TrainingState(replica.theta_g, replica.outer.momentum_buffer, local),
        {"run_id": "run", "model_hash": "m"},
    )
    restored = read_local_state(tmp_path / "state", 1, layout, "run", "m")
    loaded = read_checkpoint(checkpoint_path(tmp_path / "state", 1), layout, "run", "m")

    resumed = _trainer("a", data)
    Replica(resumed, 0.7, 0.9).load(loaded.theta_g, loaded.momentum, 1)
    resumed.load_inner_state(restored.exp_avg, restored.exp_avg_sq, restored.adam_steps)
    for (name, p), (_, q) in zip(trainer.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(p, q), name
        if p.requires_grad:  # each parameter gets its own moments back, not a neighbour's
            assert torch.equal(trainer.optimizer.state[p]["exp_avg"], resumed.optimizer.state[q]["exp_avg"]), name
            assert torch.equal(trainer.optimizer.state[p]["exp_avg_sq"], resumed.optimizer.state[q]["exp_avg_sq"]), name
        else:
            assert q not in resumed.optimizer.state
    assert torch.equal(resumed.model.norm.running_var, trainer.model.norm.running_var)
    resumed.run(2, threading.Event())  # and it trains on


def test_a_preset_exports_as_gpt2_with_a_byte_tokenizer(tmp_path):
    model, description = build_model("tiny", seed=11)
    flat = FlatParameters(model.named_parameters())
    flat.buffer.add_(torch.randn(flat.numel) * 0.01)  # "trained" weights, not the seeded init
    layout = Layout(tuple(flat.names), tuple(flat.shapes))
    meta = {
        "run_id": "run",
        "model_hash": config_hash(description),
        "model": "tiny",
        "model_config": json.dumps(description, sort_keys=True),
        "init_seed": "11",
    }
    write_checkpoint(tmp_path / "state", 7, layout, TrainingState(flat.buffer, torch.zeros(flat.numel)), meta)
    out = export_checkpoint(tmp_path / "state", tmp_path / "out")
    assert export_format(description) == "transformers:gpt2"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = "héllo, wörld"
    ids = tokenizer(text)["input_ids"]
    assert ids == list(text.encode())  # the byte-level run's ids are bytes
    batch = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=batch).logits, model.eval()(batch), rtol=0, atol=1e-5)
    assert json.loads((out / "dtnode_export.json").read_text())["outer_step"] == 7
    with pytest.raises(SettingsError, match="--step.*no checkpoint of outer step 3"):
        export_checkpoint(tmp_path / "state", tmp_path / "out2", step=3)


@pytest.mark.long_swarms  # 41 s; out of the default suite's 10 minutes (.ci/hf-floor runs it too)
def test_a_transformers_swarm_trains_exports_and_refuses_another_model(workspace, tmp_path):
    common = [
        *FAST,
        "--model",
        f"hf:{workspace['model']}",
        "--tokenizer",
        str(workspace["tokenizer"]),
        "--data",
        str(workspace["jsonl"]),
        "--eval-fraction",
        "0.1",
        "--max-rounds",
        "4",
        "--inner-steps",
        "8",
        "--min-peers",
        "2",
    ]
    a = NodeProcess.join("a", tmp_path, *common, "--join-timeout", "90")
    nodes = [a]
    try:
        address = a.join_address  # a waits for a second peer of its model (--min-peers 2)...
        stranger = NodeProcess.join("c", tmp_path, "--model", "tiny", "--peer", address)  # ...not this one
        nodes.append(stranger)
        b = NodeProcess.join("b", tmp_path, *common, "--peer", address)
        nodes.append(b)
        assert stranger.wait(120) == EXIT_MISMATCH, stranger.output[-3000:]
        assert "this swarm trains model config" in stranger.output and a.get("/status")["model_hash"] in stranger.output
        for node in (a, b):
            assert node.wait(300) == 0, node.output[-3000:]
    finally:
        for node in nodes:
            node.kill()
    for node in (a, b):  # the two averaged together (the stranger was kept out)
        assert any(r["groups"] == [[2, 2]] for r in node.rounds), node.rounds
    for node in (a, b):
        assert "Traceback" not in node.output, node.output

    out = tmp_path / "export"
    # no --tokenizer: export takes the one the node noted in its state dir
    done = subprocess.run(
        [sys.executable, "-m", "dtnode", "export", "--state-dir", str(a.state_dir), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    info = json.loads((out / "dtnode_export.json").read_text())
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = workspace["docs"][0][:200]
    ids = tokenizer(text)["input_ids"]
    assert ids == LocalTokenizer(workspace["tokenizer"])._tokenizer.encode(text, add_special_tokens=False).ids
    # the end token training appended to every document is eos in the tokenizer and both configs
    # (not LlamaConfig's default eos 2, an ordinary token of this vocabulary); no bos or pad of
    # its own here, so both are eos
    end = tokenizer.convert_tokens_to_ids("</s>")
    assert tokenizer.eos_token == "</s>" and tokenizer.bos_token == "</s>" and tokenizer.pad_token == "</s>"
    assert hf.config.eos_token_id == hf.config.bos_token_id == hf.config.pad_token_id == end
    assert hf.generation_config.eos_token_id == end
    quote = tokenizer.convert_tokens_to_ids('"')
    prompt = torch.tensor([ids[:16]])
    forced = hf.generate(  # a quotation mark first, then free: it runs on past it
        prompt,
        max_new_tokens=8,
        do_sample=False,
        prefix_allowed_tokens_fn=lambda _b, seq: [quote] if len(seq) == 16 else list(range(hf.config.vocab_size)),
        bad_words_ids=[[end]],
    )
    assert forced.shape[1] == 16 + 8 and forced[0, 16] == quote

    # dtnode's own model with θ_g from the checkpoint, read as a node reads one
    model, description = build_model(f"hf:{workspace['model']}", seed=0)
    description["tokenizer"] = LocalTokenizer(workspace["tokenizer"]).sha256
    flat = FlatParameters(model.named_parameters())
    loaded = read_checkpoint(
        checkpoint_path(a.state_dir, info["outer_step"]),
        Layout(tuple(flat.names), tuple(flat.shapes)),
        "dtnode-demo",
        config_hash(description),
    )
    flat.buffer.copy_(loaded.theta_g)
    batch = torch.tensor([ids[:64]])
    with torch.no_grad():
        ours = model.eval()(batch)
        theirs = hf.eval()(input_ids=batch).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    init = build_model(f"hf:{workspace['model']}", seed=stable_seed("dtnode-demo", 0, "init"))[0]
    assert info["outer_step"] >= 1 and not torch.equal(loaded.theta_g, FlatParameters(init.named_parameters()).buffer)


def test_hf_models_start_from_safetensors_weights_and_bad_inputs_fail_clearly(workspace, tmp_path):
    config = transformers.AutoConfig.from_pretrained(workspace["model"])
    trained = transformers.AutoModelForCausalLM.from_config(config)
    with_weights = tmp_path / "with-weights"
    trained.save_pretrained(with_weights, safe_serialization=True)
    model, description = build_model(f"hf:{with_weights}", seed=123)
    assert all(torch.equal(p, q) for p, q in zip(model.hf.parameters(), trained.parameters()))  # not the seed's init
    assert description["weights"] and config_hash(description) != config_hash(
        build_model(f"hf:{workspace['model']}", 123)[1]
    )

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((workspace["model"] / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError, match="pickled weights.*safetensors only"):
        build_model(f"hf:{pickled}", seed=0)
    with pytest.raises(SettingsError, match="--model.*no-such-dir is not a directory with a config.json"):
        load_settings({"model": f"hf:{tmp_path / 'no-such-dir'}"})

    with pytest.raises(SettingsError, match="--tokenizer.*400 ids do not fit the model's vocabulary of 256"):
        check_vocabulary(LocalTokenizer(workspace["tokenizer"]), 256)
    ids = _bin(tmp_path / "ids.bin", np.array([1, 2, 999, 3] * 50))
    corpus = open_sources("run", 0, ids, None, seq_len=8).train
    with pytest.raises(SettingsError, match="--data.*holds token id 999, outside the model's vocabulary of 400"):
        check_token_ids(corpus, 400, "--data")
    with pytest.raises(SettingsError, match="--data.*its header says uint16, --data-dtype says uint32"):
        open_sources("run", 0, ids, None, seq_len=8, data_dtype="uint32")
    raw = tmp_path / "raw.bin"  # nanoGPT style, no header
    raw.write_bytes(np.arange(3, dtype=np.uint16).tobytes())
    with pytest.raises(SettingsError, match="--data.*6 bytes is not a whole number of uint32 ids"):
        open_sources("run", 0, raw, None, seq_len=2, data_dtype="uint32")


def _hub_cache(cache: Path, repo_id: str, model_dir: Path) -> Path:
    """A Hugging Face Hub cache holding one model, laid out as huggingface_hub writes it
    (refs/main naming a snapshot), built here: nothing is fetched."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in model_dir.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_a_hub_id_is_read_through_the_hugging_face_cache(workspace, tmp_path, monkeypatch):
    """`--model hf:gpt2` was refused: only local directories. A Hub id now resolves through
    huggingface_hub's cache; offline (HF_HUB_OFFLINE=1), a model the cache lacks is one clear
    error, and a Hub id builds the very model its directory builds."""
    from huggingface_hub import constants

    from dtnode.daemon.workload.hf_model import HFModelError, is_hub_id

    cache = tmp_path / "hub"
    _hub_cache(cache, "test-org/tiny-llama", workspace["model"])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert is_hub_id("test-org/tiny-llama") and is_hub_id("gpt2") and is_hub_id("org/name@v1.0")
    assert not is_hub_id(str(workspace["model"])) and not is_hub_id("../up") and not is_hub_id("/abs/path")
    assert load_settings({"model": "hf:test-org/tiny-llama"}).workload.model == "hf:test-org/tiny-llama"
    _, from_hub = build_model("hf:test-org/tiny-llama", seed=5)
    _, from_dir = build_model(f"hf:{workspace['model']}", seed=5)
    assert config_hash(from_hub) == config_hash(from_dir)
    with pytest.raises(HFModelError, match="other-org/missing is not in the Hugging Face cache"):
        build_model("hf:other-org/missing", seed=0)
    with pytest.raises(SettingsError, match="not a directory with a config.json.*nor a Hugging Face Hub id"):
        load_settings({"model": "hf:no such/thing/at all"})


def test_a_small_dataset_is_never_refused_for_its_size(tmp_path, caplog):
    """50 documents at the default --eval-fraction (0.01: half a document) hold out whole
    documents of lowest hash, enough for one sequence; 3 documents cannot spare one (a third
    of the data), so the node trains on all of them without an eval loss, and says so."""
    import logging

    def jsonl(path, count: int) -> None:
        rows = [json.dumps({"text": f"document {i}: " + "lorem ipsum dolor sit amet " * 40}) for i in range(count)]
        path.write_text("\n".join(rows) + "\n")

    fifty, three = tmp_path / "fifty.jsonl", tmp_path / "three.jsonl"
    jsonl(fifty, 50)
    jsonl(three, 3)
    sources = open_sources("run", 0, fifty, None, eval_fraction=0.01, seq_len=64, cache_dir=tmp_path / "c1")
    assert sources.eval is not None and len(sources.eval) >= 65
    assert len(sources.eval) <= 0.2 * (len(sources.eval) + len(sources.train))
    with caplog.at_level(logging.WARNING):
        small = open_sources("run", 0, three, None, eval_fraction=0.01, seq_len=64, cache_dir=tmp_path / "c2")
    assert small.eval is None and len(small.train) > 3 * 1000
    assert "too small to hold out even one document" in caplog.text and "training without an eval loss" in caplog.text


@pytest.mark.parametrize("name", ["rows.jsonl.gz", "table.csv", "data.arrow"])
def test_an_unknown_data_file_is_refused_with_the_known_types(tmp_path, name):
    data = tmp_path / "data"
    data.mkdir()
    (data / "ok.txt").write_text("some text\n" * 50)
    (data / name).write_bytes(b"\x1f\x8b not text")
    for source in (data, data / name):
        with pytest.raises(SettingsError, match=r"--data: .*unknown data type.*known: text \(.*\.jsonl.*\.bin"):
            open_sources("run", 0, source, None, seq_len=16, cache_dir=tmp_path / "cache")
