"""Loading a checkpoint's tokenizer, where it has one."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def load_tokenizer(model_path: str, warn: bool = True):
    """The checkpoint's tokenizer, or None for a directory without one (a config-only model
    run with --load-format dummy): such an engine takes token ids and returns token ids.
    `warn=False`: no warning for its absence (another process of the engine gives it)."""
    from transformers import AutoTokenizer
    from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as exc:
        if warn:
            logger.warning(
                "no tokenizer in %s (%s): only token-id prompts will be served", model_path, exc
            )
        return None
    # The engine refuses a prompt longer than its context length with a 400; the tokenizer's
    # own limit would only add transformers' warning of "indexing errors" to the log.
    tokenizer.model_max_length = VERY_LARGE_INTEGER
    return tokenizer
