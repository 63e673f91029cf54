"""Cancelling a request's rooms at its prefill engine's bootstrap server (`DELETE
/kv/rooms/{room}`, docs/disaggregation.md), once the prefill request failed before its decode
engine answered.

A prefill engine that fails a room it took tells the decode engine itself. One that failed
before it took the room (a handler that crashed, a proxy's error) tells nobody, and the decode
engine would wait for the KV until its --disaggregation-timeout. The cancel fails the room at
the decode engine at once; it changes nothing for a room whose KV was sent or is being written
(the write ends the room), so a decode engine that has the KV still answers in full.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import aiohttp

from kubesgl import contract
from kubesgl.router.upstream import TRANSPORT_ERRORS
from kubesgl.router.workers import Worker

log = logging.getLogger("kubesgl.router")

# A prefill engine that does not answer this fast is dead or hung, which its decode engine's
# heartbeat finds by itself.
ROOM_CANCEL_TIMEOUT_S = 2.0


async def cancel_rooms(
    session: aiohttp.ClientSession, prefill: Worker, rooms: Sequence[int], reason: str
) -> None:
    """Cancels every room at `prefill`'s bootstrap server; failures are only logged."""
    assert prefill.bootstrap_port is not None, "every prefill worker has one"
    address = contract.http_url(prefill.host, prefill.bootstrap_port)
    body = {"reason": reason, "aborted": False}  # the decode engine's client is still there
    timeout = aiohttp.ClientTimeout(total=ROOM_CANCEL_TIMEOUT_S)

    async def cancel(room: int) -> None:
        try:
            async with session.delete(
                f"{address}/kv/rooms/{room}", json=body, timeout=timeout
            ) as answer:
                if answer.status not in (200, 404):  # 404: never posted, closed all the same
                    log.warning(
                        "cancelling room %d at %s: answered %d %s",
                        room, address, answer.status, await answer.text(),
                    )  # fmt: skip
        except TRANSPORT_ERRORS as exc:
            log.warning("cancelling room %d at %s failed: %s", room, address, exc)

    await asyncio.gather(*(cancel(room) for room in rooms))
