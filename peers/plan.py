"""What every member of an averaging group agrees on: members, parts and chunking.

The plan is a pure function of the sorted member list and a few settings, so members
derive the same plan without a leader; its `group_id` (a hash over all of it) travels in
every chunk, and a chunk naming another plan is rejected.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from dtnode.ops import sparse
from dtnode.ops.partition import capped_shares, plan_parts
from dtnode.ops.robust import lower_median, upper_median
from dtnode.proto import averaging_pb2 as pb

# no reducer takes more than this many times an even split of Δ (with 4 reducers, half; in a
# pair, whose two members see each other's whole Δ anyway, bandwidth alone decides)
MAX_PART_FACTOR = 2.0
# no member's Δ weighs more than this many times the group's (lower) median announced weight: a
# peer with an 8x bigger batch counts in full, one that lies about its tokens moves the mean by a
# bounded share (the same spread pacing allows a peer's reports, peers/pacing.py)
WEIGHT_SPREAD = 8.0

INT8 = pb.CODEC_INT8_BLOCK
FP32 = pb.CODEC_FP32
SPARSE = pb.CODEC_SPARSE_TOPK  # what senders send in a sparse plan's first hop
SPARSE_SUPPORT = pb.CODEC_SPARSE_SUPPORT  # what its reducers return, and senders of later hops send
# A later moshpit hop's values are a group's mean, sparse on its members' union: its senders keep
# up to this many times top_k values per block (all of a pair's union, so groups of 2 average
# exactly what one group of 4 would), with 8-bit values.
LATER_HOP_WIDTH = 2


class Compression(StrEnum):
    """How a node's Δ travels (--compression)."""

    INT8 = "int8"
    SPARSE = "sparse"
    FP32 = "fp32"


@dataclass(frozen=True)
class WireFormat:
    """The codec of Δ on the wire, its block, and (sparse) the values kept per block."""

    compression: Compression = Compression.INT8
    block_size: int = 256
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.compression == Compression.SPARSE:
            sparse.check_block_size(self.block_size)
            if self.top_k < 1:
                raise ValueError("a sparse wire format keeps top_k >= 1 values per block")

    @property
    def codec(self) -> pb.Codec:
        return {Compression.INT8: INT8, Compression.SPARSE: SPARSE, Compression.FP32: FP32}[self.compression]

    @property
    def plan_top_k(self) -> int:
        return self.top_k if self.compression == Compression.SPARSE else 0

    def sent_per_value(self, hop: int = 0) -> float:
        """Bytes one member's Δ costs per parameter (at most, in a later hop)."""
        if self.compression == Compression.SPARSE:
            if hop:
                return self._support_per_value(sender_top_k(self.top_k, self.block_size, hop))
            return sparse.bytes_per_value(self.block_size, self.top_k)
        return 1 + 4 / self.block_size if self.compression == Compression.INT8 else 4.0

    def result_per_value(self, group_size: int, hop: int = 0) -> float:
        """Bytes per parameter of a reducer's mean: a sparse mean holds up to every member's positions."""
        if self.compression != Compression.SPARSE:
            return self.sent_per_value()
        return self._support_per_value(group_size * sender_top_k(self.top_k, self.block_size, hop))

    def _support_per_value(self, kept: int) -> float:
        return sparse.support_bytes_per_value(self.block_size, kept)


def sender_top_k(top_k: int, block_size: int, hop: int) -> int:
    """Values a sender keeps per block in a sparse plan's hop: top_k of its own Δ in hop 0, up to
    LATER_HOP_WIDTH x top_k of its group's mean in later hops."""
    return top_k if hop == 0 else min(block_size, LATER_HOP_WIDTH * top_k)


@dataclass(frozen=True)
class Member:
    peer_id: str
    grpc_addr: str
    client_mode: bool = False
    bandwidth: float = 1.0
    # the weight its Δ carries in this group, from its signed registration; 0: not announced (a
    # plan where nobody announced one bounds weights by MAX_WEIGHT only, as in plans built outside
    # matchmaking; among members that did, a 0 counts 0: see `capped_weights`)
    weight: float = 0.0
    # the share of its previous group's mean it brings (moshpit classes, from its registration):
    # its weight in a θ_g re-sync, so two groups holding one mean from different numbers of
    # members weigh it alike
    share: float = 1.0
    # the all-reduces it runs at once in this hop (the groups it stands in, from its
    # registration): a group's deadline allows for its most loaded member (`GroupReducer.reduce`)
    load: int = 1


