"""Catching up with the swarm: fetching its checkpoint (where the swarm is: swarm_position.py).

Donors are the live members that announce a checkpoint newer than ours for our model. Each
is asked for its checkpoint metadata (which also measures its latency); the file most
donors serve is downloaded from all of them at once (`catchup/download.py`), checked against the
sha256 of the metadata, and then validated like any other checkpoint (names, shapes,
dtypes, finiteness, run id, model hash). Any failure moves on to the next donor group, and
then to each donor of the group alone (to skip a liar).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp

from dtnode.daemon.catchup.download import DownloadError, Offer, auth_headers, download_parallel
from dtnode.daemon.catchup.partial_download import PIECE_BYTES, LocalDiskError
from dtnode.daemon.catchup.swarm_position import open_round
from dtnode.daemon.checkpoints.arrivals import Skip, Skipped
from dtnode.daemon.checkpoints.file_format import (
    MAX_STEP,
    CheckpointError,
    CheckpointInfo,
    Layout,
    LoadedCheckpoint,
    checkpoint_path,
    read_checkpoint,
)
from dtnode.peers.auth import SwarmAuth
from dtnode.peers.durable import fsync_dir
from dtnode.peers.membership import PeerRecord
from dtnode.peers.netgroups import url_group
from dtnode.peers.sidecar_address import PROBE_TIMEOUT_S

__all__ = ["PIECE_BYTES", "fetch_from_swarm"]

log = logging.getLogger(__name__)
SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")


async def probe(
    session: aiohttp.ClientSession, donor: PeerRecord, layout: Layout, timeout: float, auth: SwarmAuth | None = None
) -> Offer:
    base = donor.http_addr.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise DownloadError(f"peer {donor.peer_id} announces no usable HTTP address")
    started = time.monotonic()
    async with session.get(
        f"{base}/checkpoint", timeout=aiohttp.ClientTimeout(total=timeout), headers=auth_headers(auth, "/checkpoint")
    ) as resp:
        if resp.status != 200:
            raise DownloadError(f"{base}/checkpoint answered {resp.status}")
        raw = await resp.content.read(1 << 16)
    latency = time.monotonic() - started
    try:
        step, sha256, size = offer_metadata(raw)
    except DownloadError as e:
        raise DownloadError(f"{base}/checkpoint returned {e}") from None
    if step == donor.checkpoint_step and sha256 != donor.checkpoint_sha256:
        raise DownloadError("checkpoint hash differs from the donor's DHT record")
    if size > layout.file_size_bound():
        raise DownloadError(f"checkpoint of {size} bytes exceeds this model's bound of {layout.file_size_bound()}")
    return Offer(donor, base, step, sha256.lower(), size, latency, bound=_signed(donor, step, sha256))


def offer_metadata(raw: bytes) -> tuple[int, str, int]:
    """(outer step, sha256, size) of a donor's `GET /checkpoint` answer (untrusted);
    DownloadError when it is not one."""
    try:
        meta = json.loads(raw)
    except ValueError:
        raise DownloadError("malformed metadata") from None
    if not isinstance(meta, dict):
        raise DownloadError("malformed metadata")
    step, sha256, size = meta.get("outer_step"), meta.get("sha256"), meta.get("size_bytes")
    if (
        not isinstance(step, int)
        or isinstance(step, bool)
        or not 0 <= step <= MAX_STEP
        or not isinstance(sha256, str)
        or not SHA256_HEX.fullmatch(sha256)  # it names a file here: hex digits only, or this donor is dropped
        or not isinstance(size, int)
        or isinstance(size, bool)
        or size <= 0
    ):
        raise DownloadError("malformed metadata")
    return step, sha256, size


def _signed(record: PeerRecord | None, step: int, sha256: str) -> bool:
    """Whether a donor's signed record announces this very file."""
    return record is not None and record.announces(step, sha256)


