"""Swarm membership over hivemind's DHT.

Each node keeps one record under `{run_id}.peers`, subkey its peer id followed by its RSA
public key, refreshed by a heartbeat and expiring `ttl` seconds after the last one: a
crashed node drops out by itself. The DHT runs hivemind's RSA signature validator, so a
subkey that names a public key can only be written with that key's signature: nobody can
overwrite another peer's record. That key is the peer's identity key, whose hash is its
peer id (identity.py): a reader accepts a record only under its own peer's key, so nobody
can file a record for an id they do not hold; with a swarm key, each record also carries a
tag only key holders can make. Records read back are untrusted input
and validated field by field; a malformed record is skipped, never allowed to break the
reader.

A lookup that misses a record (a replica holding it is unreachable for a moment) does not
make the peer vanish: each record counts until its own expiry, so a flaky DHT read can not
make a node believe it is alone and race ahead with solo rounds. A node whose DHT routing
table empties (its link went down, every neighbour was evicted) reconnects to its initial
peers and to the peers it saw recently, so a healed partition heals the DHT too.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import dht_requests
from .auth import AuthError, SwarmAuth
from .dht_in_process import SwarmDHT
from .dht_requests import DhtKey, DhtOp
from .hivemind_adapter import DHTNode, Multiaddr, PeerID, RSASignatureValidator, get_dht_time
from .identity import signed_subkey, writer_key, writer_of
from .near_store import store_near
from .tls import MAX_SIGNATURE_CHARS, TrustStore

log = logging.getLogger(__name__)

REMEMBER_PEERS_S = 600.0  # how long a peer seen once is worth a reconnection attempt
VIEW_REUSE_S = 0.1  # callers that ask for the view at once (a poll asks twice) share one DHT read
# how old a view matchmaking's polls may share, up to FULL_RATE_PEERS peers (stretched above, as
# the pacer's reads are): a poll comes every fraction of a second, each read of the membership
# brings all n records back (issue 60: most of a node's DHT bytes in a round), and a record
# changes once a heartbeat; what a poll must see at once (registrations, lists) is read each poll
MATCHMAKING_VIEW_S = 1.0
# how far a wait for --min-peers slows its polls while the count of ready peers stands still
# (`Membership.wait_for`): from `poll` to this many times it
WAIT_POLL_BACKOFF = 2
# heartbeats whose store may be in flight at once (`Membership.heartbeat`): enough to span the
# 6 s a store waits on a node that never answers, at the default 2 s beat and the tests' 1 s
MAX_BEATS_IN_FLIGHT = 8
# heartbeats stored straight on the routing table's nearest nodes (near_store.py) for each one
# stored through hivemind's search of the DHT, which refreshes the table near the key: a record
# lives three beats (--peer-ttl), so the one a search placed lasts until the next search's, even
# where this node's table were wrong about the nearest nodes and its direct stores went astray
DIRECT_STORES_PER_SEARCH = 2


MAX_RECORDS = 4096  # valid records of distinct writers read per lookup: a Sybil flood stays bounded


class JoinError(RuntimeError):
    """The DHT could not be started or the initial peers could not be reached."""


class SwarmMismatch(JoinError):
    """The swarm trains another model, recipe or run, averages over another data plane or
    protocol: this node, as configured, can never join it, and starting it again cannot help
    (its own exit code, so that a supervisor does not restart it every few seconds)."""


class PeerRecord(BaseModel):
    """What a node announces about itself (see ARCHITECTURE.md, membership record)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    peer_id: str = Field(max_length=128)
    grpc_addr: str = Field("", max_length=256)
    http_addr: str = Field("", max_length=256)
    state: str = Field("joining", max_length=32)
    outer_step: int = Field(0, ge=0, le=1 << 62)
    checkpoint_step: int = Field(-1, ge=-1, le=1 << 62)
    checkpoint_sha256: str = Field("", max_length=64)
    # "step:sha256" of the checkpoints it served lately (the newest one above included): what a
    # joiner's vote binds an offer to, also after this peer moved on by the next heartbeat
    served: tuple[Annotated[str, Field(max_length=96)], ...] = Field((), max_length=8)
    tokens_per_s: float = Field(0.0, ge=0, le=1e15)
    round_tokens: int = Field(0, ge=0, le=1 << 62)  # tokens processed so far in round `round_in_training`
    training_round: int = Field(-1, ge=-1, le=1 << 62)  # the round of those tokens; -1: `outer_step`
    # Where this peer is, so a joiner knows which round it can still enter (daemon/catchup/donors.py):
    round: int = Field(-1, ge=-1, le=1 << 62)  # the round in progress (trained, averaged or applied); -1: none
    phase: str = Field("", max_length=16)  # "inner", "matchmaking" (open), "averaging", "outer" (closed)
    round_checkpoint: int = Field(-1, ge=-1, le=1 << 62)  # the step of the θ_g that round `round` starts from
    # The first round whose Δ this peer averages since it started or last downloaded (-1: it has
    # entered none yet, and is counted as before: a node that waits to enter round 0 is waited
    # for). A joiner of an --overlap swarm enters round r while round r-1 is averaged, with a
    # record just like its peers'; without this, hop 0 of round r-1 waited for it and, as it never
    # came, counted it a no-show and left it out of round r (its first Δ alone).
    first_round: int = Field(-1, ge=-1, le=1 << 62)
    # DHT time at which its inner steps of `round` began, or at which it entered `round` while
    # they are about to (0: in no round, or an older dtnode). Peers whose rounds are paced by time
    # end a round together, --round-seconds after the median peer began it (daemon/rounds/pacer.py),
    # so that one whose last average ended early trains on rather than waiting at the next hop 0
    round_began_at: float = Field(0.0, ge=0, le=1e12)
    # The hops of the grid this peer's last average used (0: none yet): a node takes the grid most
    # of its round's peers used, so views that count different populations still share one grid
    # (peers/grid.py `agreed_dims`).
    grid_dims: int = Field(0, ge=0, le=16)
    dht_addrs: tuple[str, ...] = Field((), max_length=4)  # multiaddrs a restarted peer can bootstrap from
    tokens_per_step: int = Field(0, ge=0, le=1 << 40)  # batch x sequence: sizes the swarm's round
    progress_at: float = Field(0.0, ge=0, le=1e12)  # DHT time at which round_tokens was counted
    bandwidth_mbps: float = Field(1000.0, gt=0, le=1e9)
    device: str = Field("cpu", max_length=32)
    client_mode: bool = False
    model_hash: str = Field("", max_length=64)
    version: str = Field("", max_length=32)
    # its TLS certificate's signature, base64 (the rest of the certificate follows from the key
    # the record is filed under and the peer id: peers/tls.py); empty: plaintext data plane
    tls_sig: str = Field("", max_length=MAX_SIGNATURE_CHARS)
    auth: str = Field("", max_length=512)
    # the sha256 of its recipe's JSON, what peers must share (daemon/workload/recipe.py): the JSON
    # itself is at its sidecar's /recipe, for a joiner whose own hash differs to read the fields
    recipe_sha256: str = Field("", max_length=64)
    wire_protocol: int = Field(0, ge=0, le=1_000_000)  # its data-plane protocol (peers/wire.py); 0: not said
    # For operators comparing peers (`dtnode status`, the dashboard); no decision rests on them:
    theta_sha256: str = Field("", max_length=64)  # its θ_g's hash as of outer_step: who is in step with whom
    loss: float | None = Field(None, ge=0, le=1e6, allow_inf_nan=False)  # its last inner loss
    condition: str = Field("", max_length=16)  # its one-word condition: ok, alone, failing, ...

    def announces(self, step: int, sha256: str) -> bool:
        """Whether this (signed) record announces the checkpoint of `step` with this hash."""
        sha256 = sha256.lower()
        return (self.checkpoint_step == step and self.checkpoint_sha256.lower() == sha256) or (
            f"{step}:{sha256}" in self.served
        )

    @property
    def round_in_training(self) -> int:
        """The round whose inner steps `round_tokens` counts: the outer step being built, or
        with --overlap the one after it (the outer step comes a round late)."""
        return self.training_round if self.training_round >= 0 else self.outer_step

    def auth_subject(self) -> str:
        cert = hashlib.sha256(self.tls_sig.encode()).hexdigest() if self.tls_sig else ""
        return f"record|{self.peer_id}|{self.grpc_addr}|{self.http_addr}|{self.client_mode}|{cert}"


