"""Small asyncio helpers the agent needs: cancel-and-wait, cleanup that cannot be cut short."""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import Any

from ...core.errors import reason
from ...core.race import cancel_and_wait, uncancellable

__all__ = ["cancel_and_wait", "quietly", "uncancellable"]

log = logging.getLogger("aelastic.agent")


async def quietly(awaitable: Awaitable[Any], what: str) -> None:
    """Await ``awaitable``; an error is logged as a warning (``could not <what>``)."""
    try:
        await awaitable
    except Exception as exc:
        log.warning("could not %s: %s", what, reason(exc))