@dataclass(frozen=True)
class GroupPlan:
    run_id: str
    round: int
    hop: int
    members: tuple[Member, ...]
    numel: int
    block_size: int
    chunk_elements: int
    codec: pb.Codec
    parts: tuple[tuple[int, int], ...]
    group_id: bytes = field(default=b"")
    top_k: int = 0  # sparse plans: values kept per block
    # per member (in `members` order): the weight its stream counts with, its announced weight
    # capped at WEIGHT_SPREAD x the lower median announced; empty when a member announced none
    weight_caps: tuple[float, ...] = ()
    # the plain mean holds each contribution to a chunk to CLIP_REACH x the lower median of their
    # lengths (ops/robust.py): a Δ's bound. Off for a θ_g re-sync, whose values are states, not
    # steps (equal lengths in the swarm, held to the node's drift bound instead: part_result.py)
    clip_lengths: bool = True
    # members whose values do not enter the mean, though they send them and take the result: in
    # a θ_g re-sync, those outvoted by a strict majority of the group (peers/forming.py
    # `outvoted`), so that the group leaves with the majority's θ_g bit for bit. A chunk that
    # none of the others reached is the mean of every contribution, as without it.
    silent: frozenset[str] = frozenset()

    def counts(self, peer_id: str) -> bool:
        """Whether a member's values enter the mean (see `silent`)."""
        return peer_id not in self.silent

    def announced_weight(self, peer_id: str) -> tuple[float, float] | None:
        """(announced, counted) weight of a member, or None when this plan bounds no weights."""
        if not self.weight_caps:
            return None
        i = self.index_of(peer_id)
        return self.members[i].weight, self.weight_caps[i]

    @property
    def median_weight(self) -> float:
        """The lower median of the members' counted weights (0.0 when the plan bounds none)."""
        return lower_median(self.weight_caps)

    def expected_total_weight(self, included: list[str]) -> float | None:
        """The total weight a reducer must report for these senders: the sum of their counted weights."""
        if not self.weight_caps:
            return None
        return sum(self.weight_caps[self.index_of(p)] for p in included)

    @property
    def result_codec(self) -> pb.Codec:
        """What reducers return: the mean of sparse payloads is sparse on their union."""
        return SPARSE_SUPPORT if self.codec == SPARSE else self.codec

    @property
    def sums_as_sent(self) -> bool:
        """Every contribution, the reducer's own included, enters the mean as the group sees it
        (through the plan's code), so the reducer adds them in a fixed order and two groups that
        average the same contributions return the same bits (reducer.PartReduction). fp32 and
        sparse always; int8 after hop 0 (at hop 0 no two groups share a contribution, and the
        reducer keeps its own slice exact)."""
        return self.codec in (FP32, SPARSE) or self.hop > 0

    @property
    def later_sparse_hop(self) -> bool:
        """A sparse plan of a later moshpit hop: senders send their group's mean on its support."""
        return self.codec == SPARSE and self.hop > 0

    @property
    def sender_codec(self) -> pb.Codec:
        return SPARSE_SUPPORT if self.later_sparse_hop else self.codec

    @property
    def sender_top_k(self) -> int:
        """Values a sender keeps per block (exactly, in hop 0; at most, in later hops)."""
        return sender_top_k(self.top_k, self.block_size, self.hop) if self.codec == SPARSE else 0

    def index_of(self, peer_id: str) -> int:
        for i, m in enumerate(self.members):
            if m.peer_id == peer_id:
                return i
        raise KeyError(peer_id)

    @property
    def member_ids(self) -> list[str]:
        return [m.peer_id for m in self.members]


