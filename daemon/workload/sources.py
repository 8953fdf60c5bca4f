"""Opening a data source (`--data`, `--eval-data`) as token corpora: a `.bin` or a single
text file in place, anything else tokenized once into a token file in the state dir (llm.c's
format), keyed by the sources' names, sizes and times, the tokenizer and the split.

What a corpus is and the order it is read in: corpus.py.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dtnode.daemon.workload.corpus import (
    LLMC_HEADER_INTS,
    LLMC_MAGIC,
    MAX_HELD_OUT_SHARE,
    CorpusError,
    TokenCorpus,
    cached_tokens,
    read_bin,
    stable_seed,
)
from dtnode.daemon.workload.tokenizer import ByteTokenizer, Tokenizer

log = logging.getLogger(__name__)


DATASET_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


ENCODE_BATCH = 512  # documents per tokenizer call


FALLBACK_CANDIDATES = 256  # documents of lowest hash remembered, for a small dataset's hold-out


# what a text source may be made of (anything else is refused, not read as text)
TEXT_SUFFIXES = {
    "",
    ".txt",
    ".text",
    ".md",
    ".markdown",
    ".rst",
    ".tex",
    ".html",
    ".htm",
    ".xml",
    ".py",
    ".c",
    ".h",
    ".cc",
    ".cpp",
    ".hpp",
    ".rs",
    ".go",
    ".java",
    ".js",
    ".ts",
    ".sh",
    ".toml",
    ".yaml",
    ".yml",
}


class TokenFileWriter:
    """Appends ids to a token file in llm.c's format; `close` fills in the header and renames it
    into place (a temp file until then, so a crash never leaves a torn cache behind)."""

    def __init__(self, path: Path, dtype: type):
        self.path, self.dtype, self.count = path, dtype, 0
        self.tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        self.file = open(self.tmp, "wb")  # noqa: SIM115  (held open across appends; `close` closes it)
        self.file.write(b"\0" * 4 * LLMC_HEADER_INTS)

    def append(self, ids: np.ndarray) -> None:
        self.file.write(np.asarray(ids).astype(self.dtype).tobytes())
        self.count += len(ids)

    def close(self) -> None:
        header = np.zeros(LLMC_HEADER_INTS, dtype=np.int32)
        header[:3] = (LLMC_MAGIC, 1 if self.dtype == np.uint16 else 2, self.count)
        self.file.seek(0)
        self.file.write(header.tobytes())
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def write_bin(path: Path, chunks: Iterator[np.ndarray], dtype: type) -> int:
    """Write ids in llm.c's format, atomically; returns the token count."""
    writer = TokenFileWriter(path, dtype)
    try:
        for chunk in chunks:
            writer.append(chunk)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return writer.count


def source_files(path: Path) -> list[Path]:
    """The files of a source, in a fixed order: itself, or a directory's files outside hidden folders."""
    if not path.is_dir():
        return [path]
    return sorted(
        p
        for p in path.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )


def documents(path: Path, text_field: str) -> Iterator[tuple[str, str]]:
    """(name, text) of every document under `path`, in a fixed order: text files whole, dataset rows one by one."""
    files = source_files(path)
    if not files:
        raise CorpusError(f"{path} holds no files")
    for file in files:
        kind = DATASET_SUFFIXES.get(file.suffix.lower())
        if kind is None:
            if file.suffix.lower() == ".bin":
                raise CorpusError(
                    f"{file}: a .bin token file cannot be mixed into a directory of text; give it as --data itself"
                )
            yield str(file.relative_to(path.parent)), file.read_text(encoding="utf-8", errors="replace")
            continue
        for row_no, text in enumerate(_dataset_rows(file, kind, text_field)):
            yield f"{file.relative_to(path.parent)}#{row_no}", text


