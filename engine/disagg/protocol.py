"""What a prefill and a decode engine tell each other about one request (docs/disaggregation.md).

A request carries its pairing as the router gave it (`BootstrapTarget`). The prefill engine
tells the decode engine how each room ended with a `RoomNote`: the notification of the KV
WRITE when it succeeded (with the first token), a plain notification when it did not.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import StrEnum

MAX_ROOM = 2**63 - 1  # rooms are random 63-bit integers, new for every attempt


class FailureReason(StrEnum):
    """Why a room failed (the label of kubesgl_disagg_failures_total)."""

    REFUSED = "refused"  # the other engine rejected the request or the room
    TIMEOUT = "timeout"  # the partner did not act within --disaggregation-timeout
    TRANSFER = "transfer"  # the KV write itself failed
    PEER_LOST = "peer_lost"  # the other engine died or restarted
    ABORTED = "aborted"  # the client left, or the engine shut down


@dataclass(frozen=True)
class BootstrapTarget:
    """Where a request's KV comes from (decode side) or which room it fills (prefill side)."""

    room: int
    host: str | None  # the prefill engine's bootstrap host (needed by the decode side only)
    port: int  # its bootstrap port

    @property
    def address(self) -> str:
        return f"http://{self.host}:{self.port}"


class RoomStatus(StrEnum):
    DONE = "done"  # the KV of every layer is written; the first token rides along
    FAILED = "failed"  # the prefill side gave up on the room; no write is coming
    CANCELLED = "cancelled"  # the decode side cancelled it before any write started


@dataclass(frozen=True)
class RoomNote:
    """The last word of the prefill engine on a room. After it, no write into the room's
    destination slots can come, so the decode engine may reuse them."""

    room: int
    status: RoomStatus
    first_token: int | None = None
    logprob: float | None = None  # of the first token, when the request asked for logprobs
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens the prefill engine found in its prefix cache
    error: str | None = None
    reason: FailureReason | None = None
    http_status: int | None = None  # the HTTP status the prefill engine refused the request with

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> RoomNote:
        body = json.loads(data)
        return cls(**{**body, "status": RoomStatus(body["status"]),
                      "top_logprobs": [tuple(pair) for pair in body["top_logprobs"]],
                      "reason": FailureReason(body["reason"]) if body["reason"] else None})
