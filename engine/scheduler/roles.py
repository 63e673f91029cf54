"""What an engine's role (--role mixed | prefill | decode) changes in the scheduler, behind one
seam: how a request is admitted, what happens when its prompt is done, what the role's KV
transfers report each turn, and when a finished request's slots may be reused.

A request without a bootstrap room runs as in a mixed engine whatever the role: a decode
engine prefills it locally (the router sends short prompts there alone), a prefill engine
runs it to the end. A request with a room:
- on a prefill engine waits until the decode engine has posted the room's slots (as in
  SGLang: a prompt computed before its KV has a place would hold this pool while the decode
  pool, full of rooms waiting for other prompts, held the place: each engine would wait for
  the other until the timeout), then reserves KV for its prompt only; once the prompt is
  computed and the first token sampled it is TRANSFERRING, holding its slots until its KV
  has reached the decode engine, and ends with that first token;
- on a decode engine reserves KV for the whole request, allocates the prompt's slots at
  once and is AWAITING_KV until the prefill engine's write lands; it then joins decoding
  with the first token the prefill engine sampled, counted as a mixed engine counts it.
Only requests without a room are admitted on an estimate of their outputs and may be
retracted under memory pressure (admission.py, scheduler.py); a room's request keeps its
whole reservation, because the other engine writes into or reads from its slots. A room
that fails ends its request with an error; slots the other engine may still touch
are kept until it is certain it no longer will (prefill.py, decode.py).
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch.distributed as dist

from kubesgl import contract
from kubesgl.engine.config import EngineConfig
from kubesgl.engine.disagg.decode import DecodeTransfers
from kubesgl.engine.disagg.kv_transfer import KVTransferAgent
from kubesgl.engine.disagg.link import BootstrapLink, LocalLink
from kubesgl.engine.disagg.prefill import PrefillTransfers
from kubesgl.engine.disagg.protocol import (
    ConnectBootstrap,
    FailureReason,
    RankAgent,
    RoomNote,
    RoomStatus,
)
from kubesgl.engine.disagg.ranks import RankConsensus
from kubesgl.engine.distributed import TensorParallelGroup
from kubesgl.engine.kvcache.pools import KVPool
from kubesgl.engine.messages import (
    BootstrapTarget,
    DisaggStats,
    FinishReason,
    GenerateRequest,
    TokenLogprob,
)
from kubesgl.engine.sampling_params import InvalidRequestError
from kubesgl.engine.scheduler.kv_manager import KVManager
from kubesgl.engine.scheduler.request import Req, ReqStatus

# What a failed room answers (kubesgl/contract.py): the partner engine failed, or did not act in
# time. A partner whose own request was aborted failed the room too: its client left, this
# one's did not, and a 500 would say this engine failed by itself (docs/disaggregation.md).
_FAILURE_STATUS = {FailureReason.TIMEOUT: contract.PARTNER_TIMEOUT_STATUS}
_PEER_FAILURE = contract.PARTNER_FAILED_STATUS


@dataclass(frozen=True)
class KVArrived:
    """Decode side: the prompt's KV is in the pool; the request decodes from `token` on."""

    req: Req
    token: int
    logprob: TokenLogprob | None
    cached_tokens: int


@dataclass(frozen=True)
class KVSent:
    """Prefill side: the request's KV reached the decode engine; the request is done here."""

    req: Req


@dataclass(frozen=True)
class RoomFailed:
    req: Req
    reason: FinishReason


RoleEvent = KVArrived | KVSent | RoomFailed


def failure(error: str, reason: FailureReason, status: int | None = None) -> FinishReason:
    return FinishReason(
        "error", message=error, status=status or _FAILURE_STATUS.get(reason, _PEER_FAILURE)
    )


