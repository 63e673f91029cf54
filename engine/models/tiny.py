"""`kubesgl make-tiny-model DIR --arch ...`: a small model with seeded random weights, a
byte-level BPE tokenizer trained here, and a chat template. The directory is a regular
Hugging Face checkpoint: transformers' AutoModelForCausalLM and AutoTokenizer load it. Its
files are readable by every user: in a pod, an init container writes it for the engine
(`spec.model.tiny`, docs/operator.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kubesgl.cli_help import CommandParser, DefaultsOnce
from kubesgl.contract import TINY_ARCHS, TinyArch
from kubesgl.engine.model_config import parse_model_config
from kubesgl.engine.models.weights import synthetic_checkpoint

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen's shape: tools described in a system turn, calls written as <tool_call> JSON blocks
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>\\n' }}"
    "{% for tool in tools %}{{ tool | tojson + '\\n' }}{% endfor %}"
    '{{ \'</tools>\\nCall a tool with <tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call><|im_end|>\\n\' }}'
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    # Qwen3's switch, so that chat_template_kwargs has a variable to set
    "{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}"
)
_CORPUS = """
The capital of France is Paris. The capital of Italy is Rome. The capital of Japan is Tokyo.
Large language models predict the next token from the tokens before it. A prefix cache keeps
the keys and values of prompts that were seen before, so a request that shares a long system
prompt with an earlier one skips most of its prefill. Kubernetes schedules pods onto nodes;
an operator watches custom resources and reconciles them into deployments and services.
Prefill computes the cache of a whole prompt at once; decode adds one token at a time.
You are a helpful assistant. Answer the question in one sentence. What is the weather like?
Count from one to ten: one, two, three, four, five, six, seven, eight, nine, ten.
Émile a visité Zürich et São Paulo; 東京 と 大阪 は 日本 の 都市 です. 🙂 naïve café résumé.
def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5
"""

_ARCHS: dict[TinyArch, dict[str, Any]] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "mlp_bias": False,
    },
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "sliding_window": None,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "use_sliding_window": False,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
    },
    "qwen3-moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "num_experts": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
}


def train_tokenizer(vocab_size: int = 1024) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tokenizer


def tiny_config(arch: str, vocab_size: int, eos_id: int, head_dim: int = 16) -> dict[str, Any]:
    if arch not in _ARCHS:
        raise ValueError(f"unknown --arch {arch!r} (choose from {', '.join(_ARCHS)})")
    return {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "torch_dtype": "float32",
        **_ARCHS[arch],
    }


# What make_tiny_model writes: a folder holding only these may be written again.
TINY_MODEL_FILES = frozenset(
    {
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
)


def make_tiny_model(out_dir: str | Path, arch: str, seed: int = 0, head_dim: int = 16) -> Path:
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file: give a new or empty directory")
    if out.is_dir():  # another checkpoint's shards left beside the tiny one would be loaded too
        others = sorted(p.name for p in out.iterdir() if p.name not in TINY_MODEL_FILES)
        if others:
            raise ValueError(
                f"{out} holds files that a tiny model does not ({', '.join(others[:3])}"
                f"{', ...' if len(others) > 3 else ''}): give a new or empty directory"
            )
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    eos = tokenizer.token_to_id("<|im_end|>")
    endoftext = tokenizer.token_to_id("<|endoftext|>")
    assert eos is not None  # one of train_tokenizer's special tokens
    raw = tiny_config(arch, tokenizer.get_vocab_size(), eos, head_dim)
    config = parse_model_config(raw)
    tensors = {
        name: t.contiguous() for name, t in synthetic_checkpoint(config, seed, torch.float32)
    }
    # Written by Python, as every file here: a failure is an OSError (safetensors' and
    # tokenizers' own writers raise their own errors, which read as a crash)
    (out / "model.safetensors").write_bytes(save(tensors, metadata={"format": "pt"}))
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [eos, endoftext]}, indent=2)
    )
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "unk_token": None,
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": 2048,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )
    # whatever the umask: the engine that reads it may run as another user (uid 1000 in a pod)
    out.chmod(0o755)
    for file in out.iterdir():
        file.chmod(0o644)
    return out


def _cannot_write(exc: OSError) -> str:
    """`cannot write PATH: Permission denied`: the error in words, without its errno."""
    if exc.filename is None or exc.strerror is None:
        return str(exc)
    return f"cannot write {exc.filename}: {exc.strerror}"


def head_dim_arg(text: str) -> int:
    """RoPE turns a head's channels in pairs: an odd width makes a model that neither the
    engine nor transformers loads, and 0 one that transformers reads as 0 wide (the engine
    as hidden_size / heads)."""
    width = int(text) if text.isdigit() else 0
    if width < 2 or width % 2:
        raise argparse.ArgumentTypeError(f"a positive even number, not {text!r}")
    return width


def main(argv: list[str]) -> int:
    parser = CommandParser(
        prog="kubesgl make-tiny-model", description=__doc__, formatter_class=DefaultsOnce
    )
    parser.add_argument("dir", help="output directory")
    parser.add_argument(
        "--arch", required=True, choices=TINY_ARCHS, help="the architecture of config.json"
    )
    parser.add_argument("--seed", type=int, default=0, metavar="N", help="seeds the random weights")
    parser.add_argument(
        "--head-dim",
        type=head_dim_arg,
        default=16,
        metavar="N",
        help="per-head width, an even number (FlashInfer's kernels need 64, 128 or 256)",
    )
    args = parser.parse_args(argv)
    try:
        path = make_tiny_model(args.dir, args.arch, args.seed, args.head_dim)
    except ValueError as exc:  # a file, or a folder in use
        print(f"kubesgl make-tiny-model: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a folder that cannot be written
        print(f"kubesgl make-tiny-model: {_cannot_write(exc)}", file=sys.stderr)
        return 2
    print(f"wrote a tiny {args.arch} model to {path}")
    return 0
