"""Text to token ids: a local `tokenizers`/`transformers` tokenizer, or raw bytes.

Only local files are read (a tokenizer.json, or a directory that `save_pretrained` wrote);
nothing is fetched from a hub. A tokenizer's identity (the sha256 of its serialised form)
enters the model's description, because peers that split text differently must never average.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol

from dtnode.daemon.config.settings import SettingsError

BYTE_VOCAB = 256
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "[EOS]", "<|end_of_text|>")


class Tokenizer(Protocol):
    vocab_size: int
    sha256: str
    eos_id: int | None

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255: the default, and the built-in presets' vocabulary."""

    vocab_size: int = BYTE_VOCAB
    sha256: str = "bytes"
    eos_id: int | None = None
    separator = b"\n"

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(text.encode("utf-8") + self.separator) for text in texts]


class LocalTokenizer:
    """A fast tokenizer from a tokenizer.json (directly, or inside a saved directory)."""

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise SettingsError("--tokenizer", "needs the Hugging Face libraries: pip install 'dtnode[hf]'") from None
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise SettingsError(
                "--tokenizer",
                f"{path} holds no tokenizer.json (save a fast tokenizer with "
                "save_pretrained, or give the tokenizer.json itself)",
            )
        raw = file.read_bytes()
        try:
            self._tokenizer = HFTokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # noqa: BLE001  (the library raises a bare Exception on a malformed file)
            raise SettingsError("--tokenizer", f"{file} is not a tokenizer: {e}") from None
        self.path = path
        self.file = file
        self.sha256 = hashlib.sha256(raw).hexdigest()
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = next((i for name in EOS_NAMES if (i := self._tokenizer.token_to_id(name)) is not None), None)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        if self.eos_id is None:
            return [e.ids for e in encodings]
        return [[*e.ids, self.eos_id] for e in encodings]


def load_tokenizer(path: Path | None) -> Tokenizer:
    return ByteTokenizer() if path is None else LocalTokenizer(path)


def check_vocabulary(tokenizer: Tokenizer, model_vocab: int) -> None:
    """Every id the tokenizer can emit must be a row of the model's embedding."""
    if tokenizer.vocab_size > model_vocab:
        what = (
            "byte-level text (256 ids)"
            if isinstance(tokenizer, ByteTokenizer)
            else f"the tokenizer's {tokenizer.vocab_size} ids"
        )
        raise SettingsError(
            "--tokenizer",
            f"{what} do not fit the model's vocabulary of {model_vocab}: use a "
            "model whose vocab_size covers the tokenizer",
        )
