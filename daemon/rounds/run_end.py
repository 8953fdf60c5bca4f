"""Where a swarm's run ends: --max-rounds (the swarm's outer step) and --max-own-rounds (this
node's rounds), and a node behind a swarm that already stopped there."""

from __future__ import annotations

import logging

from dtnode.daemon.config.settings import NodeSettings
from dtnode.peers.membership import Membership

log = logging.getLogger("dtnode")


async def run_is_over(
    settings: NodeSettings,
    membership: Membership,
    peer_id: str,
    model_hash: str,
    rounds_done: int,
    round_no: int,
    outer_step: int,
) -> bool:
    """Whether this node trains no more rounds, logged with the reason when so.

    --max-rounds N: the run ends at the swarm's outer step N. A round numbered N or later is
    never trained (with --overlap the last average in flight still lands: step N); and a node
    behind a swarm that already stopped at N (the stopped peers' records say so) stops where
    it is rather than training the missing rounds alone, which no peer would average."""
    own = settings.diloco.max_own_rounds
    if own is not None and rounds_done >= own:
        log.info("finished %d rounds (--max-own-rounds)", rounds_done)
        return True
    last = settings.diloco.max_rounds
    if last is None:
        return False
    if round_no >= last:
        log.info("the swarm's run ends at outer step %d (--max-rounds): stopping", last)
        return True
    view = await membership.recent_members()
    mine = [r for r in view.values() if r.peer_id != peer_id and r.model_hash == model_hash]
    if any(r.state == "stopped" and r.outer_step >= last for r in mine) and not any(
        r.state in ("training", "averaging") for r in mine
    ):
        log.warning(
            "the swarm stopped at outer step %d (--max-rounds) while this node is at %d: stopping here "
            "rather than training the rounds in between alone",
            last,
            outer_step,
        )
        return True
    return False
