"""The swarm's recipe: what every peer must train the same way, published in each record and
checked when a node joins.

The model hash (workload/model.py) says which network a peer trains; the recipe says how: on which
data, in rounds of what size, with which learning-rate schedule, outer optimizer and wire
format. Two peers that differ in any of these average pseudo-gradients that mean different
things (another corpus, another position in the schedule, another round length), and nothing
in the numbers shows it. So a joiner compares its recipe with its live peers' and exits 4
with one line per differing field (ours, the swarm's, the flag that sets it), and a joiner
given `--peer http://...` takes every field it was not given from that peer, so that `--data`
is the one thing a contributor supplies.

The signed membership record carries the recipe's sha256 and the node's sidecar serves the JSON
itself (`/recipe`): every read of the membership brings every record back, and the recipe is
needed only by a joiner whose own hash differs from the swarm's, to name the fields that differ
(daemon/catchup/admission.py). A peer's recipe is untrusted: its JSON must hash to what the
peer's signed record announces, and is validated like any other field (a malformed one is
"unreadable", never used).
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dtnode import __version__
from dtnode.daemon.config.settings import NodeSettings, flag
from dtnode.daemon.workload.corpus import TokenCorpus
from dtnode.daemon.workload.data import DataSources, MarkovLanguage
from dtnode.daemon.workload.sources import source_files
from dtnode.peers import wire
from dtnode.peers.membership import PeerRecord, SwarmMismatch
from dtnode.peers.sidecar_address import PROBE_TIMEOUT_S, SidecarAddressError, fetch_status, is_sidecar_address

log = logging.getLogger("dtnode")
RECIPE_PATH = "/recipe"  # where a node's sidecar serves its recipe's JSON
HASHED_TOKEN_BYTES = 1 << 30  # above this, the data is named by its files' names and sizes instead


class SwarmRecipe(BaseModel):
    """Every field a peer must share with its swarm; the names are NodeSettings' (the flag of
    `data` is --data, whose fingerprint it is)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    data: str = Field(max_length=200)  # data_fingerprint()
    seq_len: int = Field(ge=2, le=65536)  # the effective one (the flag, capped by the model's context)
    inner_steps: int = Field(ge=1, le=1_000_000)
    pacing: str = Field(pattern=r"^(swarm|fixed)$")
    round_tokens: int | None = Field(None, ge=1)
    round_seconds: float | None = Field(None, gt=0, le=86400)
    overlap: bool = False
    inner_optimizer: str = Field("adamw", pattern=r"^(adamw|muon)$")  # a record without it is AdamW's
    inner_lr: float = Field(gt=0, le=1)
    lr_schedule: str = Field(pattern=r"^(cosine|linear|constant)$")
    warmup_steps: int = Field(ge=0)
    total_steps: int | None = Field(None, ge=1)
    min_lr_ratio: float = Field(ge=0, le=1)
    outer_lr: float = Field(gt=0, le=10)
    outer_momentum: float = Field(ge=0, lt=1)
    compression: str = Field(pattern=r"^(int8|sparse|fp32)$")
    quant_block_size: int = Field(ge=8, le=1 << 20)
    sparse_block_size: int = Field(4096, ge=16, le=4096)
    sparse_top_k: int = Field(64, ge=1, le=4096)
    feedback_decay: float = Field(0.95, gt=0, le=1)
    # not a setting: the version's data-plane format (peers/wire.py); a record without it is older
    wire_protocol: int = Field(1, ge=1, le=1_000_000)

    @field_validator("compression", mode="before")
    @classmethod
    def _compression_alias(cls, value: object) -> object:
        return "fp32" if value == "none" else value  # what peers before sparse called fp32

    def to_record(self) -> str:
        """The JSON a sidecar serves at /recipe, whose sha256 the node's record carries."""
        return self.model_dump_json()

    @property
    def sha256(self) -> str:
        """What the node's record carries of it: equal recipes of one version hash alike."""
        return hashlib.sha256(self.to_record().encode()).hexdigest()

    @classmethod
    def from_record(cls, text: str) -> SwarmRecipe | None:
        """A peer's published recipe; None when it published none (an older version) or an unreadable one."""
        if not text:
            return None
        try:
            return cls.model_validate_json(text)
        except ValidationError:
            return None