async def with_voters(offers: list[Offer]) -> list[Offer]:
    """The offers, each with the network group its sidecar's host resolves to (its vote); each
    host is resolved once."""
    bases = sorted({o.base for o in offers})
    groups = dict(zip(bases, await asyncio.gather(*(url_group(b) for b in bases)), strict=True))
    return [replace(o, voter=groups[o.base] or "") for o in offers]


def group_offers(
    offers: list[Offer],
    majority_of: int | None = None,
    tiebreak: str = "",
    unseen: Mapping[int, set[str]] | None = None,
    skipped: list[Skipped] | None = None,
) -> list[list[Offer]]:
    """Donors serving the same file together, only the files the most network groups serve
    (oldest step first among equals, then in an order no donor controls: a hash of `tiebreak`,
    this node's id, and the file's).

    One vote per network group of the serving hosts (`Offer.voter`, peers/netgroups.py): a file
    no other group vouches for, while another file has more groups behind it, is never used, so
    one lying donor cannot hand a joiner a model of its own, not by announcing a newer step than
    the rest, nor through Sybil records that all point at its server under other names. Ties
    stay eligible (groups of a moshpit swarm legitimately hold different θ_g of one step), but
    never go to the newer step: at a round's end an honest donor may be a step ahead of another,
    and a liar one step ahead of a lone honest donor would win a tie otherwise; a joiner taking
    the older step downloads again if the swarm moved on. Nor to the faster donor: a liar can
    always answer first.

    Only an offer that its donor's signed record announces (`Offer.bound`) votes: a file no
    record vouches for is never used. Nor, for now, is a file that no more groups announce than
    serve another file of its step whose records are not all in, or are still writing that step
    unseen (`outserved`, `unseen`: see `unseen_writers`): a record lags its node by up to a
    heartbeat, and a liar announces at once, so right after a round the honest donors' new file
    had no vote yet and one liar's had one (seen in the hostile bench: a joiner installed the
    liar's θ_g + 1 of the round's step while 4 hosts served the honest file). With `majority_of` (a running node, which has a θ_g of
    its own to lose) a file is used only when more than half of that many hosts serve its
    step. When they serve it split over several files (the groups of a moshpit swarm), the
    caller must judge the file it downloads (`split_vote`, and `catchup/trust_radius.py`)."""
    by_file = _by_file(offers)
    votes = {key: host_votes(group) for key, group in by_file.items()}
    most = max(votes.values(), default=0)
    behind = outserved(offers, unseen)
    step_votes = {step: host_votes([o for o in offers if o.step == step]) for step in {o.step for o in offers}}
    groups = []
    for key, group in by_file.items():
        if not votes[key]:
            log.warning(
                "skipping step %d (sha256 %s) from %s: no signed record announces it",
                group[0].step,
                group[0].sha256[:12],
                ", ".join(o.base for o in group),
            )
            _note(skipped, Skip.UNANNOUNCED, group)
            continue
        if majority_of is not None and 2 * step_votes[key[0]] <= majority_of:
            log.warning(
                "not adopting step %d (sha256 %s): %d of the %d hosts this node can verify serve that step, "
                "not a majority",
                group[0].step,
                group[0].sha256[:12],
                step_votes[key[0]],
                majority_of,
            )
            _note(skipped, Skip.NO_MAJORITY, group, f"{step_votes[key[0]]} of {majority_of} hosts")
            continue
        if votes[key] < most:
            log.warning(
                "skipping %s: %s a checkpoint of step %d (sha256 %s) that %d other host(s) contradict",
                ", ".join(f"peer {o.donor.peer_id[-8:]} ({o.base})" for o in group),
                "they serve" if len(group) > 1 else "it serves",
                group[0].step,
                group[0].sha256[:12],
                most,
            )
            _note(skipped, Skip.CONTRADICTED, group, f"{most} other host(s) contradict it")
            continue
        if key in behind:
            log.warning(
                "not taking step %d (sha256 %s) from %s yet: more hosts serve another file of that step, or are "
                "writing it, than announce this one (their records may be a heartbeat behind)",
                group[0].step,
                group[0].sha256[:12],
                ", ".join(o.base for o in group),
            )
            _note(skipped, Skip.NOT_YET, group)
            continue
        groups.append(sorted(group, key=lambda o: o.latency))
    return sorted(groups, key=lambda g: (g[0].step, hashlib.sha256(f"{tiebreak}|{g[0].sha256}".encode()).digest()))


