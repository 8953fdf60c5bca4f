"""Every parser of a peer's or a stranger's bytes, fed thousands of generated inputs (Hypothesis):
each answers with a value it validated or with its own validation error, never anything else.

The parsers: membership records and DHT subkeys (peers/membership.py, peers/identity.py),
registrations and member lists (peers/matchmaking.py) and the rules that read them
(peers/leadership.py), wire chunks and results (peers/wire.py), checkpoint files and their
metadata (daemon/checkpoints/file_format.py), a donor's checkpoint metadata (daemon/catchup/donors.py), the recipe
(daemon/workload/recipe.py), a peer's dial-back answer (daemon/swarm/reachability.py) and the sidecar's query
parameters (daemon/serve/sidecar.py). The DHT's record validator has its own (tests/test_dht_records.py).
`pytest --hypothesis-show-statistics` prints how many inputs each took.
"""

from __future__ import annotations

import struct
import tempfile
from pathlib import Path

import pytest
import torch
from aiohttp import web
from fuzz_budget import inputs
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from dtnode.daemon.catchup.donors import offer_metadata
from dtnode.daemon.catchup.download import DownloadError
from dtnode.daemon.checkpoints.file_format import (
    CheckpointError,
    Layout,
    TrainingState,
    read_checkpoint,
    write_checkpoint,
)
from dtnode.daemon.serve.sidecar import dialback_peer, history_query, path_step
from dtnode.daemon.swarm.reachability import Reachability
from dtnode.daemon.workload.recipe import SwarmRecipe
from dtnode.peers.group_board import Registration, parse_list
from dtnode.peers.identity import writer_of
from dtnode.peers.leadership import ClosedList, by_rank, standing, valid_lists
from dtnode.peers.membership import PeerRecord
from dtnode.peers.plan import FP32, INT8, SPARSE, Member, make_plan
from dtnode.peers.wire import ChunkError, decode_chunk, numel_of
from dtnode.proto import averaging_pb2 as pb

MANY, ENOUGH, SOME = inputs(2000), inputs(1000), inputs(500)

# what msgpack brings back from a peer: any nesting of these
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True)
    | st.text(max_size=40)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=24,
)
# what JSON brings: the same without bytes
json_only = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=6,
)
record_like = st.fixed_dictionaries(
    {},
    optional={
        name: json_values | st.text(max_size=80) | st.integers(-(2**64), 2**64) for name in PeerRecord.model_fields
    },
)


@ENOUGH
@given(record_like)
def test_a_membership_record_is_a_record_or_a_validation_error(value):
    try:
        record = PeerRecord.model_validate(value)
    except ValidationError:
        return
    assert len(record.peer_id) <= 128 and record.outer_step >= 0 and len(record.served) <= 8


@MANY
@given(st.binary(max_size=700) | st.text(max_size=200) | json_values)
def test_a_dht_subkey_names_a_writer_or_nobody(subkey):
    writer = writer_of(subkey)
    assert writer is None or isinstance(writer, str)


@ENOUGH
@given(st.fixed_dictionaries({}, optional={name: json_values for name in Registration.model_fields}))
def test_a_registration_is_a_registration_or_a_validation_error(value):
    try:
        reg = Registration.model_validate(value)
    except ValidationError:
        return
    assert reg.weight > 0 and 0 < reg.share <= 1 and 0 < reg.bandwidth_mbps


ids = st.sampled_from([f"p{i}" for i in range(8)])


@ENOUGH
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "members": json_values | st.lists(ids | st.text(max_size=3), max_size=9),
            "complete": json_values,
            "resync": json_values,
            "auth": json_values,
        },
    ),
    ids,
)
def test_a_member_list_is_its_publishers_or_none(value, publisher):
    entry = parse_list(value, publisher)
    assert entry is None or (publisher in entry.members and len(set(entry.members)) == len(entry.members))


@MANY
@given(
    st.sets(ids, min_size=1),
    st.dictionaries(ids, st.lists(ids | st.just("ghost"), min_size=1, max_size=6, unique=True), max_size=8),
    st.dictionaries(ids, st.lists(ids, max_size=6, unique=True), max_size=8),
    st.sets(ids),
)
def test_the_rules_put_every_registrant_in_one_group_at_most_led_by_its_lowest_ranked(
    registrants, lists, formed, passed_over
):
    """Whatever lists peers published, the groups in force never share a member, and each is
    led by its lowest-ranked member: nobody was taken by a peer ranked after them."""
    key = "run.group.0.0.all"
    read = valid_lists(key, {p: ClosedList(tuple(m)) for p, m in lists.items() if p in m}, registrants)
    view = standing(key, registrants, read, formed, passed_over)
    seen: set[str] = set()
    for publisher, members in view.groups.items():
        assert not seen & set(members) and publisher in members
        assert by_rank(key, members)[0] == publisher
        seen |= set(members)
    assert view.leader is None or view.leader in registrants


def _plan(codec: int):
    members = [Member("a", "x:1"), Member("b", "x:2")]
    return make_plan(
        "run", 3, 0, members, 4096, 256 if codec == SPARSE else 64, 1024, codec, top_k=16 if codec == SPARSE else 0
    )


