"""A joiner's checks at the door: the swarm's model, recipe and data plane must be this node's,
or it stops with one error naming the difference (exit 4: a restart cannot help). A node of
another model, recipe or data plane would otherwise train alone, or average what means
something else.
"""

from __future__ import annotations

import collections
import hashlib
import logging
from collections.abc import Mapping, Sequence

import aiohttp

from dtnode.daemon.catchup.download import auth_headers
from dtnode.daemon.workload.recipe import RECIPE_PATH, SwarmRecipe, differences
from dtnode.peers.auth import SwarmAuth
from dtnode.peers.membership import PeerRecord, SwarmMismatch
from dtnode.peers.sidecar_address import PROBE_TIMEOUT_S

log = logging.getLogger(__name__)

MAX_RECIPE_BYTES = 4096  # a recipe's JSON is about 450 bytes; a longer answer is not one
RECIPE_HOLDERS_ASKED = 3  # sidecars of peers announcing the swarm's recipe asked for its fields


def check_same_model(view: Mapping[str, PeerRecord], peer_id: str, model_hash: str) -> None:
    """Refuse to join a swarm that trains another model (or tokenizer): peers of another
    config hash are never averaged with, so this node would train alone."""
    hashes = collections.Counter(r.model_hash for p, r in view.items() if p != peer_id and r.state != "stopped")
    if not hashes or model_hash in hashes:
        return
    theirs, count = hashes.most_common(1)[0]
    raise SwarmMismatch(
        f"this swarm trains model config {theirs} ({count} peer(s)) and this node {model_hash}: "
        f"give the same --model, --tokenizer and model files as the swarm "
        f"(`curl <peer>/status` shows its model)"
    )


class RecipeMismatch(SwarmMismatch):
    """This node's recipe differs from every live peer's (exit 4, one line per field)."""


class RecipeReader:
    """The recipes behind the hashes peers announce, read from their sidecars' /recipe: a record
    carries its recipe's sha256 only (every read of the membership brings every record back), so
    a joiner whose own hash is not the swarm's reads the JSON to name the fields that differ. An
    answer counts only if it hashes to what the peer's signed record announces."""

    def __init__(self, auth: SwarmAuth | None, timeout: float = PROBE_TIMEOUT_S):
        self.auth = auth
        self.timeout = timeout
        self._read: dict[str, SwarmRecipe] = {}  # by sha256: a joiner checks at each look at the swarm

    async def recipe(self, sha256: str, holders: Sequence[PeerRecord]) -> SwarmRecipe | None:
        """The recipe of this hash from the first of `holders` whose sidecar serves it; None if
        none of the first few does."""
        if sha256 in self._read:
            return self._read[sha256]
        async with aiohttp.ClientSession() as session:
            for holder in holders[:RECIPE_HOLDERS_ASKED]:
                text = await self._ask(session, holder.http_addr)
                if text is None or hashlib.sha256(text.encode()).hexdigest() != sha256:
                    continue
                recipe = SwarmRecipe.from_record(text)
                if recipe is not None:
                    self._read[sha256] = recipe
                    return recipe
        return None

    async def _ask(self, session: aiohttp.ClientSession, base: str) -> str | None:
        url = base.rstrip("/") + RECIPE_PATH
        try:
            async with session.get(
                url, headers=auth_headers(self.auth, RECIPE_PATH), timeout=aiohttp.ClientTimeout(total=self.timeout)
            ) as resp:
                if resp.status != 200:
                    log.debug("%s answered HTTP %d", url, resp.status)
                    return None
                body = await resp.content.read(MAX_RECIPE_BYTES + 1)
            return body.decode() if len(body) <= MAX_RECIPE_BYTES else None
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError, ValueError) as e:
            log.debug("could not read the recipe at %s: %s", url, e)
            return None


async def check_same_recipe(
    view: Mapping[str, PeerRecord], peer_id: str, model_hash: str, ours: SwarmRecipe, reader: RecipeReader
) -> None:
    """Refuse to join a swarm of the same model that trains it another way (other data, round
    size, schedule, outer optimizer or wire format): its pseudo-gradients would be averaged
    with this node's though they mean something else. Peers that announce no recipe are not
    counted; one live peer that trains with ours is enough (a group can form)."""
    peers = [
        r
        for p, r in view.items()
        if p != peer_id and r.state != "stopped" and r.model_hash == model_hash and r.recipe_sha256
    ]
    hashes = collections.Counter(r.recipe_sha256 for r in peers)
    if not hashes or ours.sha256 in hashes:
        return
    sha256, count = hashes.most_common(1)[0]
    theirs = await reader.recipe(sha256, [r for r in peers if r.recipe_sha256 == sha256])
    if theirs == ours:
        return  # the same values in another version's JSON (a field one of them lacks, at its default)
    if theirs is None:
        lines = f"  (which fields: their sidecars did not say; `curl <a peer's sidecar>{RECIPE_PATH}` shows them)"
    else:
        lines = "\n".join(d.line() for d in differences(ours, theirs))
    raise RecipeMismatch(
        f"this node's recipe differs from the swarm's ({count} peer(s)); give the swarm's values, or join with "
        f"--peer http://<a peer's sidecar> and leave these flags out to take them from it:\n{lines}"
    )


def check_same_data_plane(view: Mapping[str, PeerRecord], peer_id: str, tls: bool) -> None:
    """Refuse to join a swarm whose peers average over the other kind of data plane: TLS and
    plaintext peers cannot open streams to each other, so every round would lose them."""
    other = sorted(p for p, r in view.items() if p != peer_id and r.state != "stopped" and bool(r.tls_sig) != tls)
    if other:
        theirs, mine = ("plaintext", "TLS") if tls else ("TLS", "plaintext")
        fix = "add --insecure-data-plane" if tls else "drop --insecure-data-plane"
        who = f"peer {other[0]}" if len(other) == 1 else f"{len(other)} peers ({other[0]}, ...)"
        verb = "averages" if len(other) == 1 else "average"
        raise SwarmMismatch(
            f"{who} of this swarm {verb} over a {theirs} data plane and this node over {mine}: "
            f"every peer of a swarm must use the same ({fix} to join this one)"
        )