def _note(skipped: list[Skipped] | None, why: Skip, group: list[Offer], detail: str = "") -> None:
    """Records that the donors of `group` were passed over (see checkpoints/arrivals.py `Skip`)."""
    if skipped is not None:
        skipped.append(Skipped(why, tuple(o.donor.peer_id for o in group), group[0].step, detail))


def outserved(offers: list[Offer], unseen: Mapping[int, set[str]] | None = None) -> set[FileKey]:
    """The announced files (step, sha256, size) that no more network groups announce than serve
    another file of the same step, some of them unannounced yet, or than are writing that step
    unseen (`unseen_writers`): their lead (or tie) may be the records' lag or the round's last
    moments, not the swarm's (see `group_offers`). A host serving a file unannounced, or about
    to write one, can hold another file back this way until its record catches up, never make
    its own win: it still has no vote."""
    by_file = _by_file(offers)
    votes = {key: host_votes(group) for key, group in by_file.items()}
    serving = {key: {o.voter for o in group if o.voter} for key, group in by_file.items()}
    behind = {key for key in by_file if len(serving[key]) > votes[key]}  # some server's record does not announce it yet
    unseen = unseen or {}
    return {
        key
        for key in by_file
        if votes[key]
        and (
            any(votes[key] <= len(serving[rival]) for rival in behind if rival[0] == key[0] and rival != key)
            or votes[key] <= len(unseen.get(key[0], set()) - serving[key])
        )
    }


async def unseen_writers(
    members: Mapping[str, PeerRecord], probed: set[str], steps: set[int], model_hash: str, own_id: str = ""
) -> dict[int, set[str]]:
    """For each offered step, the network groups of the members this fetch did not probe whose
    records say they hold that step or are closing the round that writes it (their outer step
    one less, their open round past it): files of that step this node has not seen.

    Right after a round a liar that averaged alone is a step ahead at once, and announces its
    θ_g + 1 of the step the swarm is still writing; the honest donors were not donors of that
    step when this node probed them (the hostile bench's `trimmed-mean hostile-donors` row: a
    joiner downloaded the liar's step 4 while four honest hosts were averaging round 3, and kept a
    θ_g 347 away from the swarm's). A member that was probed and offered nothing is not counted:
    a donor whose sidecar does not answer must not hold every file back. Nor is this node's own
    record (`own_id`): a node restarted into a round it missed reads itself as closing it (seen in
    a long_swarms run: the restarted node held back both its donors' files of the step it missed).
    """
    writers: dict[int, set[str]] = {}
    for m in members.values():
        if (
            m.peer_id in probed
            or m.peer_id == own_id
            or m.model_hash != model_hash
            or not m.http_addr
            or m.client_mode
            or m.state not in ("training", "averaging")
        ):
            continue
        for step in steps:
            if (
                m.outer_step == step
                or m.checkpoint_step == step
                or (m.outer_step == step - 1 and open_round(m) >= step)
            ):
                writers.setdefault(step, set()).add(m.http_addr)
    urls = sorted({url for group in writers.values() for url in group})
    groups = dict(zip(urls, await asyncio.gather(*(url_group(url) for url in urls)), strict=True))
    return {step: {g for url in group if (g := groups[url]) is not None} for step, group in writers.items()}


FileKey = tuple[int, str, int]  # (step, sha256, size): one file, whoever serves it


def _by_file(offers: list[Offer]) -> dict[FileKey, list[Offer]]:
    """The offers grouped by the file they serve."""
    by_file: dict[FileKey, list[Offer]] = {}
    for offer in offers:
        by_file.setdefault((offer.step, offer.sha256, offer.size), []).append(offer)
    return by_file