# the settings a joiner may take from a peer: all but the data, which each host brings itself,
# and the wire protocol, which its dtnode version fixes
ADOPTABLE = tuple(name for name in SwarmRecipe.model_fields if name not in ("data", "wire_protocol"))
_DATA_FIX = "--data (and --eval-fraction or --eval-data: what is held out is not trained on)"
_PROTOCOL_FIX = "the dtnode version: run the one the swarm's peers run (`curl <peer>/status` shows it)"


def recipe_of(settings: NodeSettings, seq_len: int, data: str) -> SwarmRecipe:
    """This node's recipe: its settings, its effective sequence length and its data's fingerprint."""
    values = {name: settings.value(name) for name in ADOPTABLE if name != "seq_len"}
    return SwarmRecipe(data=data, seq_len=seq_len, wire_protocol=wire.PROTOCOL, **values)


def data_fingerprint(sources: DataSources, data: Path | None, seed: int) -> str:
    """What the swarm trains on, comparable across hosts: the synthetic language's seed, the
    sha256 of the training tokens (after the hold-out, so the tokenizer and the split count), or
    for more than HASHED_TOKEN_BYTES the files' names (relative to --data) and sizes."""
    train = sources.train
    if isinstance(train, MarkovLanguage) or data is None:
        return f"synthetic (seed {seed})"
    assert isinstance(train, TokenCorpus)
    digest = hashlib.sha256()
    if train.tokens.nbytes <= HASHED_TOKEN_BYTES:
        step = 1 << 24
        for start in range(0, len(train.tokens), step):
            digest.update(np.ascontiguousarray(train.tokens[start : start + step]).tobytes())
        return f"{len(train.tokens)} tokens, sha256 {digest.hexdigest()[:16]}"
    files = source_files(data)
    for path in files:
        name = path.name if path == data else str(path.relative_to(data))
        digest.update(f"{name}\0{path.stat().st_size}\n".encode())
    return f"{len(files)} file(s) of {len(train.tokens)} tokens, names and sizes {digest.hexdigest()[:16]}"


@dataclass(frozen=True)
class RecipeDifference:
    """One field on which this node and its swarm differ."""

    name: str
    ours: Any
    theirs: Any

    @property
    def flag(self) -> str:
        if self.name == "wire_protocol":
            return _PROTOCOL_FIX
        return _DATA_FIX if self.name == "data" else flag(self.name)

    def line(self) -> str:
        return f"  {self.name}: this node {self.ours!r}, the swarm {self.theirs!r} (set by {self.flag})"


def differences(ours: SwarmRecipe, theirs: SwarmRecipe) -> list[RecipeDifference]:
    return [
        RecipeDifference(name, getattr(ours, name), getattr(theirs, name))
        for name in SwarmRecipe.model_fields
        if getattr(ours, name) != getattr(theirs, name)
    ]


def adopted_settings(settings: NodeSettings, theirs: SwarmRecipe) -> dict[str, Any]:
    """The recipe fields this node was not given (by flag, environment or config file) whose
    values differ from the swarm's: what it takes from the peer."""
    given = settings.given()
    return {
        name: getattr(theirs, name)
        for name in ADOPTABLE
        if name not in given and getattr(theirs, name) != settings.value(name)
    }


def recipe_flags(recipe: SwarmRecipe, data: Path | None) -> list[str]:
    """The flags a contributor pastes to train with this recipe: every field whose value is not
    the default (the others a fresh node has anyway), and --data when the swarm trains on files."""
    out: list[str] = []
    for name in ADOPTABLE:
        value = getattr(recipe, name)
        if name == "seq_len" or value != NodeSettings.default(name):
            if isinstance(value, bool):
                out += [flag(name)] if value else []
            elif value is not None:
                out += [flag(name), f"{value:g}" if isinstance(value, float) else str(value)]
    if data is not None:
        out += ["--data", str(data)]
    return out


