"""Waiting that ends early when the node stops: every loop of the node sleeps through here, so
a SIGTERM is answered at once, not after the longest sleep."""

from __future__ import annotations

import asyncio


async def pause(stopping: asyncio.Event, seconds: float) -> None:
    """Sleep `seconds`, or less if the node starts stopping meanwhile."""
    try:
        await asyncio.wait_for(stopping.wait(), seconds)
    except TimeoutError:
        pass