def make_plan(
    run_id: str,
    round: int,
    hop: int,
    members: list[Member],
    numel: int,
    block_size: int,
    chunk_elements: int,
    codec: pb.Codec = INT8,
    key: str = "",
    top_k: int = 0,
    clip_lengths: bool = True,
    silent: frozenset[str] = frozenset(),
) -> GroupPlan:
    """Build the plan every member derives identically from the same member list.

    Parts are proportional to advertised bandwidth (client-mode members get none), but none
    is over MAX_PART_FACTOR / reducers of Δ whatever bandwidth its member claims, and they are
    aligned to the quantization block so no block straddles two reducers. Members' announced
    weights are capped (`capped_weights`): what each stream may claim and counts with. `key` (the
    group's matchmaking key) keeps two groups of one hop with the same members apart.
    A sparse plan's block is the sparse block (so no block straddles two parts or chunks)
    and `top_k` its kept values per block. `clip_lengths` and `silent`: see `GroupPlan`.
    """
    ordered = tuple(sorted(members, key=lambda m: m.peer_id))
    if len({m.peer_id for m in ordered}) != len(ordered):
        raise ValueError("duplicate peer ids in group")
    if chunk_elements < block_size or chunk_elements % block_size:
        raise ValueError("chunk_elements must be a positive multiple of block_size")
    if (codec == SPARSE) != (top_k > 0):
        raise ValueError("a sparse plan needs top_k > 0, and only a sparse plan has one")
    if not silent <= {m.peer_id for m in ordered} or len(silent) >= len(ordered):
        raise ValueError("silent members must be members, and leave at least one whose values count")
    shares = [0.0 if m.client_mode else max(m.bandwidth, 1e-9) for m in ordered]
    reducers = sum(1 for share in shares if share > 0)
    if reducers:  # none: plan_parts says so
        shares = capped_shares(shares, MAX_PART_FACTOR / reducers)
    parts = tuple(plan_parts(numel, shares, align=block_size))
    weight_caps = capped_weights([m.weight for m in ordered])
    digest = hashlib.sha256()
    for item in (
        run_id,
        round,
        hop,
        key,
        numel,
        block_size,
        chunk_elements,
        codec,
        top_k,
        clip_lengths,
        *[m.peer_id for m in ordered],
        *[repr(w) for w in weight_caps],
        *[f"silent:{p}" for p in sorted(silent)],
    ):
        digest.update(str(item).encode() + b"\0")
    for offset, length in parts:
        digest.update(f"{offset}:{length};".encode())
    return GroupPlan(
        run_id,
        round,
        hop,
        ordered,
        numel,
        block_size,
        chunk_elements,
        codec,
        parts,
        digest.digest(),
        top_k,
        weight_caps,
        clip_lengths,
        frozenset(silent),
    )


def weight_shortfall(members: Sequence[Member], peer_id: str) -> float:
    """How many times this member's weight a typical member of the group announced: the upper
    median of the capped weights (`capped_weights`: one member is held to WEIGHT_SPREAD x the
    lower median, and moves the upper median no further than another member's weight) over its
    own; 1.0 where it announced none. At hop 0 a weight is the tokens a member trained in the
    round, so this says how much longer the Δ of the mean's typical member is than this one's
    (update_bounds.py `allow_for_group`)."""
    caps = capped_weights([m.weight for m in members])
    if not caps:
        return 1.0
    own = next((c for m, c in zip(members, caps, strict=True) if m.peer_id == peer_id), 0.0)
    if own <= 0:
        return 1.0
    return upper_median(caps) / own


def capped_weights(announced: list[float]) -> tuple[float, ...]:
    """Each announced weight, at most WEIGHT_SPREAD x the lower median of the positive ones (in
    a pair, the smaller: one member cannot outweigh the other more than WEIGHT_SPREAD times).
    A member that announced no weight (0) among members that did counts 0: its streams may
    claim nothing, so they are refused (a 0 used to switch every cap of its group off). Empty
    only when nobody announced one (plans built outside matchmaking, with no registrations)."""
    positive = [w for w in announced if w > 0]
    if not positive:
        return ()
    median = lower_median(positive)
    return tuple(min(max(w, 0.0), WEIGHT_SPREAD * median) for w in announced)


def chunk_spans(plan: GroupPlan, part: int) -> list[tuple[int, int]]:
    """(offset, length) of each chunk of a part, relative to the part; shared by both sides."""
    length = plan.parts[part][1]
    return [(off, min(plan.chunk_elements, length - off)) for off in range(0, length, plan.chunk_elements)]