PLANS = {codec: _plan(codec) for codec in (INT8, FP32, SPARSE)}


@MANY
@given(
    st.sampled_from([INT8, FP32, SPARSE]),
    st.builds(
        pb.PartChunk,
        offset=st.integers(0, 5000),
        length=st.integers(0, 3000),
        codec=st.integers(0, 5),
        block_size=st.sampled_from([0, 64, 256, 4096]) | st.integers(0, 1 << 20),
        values=st.binary(max_size=5000),
        scales=st.binary(max_size=200),
    ),
    st.booleans(),
    st.data(),
)
def test_a_wire_chunk_decodes_to_its_length_or_is_refused(codec, chunk, result, data):
    plan = PLANS[codec]
    part = plan.index_of("a")
    if data.draw(st.booleans()):  # a well-sized chunk with random bytes reaches the deeper checks
        chunk.offset, chunk.length = 0, min(1024, plan.parts[part][1])
        chunk.codec = plan.result_codec if result else plan.sender_codec
        chunk.block_size = plan.block_size
    try:
        payload = decode_chunk(chunk, plan, plan.parts[part][1], 0, result=result)
    except ChunkError:
        return
    assert numel_of(payload) == chunk.length


LAYOUT = Layout(("w", "b"), ((8, 4), (4,)), outer_momentum=True)


def _real_checkpoint() -> bytes:
    """A real checkpoint file's bytes, written to a directory that goes again (the mutations
    start from it; a directory left behind at each import piled up in /tmp)."""
    with tempfile.TemporaryDirectory(prefix="dtnode-real-ckpt-") as tmp:
        written = write_checkpoint(
            Path(tmp), 3, LAYOUT, TrainingState(torch.zeros(36), torch.zeros(36)), {"run_id": "run", "model_hash": "m"}
        )
        return written.path.read_bytes()


REAL = _real_checkpoint()


@SOME
@given(
    st.binary(max_size=2048)
    | st.builds(lambda cut, flip: _mutated(cut, flip), st.integers(0, len(REAL)), st.integers(0, 255))
)
def test_a_checkpoint_file_loads_checked_or_is_refused(raw):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt-3.safetensors"
        path.write_bytes(raw)
        try:
            loaded = read_checkpoint(path, LAYOUT, "run", "m")
        except CheckpointError:
            return
    assert loaded.theta_g.shape == (36,) and bool(torch.isfinite(loaded.theta_g).all())


def _mutated(at: int, value: int) -> bytes:
    """The real file cut at `at`, or with its byte there replaced (headers and tensors alike)."""
    if at % 2:
        return REAL[:at]
    raw = bytearray(REAL)
    raw[min(at, len(raw) - 1)] = value
    return bytes(raw)


@MANY
@given(
    st.binary(max_size=300)
    | st.builds(lambda v: __import__("json").dumps(v).encode(), json_only)
    | st.builds(
        lambda step, sha, size: (
            __import__("json").dumps({"outer_step": step, "sha256": sha, "size_bytes": size}).encode()
        ),
        json_only | st.integers(-5, 2**70),
        json_only | st.text(alphabet="0123456789abcdefABCDEFxyz/.", min_size=60, max_size=70),
        json_only | st.integers(-5, 2**70),
    )
)
def test_a_donors_checkpoint_metadata_is_checked_or_refused(raw):
    try:
        step, sha256, size = offer_metadata(raw)
    except DownloadError:
        return
    assert 0 <= step and len(sha256) == 64 and int(sha256, 16) >= 0 and size > 0


@MANY
@given(st.text(max_size=300) | st.builds(lambda v: __import__("json").dumps(v), json_only))
def test_a_published_recipe_is_a_recipe_or_none(text):
    recipe = SwarmRecipe.from_record(text)
    assert recipe is None or isinstance(recipe, SwarmRecipe)


@MANY
@given(st.binary(max_size=400) | st.builds(lambda v: __import__("json").dumps(v).encode(), json_only))
def test_a_dial_back_answer_is_an_answer_or_a_validation_error(raw):
    try:
        Reachability.model_validate_json(raw)
    except ValidationError:
        return


@MANY
@given(st.text(max_size=40))
def test_a_requested_step_is_a_step_or_a_bad_request(raw):
    try:
        step = path_step(raw)
    except web.HTTPBadRequest:
        return
    assert 0 <= step <= 1 << 62 and str(step) == raw.lstrip("0") or step == 0


@MANY
@given(st.dictionaries(st.sampled_from(["since", "limit", "peer", "x"]), st.text(max_size=30), max_size=4))
def test_history_and_dial_back_queries_parse_or_are_bad_requests(query):
    try:
        since, limit = history_query(query)
        assert -1 <= since and 1 <= limit <= 200
    except web.HTTPBadRequest:
        pass
    try:
        assert dialback_peer(query).isalnum()
    except web.HTTPBadRequest:
        pass


def test_the_checkpoint_header_length_is_bounded_before_it_is_read(tmp_path):
    """A header length of 2^63 is refused by its 8 bytes alone (no read of that much)."""
    path = tmp_path / "ckpt-3.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 63) + b"{}")
    with pytest.raises(CheckpointError, match="header"):
        read_checkpoint(path, LAYOUT, "run", "m")