def _dataset_rows(file: Path, kind: str, text_field: str) -> Iterator[str]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only: never ask a hub
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise CorpusError(
            f"{file}: .jsonl and .parquet data need the Hugging Face libraries: pip install 'dtnode[hf]'"
        ) from None
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    try:
        rows = datasets.load_dataset(kind, data_files=[str(file)], split="train", streaming=True)
        for row in rows:
            if text_field not in row:
                raise CorpusError(
                    f"{file}: rows have no field {text_field!r} (fields: {', '.join(sorted(row))}); set --text-field"
                )
            text = row[text_field]
            if not isinstance(text, str):
                raise CorpusError(f"{file}: field {text_field!r} holds {type(text).__name__}, not text")
            yield text
    except CorpusError:
        raise
    except Exception as e:  # noqa: BLE001  (datasets/pyarrow raise many types for a malformed file)
        raise CorpusError(f"{file}: cannot read it as {kind}: {e}") from None


def is_held_out(name: str, fraction: float) -> bool:
    """Whether a document is in the held-out part: a hash of its name, the same on every peer."""
    return fraction > 0 and stable_seed("held-out", name) < fraction * (1 << 63)


def _source_key(path: Path, *parts: object) -> str:
    """Identity of a source for the token cache: names, sizes and modification times, and `parts`."""
    listing = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in source_files(path)]
    return hashlib.sha256(json.dumps([listing, *map(str, parts)]).encode()).hexdigest()[:24]


def tokenize_source(
    path: Path,
    tokenizer: Tokenizer,
    text_field: str,
    cache_dir: Path,
    held_out_fraction: float = 0.0,
    min_held_out: int = 2,
) -> tuple[TokenCorpus, TokenCorpus | None]:
    """(training corpus, held-out corpus or None) of a text or dataset source, through the cache.

    The held-out part is whole documents: those whose name hashes under the fraction, and when
    they come to fewer than `min_held_out` tokens (a small dataset), the documents of lowest
    hash until they do, as long as that takes at most MAX_HELD_OUT_SHARE of the tokens; else
    there is no held-out part (None, with a warning), and the node trains without an eval loss."""
    key = _source_key(path, tokenizer.sha256, text_field, held_out_fraction, min_held_out)
    train_path, eval_path = cache_dir / f"tokens-{key}-train.bin", cache_dir / f"tokens-{key}-eval.bin"
    if not train_path.exists() or (held_out_fraction and not eval_path.exists()):
        cache_dir.mkdir(parents=True, exist_ok=True)
        _tokenize_into(path, tokenizer, text_field, held_out_fraction, min_held_out, train_path, eval_path)
    train = read_bin(train_path)
    train.id_bound = tokenizer.vocab_size
    held_out = None
    if held_out_fraction:
        if cached_tokens(eval_path):
            held_out = read_bin(eval_path)
            held_out.id_bound = tokenizer.vocab_size
        else:
            log.warning(
                "%s is too small to hold out even one document (at most %.0f%% of its %d tokens, at least %d): "
                "training without an eval loss (give --eval-data for one)",
                path,
                100 * MAX_HELD_OUT_SHARE,
                len(train),
                min_held_out,
            )
    return train, held_out


@dataclass
class _Pass:
    """What one tokenizing pass wrote, and the training documents a fallback may hold out."""

    tokens: dict[bool, int] = field(default_factory=lambda: {False: 0, True: 0})
    docs: dict[bool, int] = field(default_factory=lambda: {False: 0, True: 0})
    lowest: list[tuple[int, str, int]] = field(default_factory=list)  # max-heap of (-score, name, tokens)


def _tokenize_into(
    path: Path,
    tokenizer: Tokenizer,
    text_field: str,
    fraction: float,
    min_held_out: int,
    train_path: Path,
    eval_path: Path,
) -> None:
    """Documents streamed to disk (memory bounded by one batch of documents): one pass, or a
    second one when the hashed hold-out came short and whole documents are held out instead."""
    log.info("tokenizing %s into the token cache (once)", path)
    first = _tokenize_pass(
        path, tokenizer, text_field, lambda name: is_held_out(name, fraction), fraction > 0, train_path, eval_path
    )
    if fraction and first.tokens[True] < min_held_out:
        total = first.tokens[False] + first.tokens[True]
        held, chosen = first.tokens[True], set()
        for _, name, tokens in sorted(first.lowest, key=lambda c: (-c[0], c[1])):  # lowest hash first
            if held >= min_held_out:
                break
            chosen.add(name)
            held += tokens
        if held < min_held_out or held > MAX_HELD_OUT_SHARE * total or total - held < min_held_out:
            chosen, held_out = set(), False  # nothing fits: train on everything, an empty held-out file
        else:
            held_out = True
        first = _tokenize_pass(
            path,
            tokenizer,
            text_field,
            (lambda name: name in chosen or is_held_out(name, fraction)) if held_out else (lambda name: False),
            True,
            train_path,
            eval_path,
        )
    log.info("token cache of %s: %d training documents, %d held out", path, first.docs[False], first.docs[True])


