"""GET /v1/models of a pool whose workers serve different names: one list of all their models.

vLLM's production-stack router likewise lists the models of all its engines, one card per id,
and SGLang's gateway (in its OpenAI mode) those of every endpoint that answers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from kubesgl.router.upstream import BufferedReply, Reply
from kubesgl.router.workers import Worker


def served_sets(workers: Iterable[Worker]) -> list[frozenset[str]]:
    """The distinct sets of names the workers serve, in the workers' order; a worker that has
    not named its models yet is in the empty set (its own engine's list says what it serves)."""
    return list(dict.fromkeys(frozenset(w.models) for w in workers))


def cards_of(outcome: Reply | Exception) -> list[Any] | None:
    """The model cards of a worker's /v1/models answer (None: an error, or no model list)."""
    if not isinstance(outcome, BufferedReply) or outcome.status != 200:
        return None
    try:
        payload = json.loads(outcome.body)
    except (ValueError, RecursionError):
        return None
    data = payload.get("data") if isinstance(payload, dict) else None
    return data if isinstance(data, list) else None


def merged(card_lists: Iterable[list[Any]]) -> BufferedReply:
    """One OpenAI model list of the cards, the first card for an id kept (a card without a
    string id, which no OpenAI list has, is dropped)."""
    cards: dict[str, Any] = {}
    for card in (card for cards in card_lists for card in cards):
        if isinstance(card, dict) and isinstance(card.get("id"), str):
            cards.setdefault(card["id"], card)
    body = json.dumps({"object": "list", "data": list(cards.values())}).encode()
    return BufferedReply(200, [(b"content-type", b"application/json")], body)