class Role:
    """The scheduler's seam to an engine's role. Each hook's default but validate's (each role
    has its own) is what a mixed engine does, where every request runs from prompt to last
    token."""

    name: str
    transfers_kv = False  # a role that does polls its transfers every turn, idle or not

    def __init__(self, kv: KVManager):
        self.kv = kv

    def validate(self, request: GenerateRequest) -> None:
        """Raise InvalidRequestError if this role cannot run `request`."""
        raise NotImplementedError

    def kv_tokens(self, prompt_len: int, max_tokens: int, room: bool) -> int:
        """KV positions a request may fill here: its prompt and all outputs but the last."""
        return prompt_len + max_tokens - 1

    def longest_request(self, pool_tokens: int) -> tuple[int, str]:
        """The most tokens of a request whose KV (kv_tokens) fits a pool of `pool_tokens`,
        and what those tokens are: the prompt and max_tokens together, the last output's KV
        never kept."""
        return pool_tokens + 1, "request (prompt and max_tokens together)"

    def accept(self, req: Req) -> None:
        """A validated request is queued."""

    def refused(self, target: BootstrapTarget, message: str, status: int) -> None:
        """A request for `target`'s room was refused here (its validation, or the API server's
        checks before it): `message` and `status` are its answer."""

    def may_admit(self, req: Req) -> bool:
        """Whether `req` may be admitted yet, memory aside (False: the requests behind it go
        first, it keeps its place in the queue)."""
        return True

    def admit(self, req: Req) -> bool:
        """Give `req` its KV, or nothing (False: it waits). A request the role holds for a
        transfer leaves with a status other than WAITING and PREFILLING."""
        return self.kv.try_admit(req, self._admission_tokens(req))

    def _admission_tokens(self, req: Req) -> int:
        """KV positions admission reserves. A room's request: all of kv_tokens, since the P/D
        protocol promises its KV a place and such a request is never retracted. Any other:
        what it has to prefill plus the outputs it is expected to generate; the scheduler
        retracts a request when that guess proves short."""
        if req.bootstrap is not None:
            return self._kv_tokens(req)
        remaining = req.max_tokens - len(req.output_ids)
        return req.fill_len + self.kv.estimate.outputs(remaining) - 1

    def _kv_tokens(self, req: Req) -> int:
        return self.kv_tokens(req.prompt_len, req.max_tokens, req.bootstrap is not None)

    def prompt_done(self, req: Req, token: int, logprob: TokenLogprob | None) -> bool:
        """The prompt is computed and `token` sampled. True: the role keeps the request."""
        return False

    def poll(self) -> list[RoleEvent]:
        return []

    def finished(self, req: Req) -> None:
        """`req` ended (finished, failed or aborted) and will be released."""

    def can_release(self, req: Req) -> bool:
        return True

    def has_work(self) -> bool:
        """Transfers pending: the scheduler must keep turning (polling) even with no step."""
        return False

    def num_held(self) -> int:
        """Requests running here that no prefill or decode list holds (in a transfer)."""
        return 0

    def stats(self) -> DisaggStats | None:
        return None

    def close(self) -> None:
        """Stop the role's servers and agents (at shutdown)."""


class MixedRole(Role):
    """Prefill and decode in one engine."""

    name = contract.MIXED

    def validate(self, request: GenerateRequest) -> None:
        if request.bootstrap is not None:
            raise InvalidRequestError(
                f"this engine's role is {self.name}: bootstrap_room is only for prefill and "
                "decode engines",
                param="bootstrap_room",
            )