def host_votes(offers: list[Offer]) -> int:
    """Distinct network groups among these offers whose signed records announce what they serve."""
    return len({o.voter for o in offers if o.bound and o.voter})


def split_vote(group: list[Offer], majority_of: int | None) -> bool:
    """Whether a running node (`majority_of` hosts it can verify) was offered this file by no
    majority of them: its step's majority is split over several files."""
    return majority_of is not None and 2 * host_votes(group) <= majority_of


async def fetch_from_swarm(
    members: dict[str, PeerRecord],
    own_id: str,
    steps: range,
    model_hash: str,
    run_id: str,
    layout: Layout,
    scratch: Path,
    timeout: float,
    auth: SwarmAuth | None = None,
    keep: bool = False,
    majority: bool = False,
    refresh: Callable[[], Awaitable[dict[str, PeerRecord]]] | None = None,
    bind_wait: float = 0.0,
    judge: Callable[[LoadedCheckpoint], Awaitable[str | None]] | None = None,
    judge_every: bool = False,
    skipped: list[Skipped] | None = None,
) -> LoadedCheckpoint | None:
    """The newest checkpoint with its step in `steps` that members serve, or None.

    With `keep`, the verified file becomes this node's own checkpoint of that step in
    `scratch` (its state dir): the bytes its group serves, not written a second time. With
    `majority` (a running node) its step must be served by a majority of the distinct hosts
    the members' records name; a file that no majority serves alone (a moshpit swarm's split
    vote) is kept only when `judge` returns no reason to refuse it; with `judge_every`, any file
    (a running node giving up steps of its own: a majority of the hosts left may be one liar). A donor may serve a step its record does not announce yet (a
    checkpoint written on demand, announced at its next heartbeat): with `refresh`, the
    records are read again for up to `bind_wait` seconds until one announces an offered file.
    Each donor or file passed over is logged, appended to `skipped` when given, and listed in the
    returned file's `download.passed_over` (the history's record of the download)."""
    skipped = skipped if skipped is not None else []
    donors = _donors(members, own_id, steps, model_hash)
    if not donors:
        return None
    scratch.mkdir(parents=True, exist_ok=True)
    fetch = _Fetch(
        layout, run_id, model_hash, scratch, timeout, auth, keep, judge, judge_every, time.monotonic(), skipped
    )
    async with aiohttp.ClientSession() as session:
        offers = await _offers(session, donors, steps, layout, timeout, auth, skipped)
        pending = _Unseen({d.peer_id for d in donors}, model_hash, own_id)

        async def probe_new(view: dict[str, PeerRecord]) -> list[Offer]:
            """Donors of these steps since the first probes (they finished writing one): asked too."""
            fresh = [d for d in _donors(view, own_id, steps, model_hash) if d.peer_id not in pending.probed]
            pending.probed.update(d.peer_id for d in fresh)
            if not fresh:
                return []
            return await with_voters(await _offers(session, fresh, steps, layout, timeout, auth, skipped))

        offers, members = await _bind(await with_voters(offers), members, pending, refresh, bind_wait, probe_new)
        unseen = await pending.of(members, offers)
        hosts = await _verifiable_hosts(members, own_id, model_hash) if majority else None
        _forget_partial_downloads(scratch, offers)
        try:
            for group in group_offers(offers, hosts, own_id, unseen, skipped):
                loaded = await fetch.from_group(session, group, hosts)
                if loaded is not None:
                    if loaded.download is not None:  # what this fetch left out, for the history
                        loaded.download = replace(loaded.download, passed_over=tuple(skipped))
                    return loaded
        except LocalDiskError as e:  # no donor is at fault, and none would do better
            log.error("could not download a checkpoint: %s (free space in the state dir, or fix it)", e)
    return None


