"""A joiner's checks at the door: the swarm's model, recipe and data plane must be this node's,
or it stops with one error naming the difference (exit 4: a restart cannot help). A node of
another model, recipe or data plane would otherwise train alone, or average what means
something else.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping

from dtnode.daemon.workload.recipe import SwarmRecipe, check_members, differences
from dtnode.peers.membership import PeerRecord, SwarmMismatch


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


def check_same_recipe(view: Mapping[str, PeerRecord], peer_id: str, model_hash: str, ours: SwarmRecipe) -> None:
    """Refuse to join a swarm of the same model that trains it another way (other data, round
    size, schedule, outer optimizer or wire format): its pseudo-gradients would be averaged
    with this node's though they mean something else."""
    peers = [r.recipe for p, r in view.items() if p != peer_id and r.state != "stopped" and r.model_hash == model_hash]
    found = check_members(ours, peers)
    if found is None:
        return
    theirs, count = found
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
