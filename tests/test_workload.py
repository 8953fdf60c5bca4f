import logging
import math

import pytest
import torch

from dtnode.daemon.config.settings import SettingsError, load_settings
from dtnode.daemon.training.schedule import LearningRateSchedule
from dtnode.daemon.workload.corpus import CorpusReader, TokenCorpus
from dtnode.daemon.workload.data import DataSources, DataStream, MarkovLanguage, open_sources
from dtnode.daemon.workload.model import GPT, PRESETS, build_model, config_hash


def test_markov_floor_is_the_empirical_cross_entropy():
    lang = MarkovLanguage(seed=3)
    tokens = lang.sample(256, 257, torch.Generator().manual_seed(0))
    probs = lang.transitions[tokens[:, :-1], tokens[:, 1:]]
    empirical = float(-probs.log().mean())
    assert math.isclose(empirical, lang.entropy_rate, rel_tol=0.05)
    assert 0.5 < lang.entropy_rate < math.log(256)


def _sample_by_searching_whole_rows(lang: MarkovLanguage, batch: int, length: int, gen: torch.Generator):
    """The sampler as it was: a search of the whole cumulative row for every token."""
    tokens = torch.empty(batch, length, dtype=torch.int64)
    tokens[:, 0] = torch.multinomial(lang.stationary.float(), batch, replacement=True, generator=gen)
    draws = torch.rand(length, batch, 1, generator=gen)
    for t in range(1, length):
        rows = lang.cumulative[tokens[:, t - 1]]
        tokens[:, t] = torch.searchsorted(rows, draws[t]).squeeze(1).clamp_max(lang.vocab_size - 1)
    return tokens


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_the_sampler_draws_the_tokens_a_search_of_the_whole_row_draws(seed, monkeypatch):
    """The levels sampler is an optimisation only: every peer's batches, the eval set and a
    resumed data position stay what they were, token for token. Also at the draws that land on
    a row's edges (0.0, a level's value exactly, and just under 1.0, where float32 rounding
    leaves the row's last successor below the draw), which a few draws in a batch hit."""
    lang = MarkovLanguage(seed=seed)
    for batch, length, draw_seed in ((16, 1025, 0), (3, 40, 5), (64, 33, 9)):
        new = lang.sample(batch, length, torch.Generator().manual_seed(draw_seed))
        old = _sample_by_searching_whole_rows(lang, batch, length, torch.Generator().manual_seed(draw_seed))
        assert torch.equal(new, old)
    edges = torch.tensor([0.0, float(lang.cumulative[5][lang.cumulative[5] > 0][0]), 1.0 - 2**-24, 0.5])
    real_rand = torch.rand

    def edge_draws(*shape, generator=None):
        return edges[torch.randint(len(edges), shape, generator=generator)]

    monkeypatch.setattr(torch, "rand", edge_draws)
    new = lang.sample(32, 200, torch.Generator().manual_seed(3))
    old = _sample_by_searching_whole_rows(lang, 32, 200, torch.Generator().manual_seed(3))
    monkeypatch.setattr(torch, "rand", real_rand)
    assert torch.equal(new, old)


def test_peers_draw_different_streams_but_share_the_eval_batch():
    lang = MarkovLanguage(seed=1)
    a = DataStream(DataSources(lang, lang), "run", "peer-a", 4, 16)
    b = DataStream(DataSources(lang, lang), "run", "peer-b", 4, 16)
    assert not torch.equal(a.next_batch(), b.next_batch())
    assert torch.equal(a.eval_set, b.eval_set) and a.eval_set.shape == (64, 17)
    assert a.next_batch().shape == (4, 17)