async def _offers(
    session: aiohttp.ClientSession,
    donors: list[PeerRecord],
    steps: range,
    layout: Layout,
    timeout: float,
    auth: SwarmAuth | None,
    skipped: list[Skipped],
) -> list[Offer]:
    """What each donor offers of `steps`, probed at once (a donor that offers nothing usable is
    named in a warning and in `skipped`, and left out)."""
    probes = await asyncio.gather(
        *(probe(session, d, layout, min(timeout, PROBE_TIMEOUT_S), auth) for d in donors), return_exceptions=True
    )
    offers = []
    for donor, result in zip(donors, probes, strict=True):
        if isinstance(result, Offer):
            if result.step in steps:
                offers.append(result)
        else:
            log.warning("peer %s (%s) offers no usable checkpoint: %s", donor.peer_id[-8:], donor.http_addr, result)
            skipped.append(Skipped(Skip.NO_OFFER, (donor.peer_id,), detail=str(result)))
    return offers


def _forget_partial_downloads(scratch: Path, offers: list[Offer]) -> None:
    """Partial files of earlier downloads that nobody offers any more (the others resume)."""
    wanted = {o.sha256[:16] for o in offers}
    for stale in scratch.glob(".download-*"):
        if stale.name.split("-", 1)[1].split(".", 1)[0] not in wanted:
            stale.unlink(missing_ok=True)


@dataclass(frozen=True)
class _Fetch:
    """One `fetch_from_swarm`: how a group's file is downloaded, checked, judged and kept."""

    layout: Layout
    run_id: str
    model_hash: str
    scratch: Path
    timeout: float
    auth: SwarmAuth | None
    keep: bool
    judge: Callable[[LoadedCheckpoint], Awaitable[str | None]] | None
    judge_every: bool
    started: float
    skipped: list[Skipped]  # every donor or file passed over, appended to (see checkpoints/arrivals.py `Skip`)

    async def from_group(
        self, session: aiohttp.ClientSession, group: list[Offer], hosts: int | None
    ) -> LoadedCheckpoint | None:
        """The group's file from several donors at once; if the assembled file is bad, from
        each donor alone (to skip the liar). None: no donor of the group gave a usable file, or
        the judge refused it. A LocalDiskError goes up: no other donor would do better."""
        attempts = [group] + ([[o] for o in group] if len(group) > 1 else [])
        for attempt in attempts:
            path = None
            try:
                asked = time.monotonic()
                assembled = await download_parallel(session, attempt, self.scratch, self.timeout, self.auth)
                path = assembled.path
                downloaded = time.monotonic()
                loaded = await asyncio.to_thread(read_checkpoint, path, self.layout, self.run_id, self.model_hash)
                loaded.download = assembled.download
                if await self._refused(loaded, group, hosts):
                    return None  # the same verified bytes from any donor of the group
                loaded.timings = {
                    "asking": asked - self.started,
                    "transfer": downloaded - asked,
                    "checking": time.monotonic() - downloaded,
                }
                if self.keep:
                    await self._keep(loaded, path, attempt[0])
                for leftover in self.scratch.glob(".download-*"):
                    leftover.unlink(missing_ok=True)
                return loaded
            except LocalDiskError:
                raise
            except (TimeoutError, DownloadError, CheckpointError, aiohttp.ClientError, OSError, ValueError) as e:
                names = ", ".join(f"{o.donor.peer_id[-8:]} ({o.base})" for o in attempt)
                log.warning("could not sync from %s: %s; trying the next peer", names, e)
                _note(self.skipped, Skip.FAILED, attempt, str(e))
                if isinstance(e, CheckpointError):
                    return None  # the file itself is unusable: no donor of this group can help
            finally:
                if path is not None:
                    path.unlink(missing_ok=True)
        return None

    async def _refused(self, loaded: LoadedCheckpoint, group: list[Offer], hosts: int | None) -> bool:
        """Whether the judge refuses a file no majority serves (or any, with `judge_every`)."""
        if not (self.judge_every or split_vote(group, hosts)):
            return False
        refusal = await self.judge(loaded) if self.judge is not None else "nothing to judge it by"
        if refusal is None:
            return False
        log.warning(
            "not adopting step %d (sha256 %s), which %d of the %d hosts this node can verify serve: %s",
            loaded.step,
            group[0].sha256[:12],
            host_votes(group),
            hosts,
            refusal,
        )
        _note(self.skipped, Skip.REFUSED, group, refusal)
        return True

    async def _keep(self, loaded: LoadedCheckpoint, path: Path, offer: Offer) -> None:
        """The verified file becomes this node's own checkpoint of its step."""
        final = checkpoint_path(self.scratch, loaded.step)
        try:
            await asyncio.to_thread(_keep_as, path, final)
        except OSError as e:
            raise LocalDiskError(f"cannot keep {final.name} in the state dir: {e.strerror or e}") from None
        loaded.file = CheckpointInfo(loaded.step, final, offer.sha256, offer.size)