def _tokenize_pass(
    path: Path,
    tokenizer: Tokenizer,
    text_field: str,
    held: Callable[[str], bool],
    with_eval: bool,
    train_path: Path,
    eval_path: Path,
) -> _Pass:
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    writers = {False: TokenFileWriter(train_path, dtype)}
    if with_eval:
        writers[True] = TokenFileWriter(eval_path, dtype)
    result = _Pass()
    batch: list[tuple[str, str]] = []

    def flush() -> None:
        for (name, _), ids in zip(batch, tokenizer.encode_batch([text for _, text in batch]), strict=True):
            out = with_eval and held(name)
            writers[out].append(np.asarray(ids, dtype=np.int64))
            result.docs[out] += 1
            result.tokens[out] += len(ids)
            if not out:  # a fallback candidate: keep the FALLBACK_CANDIDATES of lowest hash
                entry = (-stable_seed("held-out", name), name, len(ids))
                if len(result.lowest) < FALLBACK_CANDIDATES:
                    heapq.heappush(result.lowest, entry)
                elif entry > result.lowest[0]:
                    heapq.heapreplace(result.lowest, entry)
        batch.clear()

    try:
        for document in documents(path, text_field):
            batch.append(document)
            if len(batch) >= ENCODE_BATCH:
                flush()
        flush()
        for writer in writers.values():  # the held-out file first: the training file's presence means whole
            if writer is not writers[False]:
                writer.close()
        writers[False].close()
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    return result


def open_corpus(
    path: Path,
    tokenizer: Tokenizer,
    text_field: str,
    data_dtype: str,
    cache_dir: Path,
    held_out_fraction: float = 0.0,
    min_held_out: int = 2,
) -> tuple[TokenCorpus, TokenCorpus | None]:
    """(training corpus, held-out corpus or None) of one source: None when `held_out_fraction`
    is 0, or when the source is too small to hold anything out (see tokenize_source)."""
    check_known_type(path)
    single = path.is_file()
    if single and path.suffix.lower() == ".bin":
        corpus = read_bin(path, data_dtype)
    elif single and path.suffix.lower() not in DATASET_SUFFIXES and isinstance(tokenizer, ByteTokenizer):
        tokens = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
        corpus = TokenCorpus(tokens, str(path), id_bound=256)
    else:
        one_document = single and path.suffix.lower() not in DATASET_SUFFIXES
        train, held_out = tokenize_source(
            path, tokenizer, text_field, cache_dir, 0.0 if one_document else held_out_fraction, min_held_out
        )
        if one_document and held_out_fraction:
            return train.tail_split(held_out_fraction, min_held_out)
        return train, held_out
    return corpus.tail_split(held_out_fraction, min_held_out) if held_out_fraction else (corpus, None)


def check_known_type(path: Path) -> None:
    """Refuse a file of a type dtnode would misread (a .csv or .jsonl.gz read as text would train on garbage)."""
    for file in source_files(path) if path.is_dir() else [path]:
        suffix = file.suffix.lower()
        if suffix not in TEXT_SUFFIXES and suffix not in DATASET_SUFFIXES and suffix != ".bin":
            raise CorpusError(
                f"{file}: unknown data type {suffix!r}; known: text ({', '.join(sorted(s for s in TEXT_SUFFIXES if s))} "
                f"or no suffix), datasets ({', '.join(DATASET_SUFFIXES)}), token ids (.bin)"
            )
