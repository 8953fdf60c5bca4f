"""Where the node is, as one typed record with its legal moves, and the one place that says so.

Three things describe it, read by three audiences:
- `NodeState`: what an operator sees in `/status.state` (joining, syncing, training,
  averaging, stopped);
- `RoundPhase`: the finer step a chaos test keys on (`/status.phase`): inner, matchmaking,
  allreduce, averaging (waiting for an overlapped average), outer;
- `RecordPhase` with the round number and the θ_g step it starts from: what a joiner reads
  from the membership record to know which round it can still enter (see `catchup/joiner.py`).

Only the round loop (`rounds/loop.py`) moves it, through the methods below; an illegal move
raises `IllegalTransition` (a bug, caught by the round's error boundary like any other).
Every move peers must see goes out through `Publisher.publish()`, the one writer of the DHT
record and the state metric, so the last record stored never shows a state the node has left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from enum import StrEnum

from dtnode.daemon.telemetry.metrics import NodeMetrics
from dtnode.peers.hivemind_adapter import get_dht_time
from dtnode.peers.membership import PeerRecord

log = logging.getLogger("dtnode")


class NodeState(StrEnum):
    JOINING = "joining"
    SYNCING = "syncing"
    TRAINING = "training"
    AVERAGING = "averaging"
    STOPPED = "stopped"


class RoundPhase(StrEnum):
    STARTING = "starting"
    INNER = "inner"
    MATCHMAKING = "matchmaking"
    ALLREDUCE = "allreduce"
    AVERAGING = "averaging"  # --overlap: waiting for the previous round's average
    OUTER = "outer"


class RecordPhase(StrEnum):
    """The round's phase in a joiner's terms: `inner` and `matchmaking` are open (a joiner
    may still enter the round), `averaging` and `outer` closed; none between rounds."""

    NONE = ""
    INNER = "inner"
    MATCHMAKING = "matchmaking"  # published only: averaging while hop 0's group still forms
    AVERAGING = "averaging"
    OUTER = "outer"


class IllegalTransition(RuntimeError):
    """A move the state machine does not allow: a bug in the round loop."""


# A download (syncing) returns to the state it interrupted; nothing leaves `stopped`.
STATE_MOVES: dict[NodeState, frozenset[NodeState]] = {
    NodeState.JOINING: frozenset({NodeState.SYNCING, NodeState.STOPPED}),
    NodeState.SYNCING: frozenset({NodeState.TRAINING, NodeState.AVERAGING, NodeState.STOPPED}),
    NodeState.TRAINING: frozenset({NodeState.AVERAGING, NodeState.SYNCING, NodeState.STOPPED}),
    NodeState.AVERAGING: frozenset({NodeState.TRAINING, NodeState.SYNCING, NodeState.STOPPED}),
    NodeState.STOPPED: frozenset(),
}
# The joiner-facing phase: a round opens in `inner`, closes in `averaging`, applies in `outer`;
# a download clears it; a failed round re-enters `inner` from wherever it was.
RECORD_MOVES: dict[RecordPhase, frozenset[RecordPhase]] = {
    RecordPhase.NONE: frozenset({RecordPhase.INNER}),
    RecordPhase.INNER: frozenset({RecordPhase.AVERAGING, RecordPhase.NONE}),
    RecordPhase.AVERAGING: frozenset({RecordPhase.OUTER, RecordPhase.INNER, RecordPhase.NONE}),
    RecordPhase.OUTER: frozenset({RecordPhase.INNER, RecordPhase.NONE}),
    RecordPhase.MATCHMAKING: frozenset(),  # never held, only published
}


class RoundState:
    """The node's state, phase and round, moved only through its methods."""

    def __init__(self, overlap: bool, dht_time: Callable[[], float] = get_dht_time):
        self.overlap = overlap
        self.dht_time = dht_time
        self.state = NodeState.JOINING
        self.phase = RoundPhase.STARTING
        self.round = -1  # the round in progress (trained, averaged or applied)
        self.record_phase = RecordPhase.NONE
        self.start_step = -1  # the step of the θ_g that round starts from
        self.training_round = 0  # --overlap: the round whose inner steps run (one past the outer step)
        self.first_group_formed = False  # while not, a round being averaged still takes members (hop 0)
        # the first round whose Δ this node averages since it started or last downloaded (None: it
        # has entered none yet): hop 0 of an earlier round must not wait for it (see `first_round`
        # in peers/membership.py)
        self.first_round: int | None = None
        self.grid_dims = 0  # the hops of the grid this node's last average used (0: none yet)
        # (round, DHT time) at which this node entered its last round, and moved to when that
        # round's inner steps begin: peers end a time-paced round together from the round's
        # starts (peers/pacing.py `swarm_round_began`)
        self.inner_began: tuple[int, float] = (-1, 0.0)

    def _move(self, state: NodeState) -> None:
        if state != self.state and state not in STATE_MOVES[self.state]:
            raise IllegalTransition(f"state {self.state} -> {state}")
        self.state = state

    def _move_record(self, phase: RecordPhase) -> None:
        if phase != self.record_phase and phase not in RECORD_MOVES[self.record_phase]:
            raise IllegalTransition(f"round phase {self.record_phase!r} -> {phase!r}")
        self.record_phase = phase

    # ---- the moves --------------------------------------------------------------------------
    def start_syncing(self) -> None:
        """The node reaches the swarm for the first time (after its services started)."""
        self._move(NodeState.SYNCING)

    def ready(self) -> None:
        """In step with the swarm (or alone): about to train its first round."""
        self._move(NodeState.TRAINING)

    def enter_round(self, round_no: int, start_step: int) -> None:
        """Round `round_no` is open on this node: its inner steps start (or are about to)."""
        self._move(NodeState.TRAINING)
        self._move_record(RecordPhase.INNER)
        self.round, self.start_step, self.phase = round_no, start_step, RoundPhase.INNER
        if self.inner_began[0] != round_no:
            self.inner_began = (round_no, self.dht_time())
        if self.first_round is None:
            self.first_round = round_no

    def use_grid(self, dims: int) -> None:
        """The averager's grid for the round it averages: published, so that peers whose counts
        of the swarm differ take the same grid (peers/grid.py `agreed_dims`)."""
        self.grid_dims = dims

    def begin_inner(self, round_no: int) -> None:
        """The inner steps of `round_no` begin now: published as `round_began_at`."""
        self.inner_began = (round_no, self.dht_time())

    def train(self, round_no: int) -> None:
        """--overlap: peers count this node's tokens under `round_no` (published at once)."""
        self.training_round = round_no

    def begin_averaging(self) -> None:
        """The round's inner steps are done: it is closed to joiners. Without --overlap the
        node now averages; with it, the node settles the previous average and trains on."""
        if not self.overlap:
            self._move(NodeState.AVERAGING)
            self.first_group_formed = False
        self._move_record(RecordPhase.AVERAGING)

    def averager_phase(self, phase: str) -> None:
        """The averager's progress (matchmaking, allreduce); a formed group closes hop 0."""
        self.phase = RoundPhase(phase)
        if self.phase == RoundPhase.ALLREDUCE:
            self.first_group_formed = True

    def waiting_for_average(self) -> None:
        self.phase = RoundPhase.AVERAGING

    def applying_outer_step(self) -> None:
        self.phase = RoundPhase.OUTER

    def outer_applied(self) -> None:
        self._move_record(RecordPhase.OUTER)

    @contextlib.contextmanager
    def syncing(self) -> Iterator[None]:
        """A download: the node is syncing, in no round, until it is back where it was."""
        previous = self.state
        self._move(NodeState.SYNCING)
        self._move_record(RecordPhase.NONE)
        self.first_round = None  # a download gives up any Δ still to average (the landing forgets it)
        try:
            yield
        finally:
            self._move(previous)

    def stop(self) -> None:
        self._move(NodeState.STOPPED)

    # ---- what the record says ----------------------------------------------------------------
    def published_phase(self) -> RecordPhase:
        """`matchmaking` (open) while averaging and hop 0's group, which waits for peers that
        train this round, has not formed yet; else the phase held."""
        if self.record_phase == RecordPhase.AVERAGING and not self.first_group_formed and not self.overlap:
            return RecordPhase.MATCHMAKING
        return self.record_phase

    @property
    def in_round(self) -> bool:
        return self.record_phase != RecordPhase.NONE

    @property
    def round_began_at(self) -> float:
        """DHT time at which the inner steps of the round in progress began, or at which the
        node entered it while they are about to (0.0: no round in progress)."""
        round_no, at = self.inner_began
        return at if self.in_round and round_no == self.round else 0.0

    @property
    def serving(self) -> bool:
        """Whether θ_g is settled enough to be served on demand (training or averaging)."""
        return self.state in (NodeState.TRAINING, NodeState.AVERAGING)