def check_same_protocol(records: Iterable[PeerRecord]) -> None:
    """Refuse to join a swarm whose live peers all speak another data-plane protocol (another
    dtnode version): their reducers would refuse this node's chunks, or it theirs, part after
    part, every round. A record that does not say its protocol is an older dtnode's (records say
    it since they stopped carrying the recipe and the whole TLS certificate): those peers cannot
    learn this node's certificate, nor it theirs, so they count as another protocol."""
    ours = wire.PROTOCOL
    theirs = Counter((record.wire_protocol, record.version) for record in records)
    if not theirs or any(protocol == ours for protocol, _ in theirs):
        return
    (protocol, version), count = theirs.most_common(1)[0]
    running = f", dtnode {version}" if version else ""
    speak = (
        f"data-plane protocol {protocol}" if protocol else "an older record format that names no data-plane protocol"
    )
    raise SwarmMismatch(
        f"this swarm's peers average with {speak} ({count} peer(s){running}) and this "
        f"node with protocol {ours} (dtnode {__version__}): peers of "
        f"two protocols cannot average together; run the dtnode version the swarm runs, or upgrade every peer"
    )


def _from_peer(status: dict[str, Any]) -> tuple[str | None, str | None, SwarmRecipe | None]:
    """(run id, model preset, recipe) of a peer's /status, each None when absent or malformed."""
    run_id = status.get("run_id")
    model = status.get("model")
    try:
        recipe = SwarmRecipe.model_validate(status.get("recipe"))
    except ValidationError:
        recipe = None
    return (
        run_id if isinstance(run_id, str) and len(run_id) <= 64 else None,
        model if isinstance(model, str) and len(model) <= 64 and not any(c in model for c in ":/\\") else None,
        recipe,
    )


def _run_end(status: dict[str, Any]) -> int | None:
    """The outer step a peer's run ends at (its --max-rounds), when it has a well-formed one."""
    value = status.get("max_rounds")
    return value if type(value) is int and 1 <= value <= 1 << 62 else None


async def take_recipe_from_peer(settings: NodeSettings) -> NodeSettings:
    """With `--peer http://...`: the run id, the model preset and every recipe field this node
    was not given, from that peer. A --run-id given that differs from the peer's is a SwarmMismatch
    naming both (a node of another run would train alone, silently). A peer that does not
    answer is left to the DHT bootstrap, which reports it."""
    urls = [p for p in settings.swarm.peers if is_sidecar_address(p)]
    if not urls:
        return settings
    try:
        async with aiohttp.ClientSession() as session:
            status = await fetch_status(session, urls[0], min(settings.swarm.join_timeout, PROBE_TIMEOUT_S * 3))
    except SidecarAddressError as e:
        log.warning(
            "could not read the swarm's recipe from %s (%s): going on with this node's own settings", urls[0], e
        )
        return settings
    run_id, model, recipe = _from_peer(status)
    given = settings.given()
    if run_id is not None and run_id != settings.swarm.run_id and "run_id" in given:
        raise SwarmMismatch(
            f"--run-id {settings.swarm.run_id}: the peer at {urls[0]} trains run {run_id!r}; "
            f"give --run-id {run_id} to join it (or another --peer for run {settings.swarm.run_id})"
        )
    taken: dict[str, Any] = {}
    if run_id is not None and run_id != settings.swarm.run_id:
        taken["run_id"] = run_id
    if model is not None and model != settings.workload.model and "model" not in given:
        taken["model"] = model
    if recipe is not None:
        taken |= adopted_settings(settings, recipe)
    last = _run_end(status)
    if last is not None and last != settings.diloco.max_rounds and "max_rounds" not in given:
        taken["max_rounds"] = last  # the run ends at the same step for every node, however it joined
    if not taken:
        return settings
    log.info("taking the swarm's settings from %s: %s", urls[0], " ".join(f"{flag(k)} {v}" for k, v in taken.items()))
    values = {name: settings.value(name) for name in given} | taken
    try:
        return NodeSettings(**values)
    except ValidationError as e:  # a peer's values that this version refuses
        raise SwarmMismatch(
            f"the settings of the peer at {urls[0]} do not validate here: {e.errors()[0]['msg']}"
        ) from None