class _RoomRole(Role):
    """What the prefill and decode roles share: the live rooms and their accounting."""

    transfers_kv = True

    def __init__(self, kv: KVManager):
        super().__init__(kv)
        self.rooms: dict[int, Req] = {}  # every request with a room, from queueing to release
        self._failures: dict[str, int] = {}
        self._transfers: list[tuple[int, float]] = []  # (bytes, seconds) since the last stats
        self._kv_waits: list[float] = []

    def validate(self, request: GenerateRequest) -> None:
        if request.bootstrap is not None and request.bootstrap.room in self.rooms:
            raise InvalidRequestError(
                f"bootstrap_room {request.bootstrap.room} is already in use on this engine",
                param="bootstrap_room",
                status=409,
            )

    def accept(self, req: Req) -> None:
        if req.bootstrap is not None:
            self.rooms[req.bootstrap.room] = req

    def can_release(self, req: Req) -> bool:
        if req.bootstrap is None:
            return True
        if self._busy(req.bootstrap.room):
            return False
        self.rooms.pop(req.bootstrap.room, None)
        return True

    def _busy(self, room: int) -> bool:
        """Whether the room's slots may still be written to or read (its request waits)."""
        raise NotImplementedError

    def _failed(
        self, req: Req, error: str, reason: FailureReason, status: int | None = None
    ) -> RoomFailed:
        self._count_failure(reason)
        return RoomFailed(req, failure(error, reason, status))

    def _count_failure(self, reason: FailureReason) -> None:
        self._failures[reason.value] = self._failures.get(reason.value, 0) + 1

    def _ended_early(self, req: Req) -> None:
        """A request aborted here (its client left) while its room was still open: the room
        failed on this engine too, though the other engine may never say so (its own request
        was aborted as well, by the router)."""
        if req.aborted:
            self._count_failure(FailureReason.ABORTED)

    def num_held(self) -> int:
        held = (ReqStatus.TRANSFERRING, ReqStatus.AWAITING_KV)
        return sum(req.status in held for req in self.rooms.values())

    def stats(self) -> DisaggStats:
        states = Counter(req.status.name.lower() for req in self.rooms.values())
        stats = DisaggStats(dict(states), dict(self._failures), self._transfers, self._kv_waits)
        self._transfers, self._kv_waits = [], []
        return stats


class PrefillRole(_RoomRole):
    name = contract.PREFILL

    def __init__(self, kv: KVManager, transfers: PrefillTransfers):
        super().__init__(kv)
        self.transfers = transfers
        self._sent: set[int] = set()  # rooms whose KV is at the decode engine

    def validate(self, request: GenerateRequest) -> None:
        super().validate(request)
        if request.bootstrap is not None and (
            closed := self.transfers.closed(request.bootstrap.room)
        ):
            raise InvalidRequestError(closed, param="bootstrap_room", status=409)

    def kv_tokens(self, prompt_len: int, max_tokens: int, room: bool) -> int:
        # A room's request ends here after its first token: its prompt's KV is all it needs.
        return prompt_len if room else super().kv_tokens(prompt_len, max_tokens, room)

    def longest_request(self, pool_tokens: int) -> tuple[int, str]:
        return pool_tokens, "prompt"  # a room's request: its prompt's KV alone (kv_tokens)

    def may_admit(self, req: Req) -> bool:
        return req.bootstrap is None or self.transfers.posted(req.bootstrap.room)

    def accept(self, req: Req) -> None:
        super().accept(req)
        if req.bootstrap is not None:
            self.transfers.open(req.bootstrap.room)

    def refused(self, target: BootstrapTarget, message: str, status: int) -> None:
        if target.room not in self.rooms:  # else a live request's room, which it reused (409)
            self.transfers.abandon(
                target.room,
                FailureReason.REFUSED,
                f"the prefill engine refused the request: {message}",
                status,
            )

    def prompt_done(self, req: Req, token: int, logprob: TokenLogprob | None) -> bool:
        if req.bootstrap is None:
            return False
        req.status = ReqStatus.TRANSFERRING
        req.output_ids.append(token)
        if logprob is not None:
            req.logprobs.append(logprob)
        note = RoomNote(
            req.bootstrap.room,
            RoomStatus.DONE,
            first_token=token,
            logprob=logprob.logprob if logprob else None,
            top_logprobs=logprob.top if logprob else [],
            cached_tokens=req.num_prefix_hit,
        )
        self.transfers.prefilled(req.bootstrap.room, req.slots[: req.prompt_len], note)
        return True

    def poll(self) -> list[RoleEvent]:
        events: list[RoleEvent] = []
        for outcome in self.transfers.poll():
            req = self.rooms.get(outcome.room)
            if req is None or req.finished:
                continue
            if outcome.ok:
                self._sent.add(outcome.room)
                self._transfers.append((outcome.nbytes, outcome.seconds))
                self._kv_waits.append(outcome.waited)
                req.slots_wait = outcome.waited
                events.append(KVSent(req))
            elif outcome.reason is FailureReason.ABORTED:
                # The decode engine's client left: an abort here too (no error answer, which
                # would count as this engine's failure), counted as one when it ends.
                events.append(RoomFailed(req, FinishReason("abort", message=outcome.error)))
            else:
                assert outcome.error is not None and outcome.reason is not None  # not ok: both set
                events.append(self._failed(req, outcome.error, outcome.reason))
        return events

    def finished(self, req: Req) -> None:
        if req.bootstrap is None:
            return
        room = req.bootstrap.room
        if room in self._sent:
            self._sent.discard(room)
            return
        message = req.finish_reason.message if req.finish_reason else None
        reason = FailureReason.ABORTED if req.aborted else FailureReason.REFUSED
        self._ended_early(req)
        self.transfers.abandon(
            room, reason, f"the prefill engine ended the request: {message or reason.value}"
        )

    def _busy(self, room: int) -> bool:
        return self.transfers.busy(room)

    def close(self) -> None:
        self.transfers.close()

    def has_work(self) -> bool:
        return self.transfers.has_work()