async def _neighbour_count(_dht: SwarmDHT, node: DHTNode) -> int:
    """Runs on the DHT node: how many peers its routing table holds."""
    return len(node.protocol.routing_table.uid_to_peer_id)


async def _reconnect(initial: list[str], recent: list[str], _dht: SwarmDHT, node: DHTNode) -> int:
    """Runs on the DHT node: dial the initial multiaddrs, ping every peer (a ping that is
    answered puts the peer back in the routing table, and us in its). Returns the answers."""
    targets = set()
    for addr in initial:
        try:
            maddr = Multiaddr(addr)
            peer = PeerID.from_base58(maddr["p2p"])
            await asyncio.wait_for(
                node.p2p._client.connect(peer, [maddr.decapsulate(Multiaddr(f"/p2p/{peer}"))]),
                node.protocol.wait_timeout,
            )
            targets.add(peer)
        except Exception as e:  # noqa: BLE001  (hivemind's client raises many types; unreachable still)
            log.debug("redialling %s failed: %s; the next heartbeat tries again", addr, e)
    for peer in recent:
        try:
            targets.add(PeerID.from_base58(peer))
        except ValueError:
            log.debug("skipping a malformed peer id %r", peer)
    answers = await asyncio.gather(*(node.protocol.call_ping(p) for p in targets), return_exceptions=True)
    return sum(1 for a in answers if a is not None and not isinstance(a, BaseException))


