"""The DHT entries of one group key: registrations and member lists, read untrusted and
written signed.

Anyone can write under a group key, so every entry is taken by its writer (the owner-signed
subkey, `identity.py`), checked against the swarm key when there is one, parsed with bounds,
and capped at MAX_REGISTRANTS per key before anything else is done with it. `Matchmaker`
(matchmaking.py) decides the groups from what a `GroupBoard` reads.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import dht_requests
from .auth import AuthError, SwarmAuth
from .dht_in_process import SwarmDHT
from .dht_requests import DhtKey, DhtOp
from .hivemind_adapter import get_dht_time
from .identity import signed_subkey, writer_of
from .leadership import ClosedList
from .plan import Member

MAX_LOAD = 16  # groups one peer stands in through a hop at most (each holds a model-sized buffer)
MAX_REGISTRANTS = 4096  # valid entries of distinct writers read per group key: a flood stays bounded
LIST_TTL_S = 120.0  # closed, formed and declined member lists outlive every hop that reads them
REGISTRATION_TTL_S = 60.0  # a registration outlives its window by this much (late readers still see it)


class Registration(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    grpc_addr: str = Field("", max_length=256)
    client_mode: bool = False
    bandwidth_mbps: float = Field(1000.0, gt=0, le=1e9)
    resync: bool = False  # asks the group to also average θ_g this hop (after a failure, a join)
    theta: str = Field("", max_length=64)  # sha256 of the θ_g it would re-sync from ("": not known)
    # its Δ's weight here (tokens): its streams may claim no more, and the group's plan caps it;
    # never 0 (a weight of 0 used to switch every cap of its group off)
    weight: float = Field(1.0, gt=0, le=1e12)
    # the share of its previous group's mean it brings (moshpit classes): its weight in a θ_g re-sync
    share: float = Field(1.0, gt=0, le=1)
    # the groups its member stands in this hop, each an all-reduce at once on its link and cores:
    # the group's deadline allows for the most loaded member's (a peer alone in its hop-0 cell
    # stands in every class of hop 1, and was cut from all of them on deadlines made for one)
    load: int = Field(1, ge=1, le=MAX_LOAD)
    auth: str = Field("", max_length=512)

    def subject(self, key: str) -> str:
        """What the swarm-key tag of this registration signs."""
        subject = (
            f"{key}|{self.grpc_addr}|{self.client_mode}|{self.bandwidth_mbps!r}|{self.resync}|{self.theta}|"
            f"{self.weight!r}"
        )
        # a whole share signs as before the field existed: older peers still read the common case
        subject = subject if self.share == 1.0 else f"{subject}|{self.share!r}"
        return subject if self.load == 1 else f"{subject}|load={self.load}"


Registrants = dict[str, tuple[Member, Registration]]


class GroupBoard:
    """One peer's reads and writes of group keys."""

    def __init__(self, dht: SwarmDHT, peer_id: str, auth: SwarmAuth | None = None, owner: bytes | None = None):
        self.dht = dht
        self.auth = auth
        # with `owner` (this peer's `[owner:...]` key marker, as a node has), registrations and
        # member lists are written under subkeys only this peer can sign, and entries of other
        # peers count only under their own keys (identity.py): nobody overwrites another's
        # registration or list, nor writes one for an id whose key they lack
        self.owner = owner
        self.subkey: str | bytes = signed_subkey(peer_id, owner) if owner is not None else peer_id

    async def register(self, key: str, reg: Registration, expires_in: float) -> None:
        """Store this peer's registration under `key`, for `expires_in` seconds."""
        dht_requests.count(DhtOp.STORE, DhtKey.REGISTRATIONS)
        await self.dht.store(
            key,
            subkey=self.subkey,
            value=reg.model_dump(),
            expiration_time=get_dht_time() + expires_in,
            beam_size=dht_requests.READ_BEAM,
            return_future=True,
        )

    def writer(self, subkey: object) -> str | None:
        """Whose entry a subkey holds: signed by its peer's own key, or (without `owner`) as named."""
        if self.owner is not None:
            return writer_of(subkey)
        return subkey if isinstance(subkey, str) and len(subkey) <= 128 else None

    def authentic(self, purpose: str, subject: str, tag: str, peer_id: str) -> bool:
        if self.auth is None:
            return True
        try:
            self.auth.verify(purpose, subject, tag, peer_id=peer_id, single_use=False, max_age=None)
            return True
        except AuthError:
            return False

    async def entries(self, key: str, allowed: set[str] | None, kind: DhtKey) -> list[tuple[str, object]]:
        """(writer, value) of the entries under `key` whose writer is known (and `allowed`), at
        most MAX_REGISTRANTS of them: the writer is checked before anything else is parsed, and
        the cap counts only entries that pass it."""
        dht_requests.count(DhtOp.GET, kind)
        found = await self.dht.get(key, latest=True, beam_size=dht_requests.READ_BEAM, return_future=True)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        out = []
        for subkey, item in entries.items():
            writer = self.writer(subkey)
            if writer is None or (allowed is not None and writer not in allowed):
                continue
            out.append((writer, getattr(item, "value", None)))
            if len(out) >= MAX_REGISTRANTS:
                break
        return out

    async def registrations(
        self, key: str, allowed: set[str] | None = None, refused: set[str] | None = None
    ) -> Registrants:
        """The valid, authentic registrations under `key` (of `allowed` writers, when given);
        writers whose own entry is refused are added to `refused`, when given."""
        members = {}
        for peer_id, value in await self.entries(key, allowed, DhtKey.REGISTRATIONS):
            try:
                reg = Registration.model_validate(value)
            except (ValidationError, AttributeError, TypeError):
                reg = None
            if reg is None or (not reg.client_mode and not reg.grpc_addr):
                if refused is not None:
                    refused.add(peer_id)
                continue
            if not self.authentic("register", reg.subject(key), reg.auth, peer_id):
                if refused is not None:
                    refused.add(peer_id)
                continue  # without the swarm key nobody joins our groups
            members[peer_id] = (
                Member(peer_id, reg.grpc_addr, reg.client_mode, reg.bandwidth_mbps, reg.weight, reg.share, reg.load),
                reg,
            )
        return members

    async def registered(self, key: str) -> set[str]:
        """Peers with a valid, authentic registration under `key`."""
        return set(await self.registrations(key))

    async def member_lists(self, key: str, purpose: str, allowed: set[str] | None = None) -> dict[str, ClosedList]:
        lists = {}
        for peer_id, value in await self.entries(f"{key}.{purpose}", allowed, DhtKey(purpose)):
            entry = parse_list(value, peer_id)
            if entry is not None and self.authentic(purpose, entry.subject(key), _tag(value), peer_id):
                lists[peer_id] = entry
        return lists

    async def formed(self, key: str) -> dict[str, tuple[str, ...]]:
        """The group each registrant ended up in (alone counts): what the groups of the next
        hop wait for, and what confirms a list (`leadership.confirmed`)."""
        return {p: entry.members for p, entry in (await self.member_lists(key, "formed")).items()}

    async def declined(self, key: str) -> dict[str, frozenset[str]]:
        """The lists each member declined (their publishers): lists it saw on hold behind a
        pending leader (`leadership.confirmable`)."""
        lists = await self.member_lists(key, "declined")
        return {p: frozenset(entry.members) - {p} for p, entry in lists.items()}

    async def publish(
        self, key: str, purpose: str, members: tuple[str, ...], complete: bool = False, resync: bool = False
    ) -> None:
        entry = ClosedList(members, complete, resync)
        tag = self.auth.issue(purpose, entry.subject(key)) if self.auth else ""
        dht_requests.count(DhtOp.STORE, DhtKey(purpose))
        await self.dht.store(
            f"{key}.{purpose}",
            subkey=self.subkey,
            value={"members": list(members), "complete": complete, "resync": resync, "auth": tag},
            expiration_time=get_dht_time() + LIST_TTL_S,
            beam_size=dht_requests.READ_BEAM,
            return_future=True,
        )


def parse_list(value: object, publisher: str) -> ClosedList | None:
    """A member list as a peer stored it (untrusted), or None if malformed or not its publisher's."""
    if not isinstance(value, dict):
        return None
    members, complete, resync = value.get("members"), value.get("complete"), value.get("resync")
    if not (
        isinstance(members, (list, tuple))
        and 0 < len(members) <= MAX_REGISTRANTS
        and all(isinstance(v, str) and 0 < len(v) <= 128 for v in members)
        and len(set(members)) == len(members)
        and publisher in members
        and isinstance(complete, bool)
        and isinstance(resync, bool)
        and isinstance(value.get("auth", ""), str)
    ):
        return None
    return ClosedList(tuple(members), complete, resync)


def _tag(value: object) -> str:
    return str(value.get("auth", "")) if isinstance(value, dict) else ""
