import math

import pytest
import torch

from dtnode.daemon.data import DataStream, MarkovLanguage, TextFile
from dtnode.daemon.model import GPT, PRESETS, build_model, config_hash
from dtnode.daemon.settings import SettingsError, load_settings


def test_markov_floor_is_the_empirical_cross_entropy():
    lang = MarkovLanguage(seed=3)
    tokens = lang.sample(256, 257, torch.Generator().manual_seed(0))
    probs = lang.transitions[tokens[:, :-1], tokens[:, 1:]]
    empirical = float(-probs.log().mean())
    assert math.isclose(empirical, lang.entropy_rate, rel_tol=0.05)
    assert 0.5 < lang.entropy_rate < math.log(256)


def test_peers_draw_different_streams_but_share_the_eval_batch():
    lang = MarkovLanguage(seed=1)
    a = DataStream(lang, "run", "peer-a", 4, 16)
    b = DataStream(lang, "run", "peer-b", 4, 16)
    assert not torch.equal(a.next_batch(), b.next_batch())
    assert torch.equal(a.eval_batch, b.eval_batch)
    assert a.next_batch().shape == (4, 17)


def test_text_file_gives_byte_tokens(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("héllo wörld " * 100, encoding="utf-8")
    batch = TextFile(path).sample(3, 10, torch.Generator().manual_seed(0))
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
        "def make():\n    return Bigram()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    model, description = build_model("mymodels:make", seed=0)
    assert description["factory"] == "mymodels:make" and model.context_length == 32