BIND_POLL_S = 0.1


def _keep_as(path: Path, final: Path) -> None:
    """The downloaded file (fsynced before it was hashed) renamed to a checkpoint, durably."""
    os.replace(path, final)
    fsync_dir(final.parent)


@dataclass(frozen=True)
class _Unseen:
    """`unseen_writers` of one fetch: the donors it probed, the model it fetches, the fetching node."""

    probed: set[str]
    model_hash: str
    own_id: str

    async def of(self, members: Mapping[str, PeerRecord], offers: list[Offer]) -> dict[int, set[str]]:
        return await unseen_writers(members, self.probed, {o.step for o in offers}, self.model_hash, self.own_id)


def _donors(members: Mapping[str, PeerRecord], own_id: str, steps: range, model_hash: str) -> list[PeerRecord]:
    """The members whose records say they hold a checkpoint of `steps` of this model, and whose
    sidecar others can reach."""
    return [
        m
        for m in members.values()
        if m.peer_id != own_id
        and m.model_hash == model_hash
        and (m.checkpoint_step in steps or m.outer_step in steps)
        and m.http_addr
        and not m.client_mode  # behind NAT: its sidecar is not reachable from outside
    ]


async def _bind(
    offers: list[Offer],
    members: dict[str, PeerRecord],
    unseen: _Unseen,
    refresh: Callable[[], Awaitable[dict[str, PeerRecord]]] | None,
    wait: float,
    probe_new: Callable[[dict[str, PeerRecord]], Awaitable[list[Offer]]] | None = None,
) -> tuple[list[Offer], dict[str, PeerRecord]]:
    """The offers, each bound when its donor's newest signed record announces its file, and the
    records read last; while none is, or an announced file is outserved by one not announced
    yet or written unseen (`outserved`), the records are read again (`refresh`) for up to
    `wait` seconds, and members that became donors meanwhile are asked too (`probe_new`)."""
    deadline = time.monotonic() + wait

    async def held() -> bool:
        return not any(o.bound for o in offers) or bool(outserved(offers, await unseen.of(members, offers)))

    while offers and refresh is not None and await held():
        # read at once first: the view predates the probes, and a donor announces a step as soon
        # as its hash is in, often before its metadata reached us
        members = await refresh()
        offers = [replace(o, bound=_signed(members.get(o.donor.peer_id), o.step, o.sha256)) for o in offers]
        if probe_new is not None:
            offers += await probe_new(members)
        if time.monotonic() >= deadline or not await held():
            break
        await asyncio.sleep(BIND_POLL_S)
    return offers, members


async def _verifiable_hosts(members: dict[str, PeerRecord], own_id: str, model_hash: str) -> int:
    """Distinct network groups whose signed records serve checkpoints of this model: what a
    majority is of."""
    urls = {
        m.http_addr
        for m in members.values()
        if m.peer_id != own_id
        and m.model_hash == model_hash
        and m.http_addr
        and not m.client_mode
        and m.state in ("training", "averaging")
    }
    groups = await asyncio.gather(*(url_group(url) for url in sorted(urls)))
    return len({g for g in groups if g is not None})