class DecodeRole(_RoomRole):
    name = contract.DECODE

    def __init__(self, kv: KVManager, transfers: DecodeTransfers):
        super().__init__(kv)
        self.transfers = transfers
        # rooms of ended requests whose slots the prefill engine may still write
        self._held: set[int] = set()

    def validate(self, request: GenerateRequest) -> None:
        super().validate(request)
        if request.bootstrap is not None and not request.bootstrap.host:
            raise InvalidRequestError(
                "bootstrap_host is missing: a decode engine fetches the prompt's KV from that "
                "prefill engine",
                param="bootstrap_host",
            )

    def refused(self, target: BootstrapTarget, message: str, status: int) -> None:
        if target.host and target.room not in self.rooms:
            self.transfers.refuse(target, message)

    def accept(self, req: Req) -> None:
        super().accept(req)
        if req.bootstrap is not None:
            self.transfers.queue(req.bootstrap)

    def admit(self, req: Req) -> bool:
        if req.bootstrap is None:
            return super().admit(req)
        if not self.kv.try_admit_for_transfer(req, self._kv_tokens(req)):
            return False
        req.status = ReqStatus.AWAITING_KV
        self.transfers.expect(req.bootstrap, req.slots[: req.prompt_len])
        return True

    def poll(self) -> list[RoleEvent]:
        events: list[RoleEvent] = []
        for outcome in self.transfers.poll():
            if outcome.released:
                self._held.discard(outcome.room)
            req = self.rooms.get(outcome.room)
            # WAITING: queued here, its room ended by the prefill engine before it was posted
            if req is None or req.status not in (ReqStatus.WAITING, ReqStatus.AWAITING_KV):
                continue
            if outcome.note is not None:
                self._kv_waits.append(outcome.waited)
                note = outcome.note
                assert note.first_token is not None  # a DONE note carries the first token
                logprob = (
                    TokenLogprob(note.first_token, note.logprob, list(note.top_logprobs))
                    if req.params.logprobs is not None and note.logprob is not None
                    else None
                )
                events.append(KVArrived(req, note.first_token, logprob, note.cached_tokens))
            elif outcome.error is not None:
                assert outcome.reason is not None  # set with the error
                if not outcome.released:
                    self._held.add(outcome.room)
                events.append(
                    self._failed(
                        req,
                        f"prefill/decode transfer failed: {outcome.error}",
                        outcome.reason,
                        outcome.http_status,
                    )
                )
        return events

    def finished(self, req: Req) -> None:
        """A request that ends while its KV may still come keeps its slots until it cannot;
        one that ends before it asked for its KV releases its prefill engine at once."""
        if req.bootstrap is None:
            return
        message = (req.finish_reason.message if req.finish_reason else None) or "the request ended"
        if req.status is ReqStatus.WAITING:
            self._ended_early(req)
            self.transfers.unqueue(req.bootstrap, message, req.aborted)
        elif req.status is ReqStatus.AWAITING_KV and self.transfers.waiting(req.bootstrap.room):
            self._ended_early(req)
            self._held.add(req.bootstrap.room)
            self.transfers.cancel(req.bootstrap.room, message, req.aborted)

    def _busy(self, room: int) -> bool:
        return room in self._held

    def close(self) -> None:
        self.transfers.close()

    def has_work(self) -> bool:
        return self.transfers.has_rooms()