class Membership:
    """This node's record in the DHT, and the swarm as the DHT shows it."""

    def __init__(
        self,
        dht: SwarmDHT,
        run_id: str,
        ttl: float,
        interval: float,
        validator: RSASignatureValidator | None = None,
        auth: SwarmAuth | None = None,
        initial_peers: list[str] | None = None,
        trust: TrustStore | None = None,
    ):
        self.dht = dht
        self.trust = trust  # learns each peer's TLS certificate from its verified record
        self.initial_peers = list(initial_peers or [])
        self.key = f"{run_id}.peers"
        self.ttl = ttl
        self.interval = interval
        self.peer_id = str(dht.peer_id)
        self.auth = auth
        self.subkey = signed_subkey(self.peer_id, validator.local_public_key if validator is not None else b"")
        self._records: dict[str, tuple[float, PeerRecord]] = {}  # peer id -> (its expiry, the record)
        self._seen: dict[str, float] = {}  # peer id -> when its record was last read (monotonic)
        self._isolated = False
        self._read_at = -1.0  # monotonic time of the last DHT read: polls within VIEW_REUSE_S share it
        # records stored from the routing table since the last store that searched the DHT
        # (near_store.py); the first store searches, as the table holds only the initial peers
        self._direct_stores = DIRECT_STORES_PER_SEARCH

    def beat_s(self) -> float:
        """Seconds between this node's heartbeats: `interval` up to FULL_RATE_PEERS peers in its
        view, stretched in proportion above (`dht_requests.poll_stretch`), its record's life with
        it (`record_ttl`). A heartbeat is a store, and hivemind's search for the nodes that keep
        the key brings the key's whole value back from each node it asks: every record of the
        swarm, so a node's beats cost it and the nodes it asks in proportion to n, and the
        swarm's idle CPU grew as n² (issue 60: 23 nodes waiting for a 24th burned 2.1 cores).
        Stretched, what a node moves per second stays flat as the swarm grows; its record is as
        fresh as the pacer's reads of it, which are stretched alike."""
        return self.interval * dht_requests.poll_stretch(len(self._records))

    def record_ttl(self) -> float:
        """How long this node's next record lives without a heartbeat (see `beat_s`)."""
        return self.ttl * dht_requests.poll_stretch(len(self._records))

    def complete_view_s(self) -> float:
        """How old a view may be and still hold every live peer's record: a peer beats every
        `beat_s`, so the record of it a read finds lives `record_ttl - beat_s` after the read at
        least, while its beats land. A reader that needs no newer view than that (gauges, the known-peers file) shares
        the last read instead of making one."""
        return max(0.0, self.record_ttl() - self.beat_s())

    async def announce(self, record: PeerRecord) -> bool:
        """Store this node's record (tagged, with a swarm key), living `record_ttl`: two stores in
        three straight on the nodes nearest the key in the routing table (near_store.py), the
        third through hivemind's search for them. True if a replica took it."""
        if self.auth is not None:
            record = record.model_copy(update={"auth": self.auth.issue("record", record.auth_subject())})
        dht_requests.count(DhtOp.STORE, DhtKey.MEMBERSHIP)
        expiry = get_dht_time() + self.record_ttl()
        stored = False
        if self._direct_stores < DIRECT_STORES_PER_SEARCH:
            took = await self.dht.run_coroutine(
                partial(store_near, self.key, self.subkey, record.model_dump(), expiry, dht_requests.REPLICAS),
                return_future=True,
            )
            stored = bool(took)
            self._direct_stores += stored
        if not stored:  # every few beats, and whenever the routing table could not place the record
            self._direct_stores = 0
            stored = bool(
                await self.dht.store(
                    self.key,
                    subkey=self.subkey,
                    value=record.model_dump(),
                    expiration_time=expiry,
                    beam_size=dht_requests.READ_BEAM,
                    return_future=True,
                )
            )
        # this node's view holds its own record as written, without reading it back (beats overlap:
        # one that lands late does not replace a newer record)
        if stored and expiry >= self._records.get(record.peer_id, (0.0, None))[0]:
            self._records[record.peer_id] = (expiry, record)
        return stored

    def _accept(self, writer: str, record: PeerRecord) -> bool:
        """Filed under its own peer id and that id's own key (identity.py), tagged when keyed."""
        if writer != record.peer_id:
            log.debug("ignoring a record for %s not signed with that peer's own key", record.peer_id)
            return False
        if self.auth is not None:
            try:
                self.auth.verify(
                    "record", record.auth_subject(), record.auth, peer_id=record.peer_id, single_use=False, max_age=None
                )
            except AuthError:
                return False
        return True

    async def heartbeat(self, make_record: Callable[[], PeerRecord], stopped: asyncio.Event) -> None:
        """Re-announce every `beat_s` until `stopped`; then let the record expire on its own.

        Beats go out on schedule, each in a task of its own (up to MAX_BEATS_IN_FLIGHT at once),
        never one after the other: a store waits for every DHT node it asks, and one that holds
        its connection but never answers (a peer paused or frozen, a host black-holed) costs it
        two of hivemind's request timeouts, 6 s (its search for the nodes that keep the key, then
        its write), until that node is evicted. Beating in turn, every node near it went 6 s and
        a beat without a beat, past a record's life (6 s by default): they dropped out of each
        other's views at once, formed their groups without each other, and the swarm's θ_g split
        over one paused peer. On schedule, each beat reaches the live nodes once its search gave
        up on the frozen one (3 s, measured on loopback), inside a record's life at the defaults
        (a beat of 2 s, a life of 6 s)."""
        beats: set[asyncio.Task[None]] = set()
        try:
            while not stopped.is_set():
                beats = {b for b in beats if not b.done()}
                if len(beats) < MAX_BEATS_IN_FLIGHT:
                    beats.add(asyncio.ensure_future(self._beat(make_record())))
                try:
                    await self.reconnect_if_isolated()
                except Exception as e:  # noqa: BLE001  (hivemind's DHT calls fail with many types; the next beat retries)
                    log.warning("DHT reconnection failed: %s", e)
                try:
                    await asyncio.wait_for(stopped.wait(), self.beat_s())
                except TimeoutError:
                    pass
        finally:
            for beat in beats:
                beat.cancel()
            await asyncio.gather(*beats, return_exceptions=True)

    async def _beat(self, record: PeerRecord) -> None:
        """One heartbeat's store; a failure is logged (the next beat retries: a record outlives a
        couple of missed beats)."""
        try:
            await self.announce(record)
        except Exception as e:  # noqa: BLE001  (hivemind's DHT calls fail with many types)
            log.warning("heartbeat failed: %s", e)

    async def reconnect_if_isolated(self) -> None:
        """With no DHT neighbour left, dial the initial peers and the peers seen recently."""
        if await self.dht.run_coroutine(_neighbour_count, return_future=True) > 0:
            if self._isolated:
                log.info("DHT reconnected")
                self._isolated = False
            return
        known = [p for p in self._seen if p != self.peer_id]  # members() forgets the long unseen
        if not known and not self.initial_peers:
            return  # the first node of a swarm, still alone: nothing to reconnect to
        if not self._isolated:
            log.warning(
                "lost every DHT neighbour; reconnecting to %d initial and %d recent peers",
                len(self.initial_peers),
                len(known),
            )
            self._isolated = True
        await self.dht.run_coroutine(partial(_reconnect, self.initial_peers, known), return_future=True)

    async def members(self, max_age: float = VIEW_REUSE_S) -> dict[str, PeerRecord]:
        """Live, well-formed records by peer id (this node's own included), each until its expiry;
        read from the DHT unless the last read is under `max_age` seconds old."""
        if time.monotonic() - self._read_at < max_age:
            return self._live(get_dht_time())
        self._read_at = time.monotonic()
        try:
            dht_requests.count(DhtOp.GET, DhtKey.MEMBERSHIP)
            found = await self.dht.get(self.key, latest=True, beam_size=dht_requests.READ_BEAM, return_future=True)
        except Exception as e:  # noqa: BLE001  (hivemind's DHT reads fail with many types)
            log.warning("membership lookup failed: %s; using the records read before", e)
            found = None
        now = get_dht_time()
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        valid = 0
        for subkey, item in entries.items():
            writer = writer_of(subkey)  # checked before anything is parsed
            if writer is None:
                continue
            try:
                expiry = float(item.expiration_time)
                record = PeerRecord.model_validate(item.value)
            except (ValidationError, AttributeError, TypeError, ValueError):
                log.debug("skipping malformed membership record under %r", subkey)
                continue
            if expiry < now or not self._accept(writer, record):
                continue  # a record must describe the peer it is filed under, signed by it
            valid += 1
            if valid > MAX_RECORDS:
                break
            if expiry >= self._records.get(record.peer_id, (0.0, None))[0]:
                self._records[record.peer_id] = (expiry, record)
                public = writer_key(subkey) if self.trust is not None and record.tls_sig else None
                if self.trust is not None and public is not None:
                    self.trust.learn_signed(record.peer_id, public, record.tls_sig)
            self._seen[record.peer_id] = time.monotonic()
        self._records = {p: (e, r) for p, (e, r) in self._records.items() if e >= now}
        cutoff = time.monotonic() - REMEMBER_PEERS_S
        self._seen = {p: seen for p, seen in self._seen.items() if seen > cutoff}
        if self.trust is not None:
            self.trust.forget_unseen(REMEMBER_PEERS_S)
        return self._live(now)

    async def recent_members(self) -> dict[str, PeerRecord]:
        """The view as matchmaking polls it and a round's checks on its way read it: read at
        most MATCHMAKING_VIEW_S ago, stretched by `dht_requests.poll_stretch` above
        FULL_RATE_PEERS peers (see MATCHMAKING_VIEW_S). A round's start and end read the view the
        pacer's last poll brought, not one of their own each: every read waits on several DHT
        nodes (0.3-2.2 s on a loaded 32-node box), between the round's steps and its hop 0."""
        return await self.members(MATCHMAKING_VIEW_S * dht_requests.poll_stretch(len(self._records)))

    def _live(self, now: float) -> dict[str, PeerRecord]:
        return {p: r for p, (e, r) in self._records.items() if e >= now}

    async def wait_for(self, count: int, timeout: float, poll: float = 0.5) -> dict[str, PeerRecord]:
        """Until `count` peers are ready to train (not still starting or syncing), or `timeout`;
        returns those ready. Counting one that is still downloading would start round 0 without
        it, and it would then enter the swarm a round later.

        Polls every `poll` seconds while the count of ready peers moves, and backs off to
        WAIT_POLL_BACKOFF times that while it stands still; both less often in a large swarm
        (`dht_requests.poll_stretch`). Each poll is a read that brings every record back from
        each node it asks, and a swarm that waits for its last peers spends most of its wait
        with the count unchanged: the reads were most of what a waiting node cost (issue 60)."""
        deadline = time.monotonic() + timeout
        ready_before = -1
        interval = poll
        while True:
            everyone = await self.members()
            view = {p: r for p, r in everyone.items() if r.state in ("training", "averaging")}
            if len(view) >= count or time.monotonic() >= deadline:
                return view
            interval = poll if len(view) != ready_before else min(interval * 2, poll * WAIT_POLL_BACKOFF)
            ready_before = len(view)
            await asyncio.sleep(
                min(interval * dht_requests.poll_stretch(len(everyone)), max(0.0, deadline - time.monotonic()))
            )
