"""`--model` as a Hugging Face id (`Qwen/Qwen3-0.6B`), as vLLM and SGLang take it.

A `--model` that is no local directory but looks like a Hub id is resolved through
`huggingface_hub`: the files the engine reads (config, tokenizer, safetensors weights) are
downloaded into its cache (`HF_HOME`, `HF_HUB_CACHE`) with its progress bars, and the snapshot's
folder is served. With `HF_HUB_OFFLINE=1`, or when the Hub cannot be reached, a copy already in
the cache is used without any network. `HF_TOKEN` opens private and gated models.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

logger = logging.getLogger(__name__)

# What the engine reads of a checkpoint: its config, tokenizer and chat template, and (unless
# --load-format dummy) its safetensors weights; never *.bin, *.pt, ONNX or GGUF copies.
CONFIG_PATTERNS = [
    "*.json",
    "tokenizer*",
    "*.model",
    "*.tiktoken",
    "merges.txt",
    "vocab*",
    "*.jinja",
]
WEIGHT_PATTERNS = ["*.safetensors"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # name, or owner/name


class HubError(ValueError):
    """A Hub id that could not be resolved; the message is one line."""


def looks_like_hub_id(model: str) -> bool:
    """owner/name or name, as the Hub spells ids: not a path (no leading /, ./, ~, no deeper folders)."""
    return bool(_HUB_ID.match(model)) and ".." not in model and not model.endswith((".", "-"))


def resolve_model(model: str, weights: bool = True) -> str:
    """The local folder of `--model`: itself where it exists, else the Hub snapshot of that id
    (downloaded where it is not cached). `weights=False` (--load-format dummy): no weight files."""
    if Path(model).expanduser().exists() or not looks_like_hub_id(model):
        return model
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = constants.HF_HUB_OFFLINE
    where = "in the Hugging Face cache" if offline else "from the Hugging Face Hub"
    logger.info(
        "--model %s: no local directory; looking it up %s (cache %s)",
        model,
        where,
        constants.HF_HUB_CACHE,
    )
    patterns = CONFIG_PATTERNS + (WEIGHT_PATTERNS if weights else [])
    try:
        path = snapshot_download(model, allow_patterns=patterns)
    except GatedRepoError:
        raise HubError(
            f"--model {model}: a gated model on the Hugging Face Hub: accept its terms on its page "
            "and set HF_TOKEN"
        ) from None
    except RepositoryNotFoundError:
        raise HubError(
            f"--model {model}: no such directory, and no such model on the Hugging Face Hub "
            "(a private one needs HF_TOKEN)"
        ) from None
    except RevisionNotFoundError as exc:
        raise HubError(f"--model {model}: {_first_line(exc)}") from None
    except LocalEntryNotFoundError as exc:
        why = (
            "HF_HUB_OFFLINE is set"
            if offline
            else f"the Hub could not be reached ({_first_line(exc.__cause__ or exc)})"
        )
        raise HubError(
            f"--model {model}: no such directory, and no complete copy in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); {why}"
        ) from None
    except (HfHubHTTPError, OSError) as exc:
        raise HubError(f"--model {model}: the Hugging Face Hub: {_first_line(exc)}") from None
    logger.info("--model %s: %s", model, path)
    return path


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