class Publisher:
    """The one writer of what peers and operators read of the node's state: the DHT record
    (built fresh by `record`) and the state metric. `/status` reads the same RoundState.

    A round's moves go out without holding the round up: a store of the record asks several DHT
    nodes and waits for them, 0.2-1.9 s each on a loaded 32-node box, and a round published
    three times on its way (averaging begins, the outer step applied, the next round entered),
    which was seconds between the end of its inner steps and its registration for hop 0, and
    between its average and its next steps (issue 60). One background store runs at a time, with the
    record as it stands when the store starts; a move made while one is in flight is stored
    once more after it, so the last move always goes out and the moves in between, which no
    peer would read anyway (peers read the record a heartbeat at a time), are skipped."""

    def __init__(
        self,
        state: RoundState,
        record: Callable[[], PeerRecord],
        announce: Callable[[PeerRecord], Awaitable[bool]],
        metrics: NodeMetrics,
    ):
        self.state = state
        self.record = record
        self._announce = announce
        self.metrics = metrics
        self._storing: asyncio.Future[None] | None = None
        self._moved = False  # the state moved while a store was in flight: one more store after it

    def publish(self) -> None:
        """The state as it stands: the metric at once, the record stored in the background."""
        self.metrics.state.state(self.state.state.value)
        if self._storing is not None and not self._storing.done():
            self._moved = True
            return
        self._storing = asyncio.ensure_future(self._store_until_current())

    async def publish_now(self) -> None:
        """The state as it stands, stored before this returns (its failure raised): at the start,
        before the node waits for its peers, and on the way out. It goes beside a store in
        flight, not after it: the DHT keeps the record with the later expiry, this one."""
        self.metrics.state.state(self.state.state.value)
        await self._announce(self.record())

    async def _store_until_current(self) -> None:
        while True:
            self._moved = False
            try:
                await self._announce(self.record())
            except Exception as e:  # noqa: BLE001  (hivemind's DHT stores fail with many types; the heartbeat retries)
                log.debug("could not store this node's record at once: %s", e)
            if not self._moved:
                return