@dataclass(frozen=True)
class RoleInputs:
    """What a role is built from: this rank's KV and tensor-parallel group, and rank 0's
    channel to the engine's bootstrap process."""

    config: EngineConfig
    kv: KVManager
    pool: KVPool
    tp: TensorParallelGroup
    bootstrap_host: str
    link: BootstrapLink | None


@dataclass(frozen=True)
class TransferInputs:
    """What a disaggregated role's KV transfers share: this rank's NIXL agent, the ranks'
    consensus, and rank 0's bootstrap link."""

    agent: KVTransferAgent
    consensus: RankConsensus
    link: BootstrapLink | None

    @classmethod
    def of(cls, inputs: RoleInputs) -> TransferInputs:
        agent = KVTransferAgent(inputs.pool)
        consensus = RankConsensus(inputs.tp.rank, inputs.tp.size, inputs.tp.control)
        link = LocalLink() if consensus.is_leader and inputs.link is None else inputs.link
        return cls(agent, consensus, link)


def _mixed_role(inputs: RoleInputs) -> Role:
    return MixedRole(inputs.kv)  # no KV transfer: no NIXL agent


def _prefill_role(inputs: RoleInputs) -> Role:
    shared, config = TransferInputs.of(inputs), inputs.config
    transfers = PrefillTransfers(
        shared.agent,
        shared.consensus,
        shared.link,
        config.disaggregation_timeout,
        inputs.bootstrap_host,
        config.disaggregation_bootstrap_port,
    )
    return PrefillRole(inputs.kv, transfers)


def _decode_role(inputs: RoleInputs) -> Role:
    shared, tp = TransferInputs.of(inputs), inputs.tp
    # The bootstrap process registers every rank's agent with the prefill engines: it needs them all.
    ranks = [RankAgent(shared.agent.metadata, shared.agent.layout)]
    if tp.size > 1:
        gathered: list[RankAgent | None] = [None] * tp.size
        dist.all_gather_object(gathered, ranks[0], group=tp.control)
        ranks = cast(list[RankAgent], gathered)  # all_gather_object filled every entry
    connect = ConnectBootstrap(f"decode-{uuid.uuid4().hex[:12]}", tuple(ranks))
    transfers = DecodeTransfers(
        shared.agent, shared.consensus, shared.link, inputs.config.disaggregation_timeout, connect
    )
    return DecodeRole(inputs.kv, transfers)


ROLE_FACTORIES: dict[contract.EngineRole, Callable[[RoleInputs], Role]] = {
    contract.MIXED: _mixed_role,
    contract.PREFILL: _prefill_role,
    contract.DECODE: _decode_role,
}
assert set(ROLE_FACTORIES) == set(contract.ENGINE_ROLES)


def create_role(
    config: EngineConfig,
    kv: KVManager,
    pool: KVPool,
    tp: TensorParallelGroup,
    bootstrap_host: str,
    link: BootstrapLink | None,
) -> Role:
    """The role `config.role` names, with its KV transfer wired to this rank's pool. Rank 0
    talks to the engine's bootstrap process through `link`; without one, it runs the
    bootstrap service in this process (an engine driven in process)."""
    build = ROLE_FACTORIES[config.role]
    return build(RoleInputs(config, kv, pool, tp, bootstrap_host, link))