def test_a_batch_drawn_ahead_changes_neither_the_order_nor_the_saved_position(tmp_path):
    """DataStream.prefetch (a GPU trainer draws the next batch while the device runs a step):
    the same batches in the same order, and a position saved between the draw and its use
    resumes with that very batch, on the synthetic language and on a corpus alike."""
    (tmp_path / "train.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    lang = MarkovLanguage(seed=1)
    for sources in (
        DataSources(lang, lang),
        open_sources("run", 0, tmp_path / "train.txt", None, eval_fraction=0.1, seq_len=16),
    ):
        plain = DataStream(sources, "run", "peer", 4, 16)
        expected = [plain.next_batch() for _ in range(6)]
        ahead = DataStream(sources, "run", "peer", 4, 16)
        got = []
        for i in range(6):
            got.append(ahead.next_batch())
            ahead.prefetch()
            ahead.prefetch()  # a second call draws nothing more
            if i == 2:
                state, sequences = ahead.position()
                assert sequences == 12
                resumed = DataStream(sources, "run", "peer", 4, 16)
                resumed.seek(state, sequences)
                assert torch.equal(resumed.next_batch(), expected[3])
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        ahead.seek(*plain.position())  # a seek drops the batch drawn ahead
        assert torch.equal(ahead.next_batch(), plain.next_batch())


def test_text_file_gives_byte_tokens(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("héllo wörld " * 100, encoding="utf-8")
    train = open_sources("run", 0, path, None, eval_fraction=0.0).train
    assert isinstance(train, TokenCorpus)
    batch = CorpusReader(train, 10, "run", "peer").batch(0, 3)
    raw = path.read_bytes()
    assert batch.dtype == torch.int64 and batch.shape == (3, 10)
    for row in batch:
        assert bytes(row.tolist()) in raw
    with pytest.raises(SettingsError, match="--data"):
        load_settings({"data": str(tmp_path / "missing.txt")})


def test_presets_sizes_and_forward():
    counts = {}
    for name, cfg in PRESETS.items():
        with torch.device("meta"):
            counts[name] = sum(p.numel() for p in GPT(cfg).parameters())
    assert counts["tiny"] < 1e6 and 20e6 < counts["small"] < 30e6 and 110e6 < counts["base"] < 140e6
    model, description = build_model("tiny", seed=7)
    again, _ = build_model("tiny", seed=7)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))  # swarm-identical init
    logits = model(torch.randint(0, 256, (2, 16)))
    assert logits.shape == (2, 16, 256)
    with torch.device("meta"):
        small_description = build_model("small", seed=7)[1]
    assert config_hash(description) != config_hash(small_description)


def test_custom_model_factory(tmp_path, monkeypatch):
    (tmp_path / "mymodels.py").write_text(
        "import torch\n"
        "class Bigram(torch.nn.Module):\n"
        "    vocab_size = 256\n    context_length = 32\n"
        "    def __init__(self):\n        super().__init__(); self.table = torch.nn.Embedding(256, 256)\n"
        "    def forward(self, x):\n        return self.table(x)\n"
        "def make():\n    return Bigram()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    model, description = build_model("mymodels:make", seed=0)
    assert description["factory"] == "mymodels:make" and model.context_length == 32


def _two_alphabets(path, train_bytes: int, held_out_bytes: int) -> None:
    """Lower-case text, then upper-case text: any window shows which part it came from."""
    body = (b"the quick brown fox jumps over the lazy dog " * (train_bytes // 44 + 1))[:train_bytes]
    tail = (b"PACK MY BOX WITH FIVE DOZEN LIQUOR JUGS " * (held_out_bytes // 40 + 1))[:held_out_bytes]
    path.write_bytes(body + tail)


def _bytes_of(t: torch.Tensor) -> set[int]:
    return set(t.unique().tolist())


UPPER, LOWER = set(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ"), set(b"abcdefghijklmnopqrstuvwxyz")


def test_eval_never_reads_training_data(tmp_path):
    path = tmp_path / "corpus.txt"
    _two_alphabets(path, 9_000, 1_000)
    sources = open_sources("run", 0, path, None, eval_fraction=0.1, seq_len=32)
    stream = DataStream(sources, "run", "peer-a", 64, 32)
    drawn = set().union(*(_bytes_of(stream.next_batch()) for _ in range(300)))  # ~600k window bytes
    assert drawn & LOWER and not drawn & UPPER  # training never reads the held-out tail...
    assert _bytes_of(stream.eval_set) & UPPER and not _bytes_of(stream.eval_set) & LOWER  # ...eval reads only it
    assert stream.eval_set.shape == (64, 33)
    assert (len(sources.train), len(sources.eval)) == (9_000, 1_000)  # a boundary, not a gap

    # a separate eval file: training reads all of --data, eval only the other file
    train_only, held_out = tmp_path / "train.txt", tmp_path / "eval.txt"
    train_only.write_bytes(b"abcdefgh" * 100)
    held_out.write_bytes(b"ABCDEFGH" * 100)
    sources = open_sources("run", 0, train_only, held_out, eval_fraction=0.1, seq_len=16)
    assert len(sources.train) == 800
    stream = DataStream(sources, "run", "peer-a", 8, 16)
    assert not _bytes_of(stream.next_batch()) & UPPER and not _bytes_of(stream.eval_set) & LOWER


def test_held_out_settings_fail_clearly(tmp_path, caplog):
    path = tmp_path / "short.txt"
    path.write_bytes(b"x" * 200)
    # one sequence (65 tokens) would be a third of it: no eval loss, and a warning, not a refusal
    with caplog.at_level(logging.WARNING):
        assert open_sources("run", 0, path, None, eval_fraction=0.05, seq_len=64).eval is None
    assert "too short to hold out one sequence" in caplog.text
    with pytest.raises(SettingsError, match="--data.*fewer than one sequence"):
        open_sources("run", 0, path, None, eval_fraction=0.05, seq_len=512)
    with pytest.raises(SettingsError, match="--eval-data.*training data itself"):
        open_sources("run", 0, path, path, seq_len=8)
    assert open_sources("run", 0, path, None, eval_fraction=0.0).eval is None  # no held-out text: no eval loss
    with pytest.raises(SettingsError, match="--eval-data: needs --data"):
        load_settings({"eval_data": str(path)})
    with pytest.raises(SettingsError, match="--eval-data: cannot read"):
        load_settings({"data": str(path), "eval_data": str(tmp_path / "missing.txt")})
    with pytest.raises(SettingsError, match="--total-steps: must exceed --warmup-steps"):
        load_settings({"total_steps": 10, "warmup_steps": 50})


def test_learning_rate_schedule():
    cosine = LearningRateSchedule(1e-3, warmup_steps=10, total_steps=110, shape="cosine", min_ratio=0.1)
    assert cosine(0) == pytest.approx(1e-4) and cosine(9) == pytest.approx(1e-3)
    assert cosine(60) == pytest.approx(0.55e-3)  # half way through the decay
    assert cosine(110) == pytest.approx(1e-4) and cosine(10_000) == pytest.approx(1e-4)
    assert all(cosine(i) >= cosine(i + 1) for i in range(9, 200))
    linear = LearningRateSchedule(1e-3, 0, 100, "linear", 0.0)
    assert linear(50) == pytest.approx(0.5e-3) and linear(100) == 0.0
    assert LearningRateSchedule(1e-3, 10, None)(5000) == 1e-3  # no length: no decay
    # a joiner whose AdamW starts fresh warms up again, to the swarm's decayed rate
    assert cosine(60, own_steps=0) == pytest.approx(0.1 * cosine(60))
    assert cosine(60, own_steps=9) == pytest.approx(cosine(60))
    with pytest.raises(ValueError, match="unknown schedule"):
        LearningRateSchedule(1e-3, shape="step")


def test_a_round_without_steps_reports_the_rate_its_first_step_would_take():
    """A node restarted with its AdamW moments arrives late and takes no step in its first
    round: that round's rate is the schedule's at the swarm's position, not warmup's first."""
    import threading

    from dtnode.daemon.training.trainer import Trainer

    language = MarkovLanguage(seed=2)
    stream = DataStream(DataSources(language, language), "run", "peer", 2, 16)
    schedule = LearningRateSchedule(1e-3, warmup_steps=50)
    trainer = Trainer(
        build_model("tiny", seed=1)[0], stream, torch.device("cpu"), schedule=schedule, weight_decay=0.1, grad_clip=1.0
    )
    trainer.load_inner_state(torch.zeros(trainer.flat.numel), torch.zeros(trainer.flat.numel), 38)
    stopped = threading.Event()
    stopped.set()
    result = trainer.run(10, stopped, position=50)
    assert result.steps == 0
    assert trainer.lr == pytest.approx(schedule(50, 38)) and trainer.lr == pytest.approx(0.78e-3)


def test_the_step_floor_hook_makes_every_inner_step_last_at_least_its_seconds(monkeypatch):
    """DTNODE_TEST_STEP_FLOOR_S keeps a GPU host's tiny-model steps at about CPU length for the
    swarm tests that time a restart against rounds; the pacer sees the floored step time. A
    value that is not a number of seconds >= 0 is refused by name."""
    import threading

    from dtnode.daemon.training.trainer import Trainer

    language = MarkovLanguage(seed=2)

    def trainer() -> Trainer:
        stream = DataStream(DataSources(language, language), "run", "peer", 2, 16)
        return Trainer(
            build_model("tiny", seed=1)[0],
            stream,
            torch.device("cpu"),
            schedule=LearningRateSchedule(1e-3),
            weight_decay=0.1,
            grad_clip=1.0,
        )

    monkeypatch.setenv("DTNODE_TEST_STEP_FLOOR_S", "0.25")
    floored = trainer()
    result = floored.run(3, threading.Event())
    assert result.steps == 3 and result.seconds >= 0.75
    assert floored.step_seconds >= 0.25  # the second and third steps' time, as the pacer reads it
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv("DTNODE_TEST_STEP_FLOOR_S", bad)
        with pytest.raises(ValueError, match="DTNODE_TEST_STEP_FLOOR_S"):
            trainer()
