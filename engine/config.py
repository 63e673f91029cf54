"""Engine options: the one declaration of every option of `kubesgl serve` and `kubesgl generate`
(the table of docs/server.md, Engine options, lists them).

Each field of `EngineConfig` carries its type, default and help text; a `Literal` type is its
list of choices. The command line (cli_args.py), `EngineConfig.validate`, the operator's
`spec.engine` block and the option table in docs/server.md are derived from these fields or
checked against them (tests/unit/test_engine_options.py), so a new option is one field here.

This module imports nothing heavy: the torch-free operator reads it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from kubesgl.bounds import Bounds
from kubesgl.contract import BOOTSTRAP_PORT, MIXED, EngineRole

Device = Literal["cuda", "cpu"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
KvCacheDtype = Literal["auto", "fp8_e4m3"]
LoadFormat = Literal["auto", "dummy"]
AttentionBackendName = Literal["torch", "triton", "flashinfer"]
AttentionBackend = Literal["auto", AttentionBackendName]  # what --attention-backend takes
# The backends that run on CUDA GPUs only (triton also in its CPU interpreter, TRITON_INTERPRET=1)
CUDA_ONLY_BACKENDS: frozenset[AttentionBackendName] = frozenset({"triton", "flashinfer"})
SchedulePolicyName = Literal["fcfs", "lpm", "dfs-weight"]

_OPTION = "kubesgl.option"  # the key of an option's declaration in a field's metadata
# --mem-fraction-static when unset. On the CPU a modest share of the free memory, so that two
# engines of a 1B model fit on a laptop beside everything else.
GPU_MEM_FRACTION = 0.85
CPU_MEM_FRACTION = 0.3


@dataclass(frozen=True)
class _Declared:
    help: str
    bounds: Bounds
    cli: bool
    aliases: tuple[str, ...]
    named_elsewhere: tuple[str, ...]


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    cli: bool = True,
    aliases: tuple[str, ...] = (),
    named_elsewhere: tuple[str, ...] = (),
) -> Any:
    """An EngineConfig field: its default and help text, and the bounds of a number. `cli=False`
    keeps it off the command line (the offline `LLM` API sets it); `aliases` are more flags
    for it (another engine's name, so that its command lines run unchanged); `named_elsewhere`
    are other servers' flags of the same meaning that kubesgl does not take: their error names
    the option's flag."""
    declared = _Declared(help, Bounds(ge, gt, le, lt), cli, aliases, named_elsewhere)
    return field(default=default, metadata={_OPTION: declared})


@dataclass
class EngineConfig:
    model: str = option(
        help="checkpoint directory, or a Hugging Face id (Qwen/Qwen3-0.6B) that huggingface_hub "
        "downloads into its cache; with HF_HUB_OFFLINE=1 the cached copy, no network",
        aliases=("--model-path",),  # SGLang's flag (vLLM's is --model)
    )
    tp_size: int = option(
        1,
        help="tensor-parallel ranks: one process and one device each",
        ge=1,
        # SGLang's documented spelling (a prefix its parser takes), and its and vLLM's full name
        aliases=("--tp", "--tensor-parallel-size"),
        named_elsewhere=("-tp",),  # vLLM's
    )
    role: EngineRole = option(
        MIXED,
        help="mixed runs whole requests; prefill and decode engines split "
        "each request between them (prefill/decode disaggregation)",
    )
    device: Literal["auto", Device] = option(
        "auto", help="auto: cuda where a GPU is available, else cpu"
    )
    dtype: Dtype = option(
        "auto",
        help="of weights and activations; auto: the checkpoint's half-precision "
        "dtype, a float32 checkpoint in float32 on the CPU and bfloat16 on a GPU",
    )
    kv_cache_dtype: KvCacheDtype = option(
        "auto", help="storage of the KV cache: auto = the model's dtype; fp8_e4m3 halves its bytes"
    )
    load_format: LoadFormat = option(
        "auto", help="dummy: random weights from the config, no weight files read"
    )
    # `kubesgl generate --seed` is the requests' sampling seed; the engine's own stays 0 there.
    seed: int = option(
        0,
        help="seeds dummy weights (the same in every engine, so that prefill and decode engines "
        "and tensor-parallel ranks agree)",
        cli=False,
    )
    page_size: int = option(
        1,
        help="tokens per KV page: prefixes are cached and shared in whole pages; FlashInfer "
        "reads whole pages (16-64 speed up its decode with an FP8 KV cache)",
        ge=1,
        named_elsewhere=("--block-size",),  # vLLM's tokens per KV block
    )
    max_running_requests: int = option(
        256,
        help="requests admitted at once (each holds its KV until it ends)",
        ge=1,
        named_elsewhere=("--max-num-seqs",),  # vLLM's
    )
    max_queued_requests: int | None = option(
        None,
        help="requests that may wait for admission; one more is refused with a 503 and "
        "Retry-After, so that a router tries another engine; unset: no limit",
        ge=1,
    )
    chunked_prefill_size: int = option(
        8192, help="prompt tokens per prefill step; 0 or less disables chunking"
    )
    enable_mixed_chunk: bool = option(
        False,
        help="prompt chunks and the running decodes share a step, so decodes "
        "go on while prompts are prefilled; the decodes' tokens count "
        "against --chunked-prefill-size, the step's budget",
    )
    max_prefill_tokens: int = option(16384, help="prompt tokens admitted in one prefill step", ge=1)
    max_total_tokens: int | None = option(
        None,
        help="KV pool size in tokens; unset: sized from free memory (--mem-fraction-static)",
        ge=1,
    )
    mem_fraction_static: float | None = option(
        None,
        help=f"when the KV pool is sized from memory: on a GPU, the share of its memory for weights and KV "
        f"cache (unset: {GPU_MEM_FRACTION}); on the CPU, the share of the memory still free to this "
        f"process, its cgroup limit included, for the KV cache (unset: {CPU_MEM_FRACTION})",
        gt=0,
        lt=1,
        named_elsewhere=("--gpu-memory-utilization",),  # vLLM's GPU share for weights and KV
    )
    context_length: int | None = option(
        None,
        help="longest prompt plus output; unset: the model's max_position_embeddings, which "
        "is also the most it takes (more is refused at start)",
        ge=1,
        named_elsewhere=("--max-model-len",),  # vLLM's
    )
    default_max_tokens: int = option(
        4096, help="output limit of requests that give no max_tokens", ge=1
    )
    attention_backend: AttentionBackend = option(
        "auto", help="auto: flashinfer on CUDA where installed, else triton; torch on the CPU"
    )
    schedule_policy: SchedulePolicyName = option(
        "fcfs",
        help="order of the waiting queue: fcfs = arrival; lpm = longest prefix in the radix cache first; "
        "dfs-weight = requests sharing cached prefixes together, the largest group first",
    )
    schedule_max_wait: float = option(
        10.0,
        help="seconds a waiting request may be passed over by --schedule-policy; past them it goes first",
        gt=0,
    )
    disable_radix_cache: bool = option(
        False, help="no prefix cache: every prompt is computed in full"
    )
    disable_overlap_schedule: bool = option(
        False, help="build each step only after the previous one ended"
    )
    disable_cuda_graph: bool = option(
        False,
        help="run every step eagerly, without CUDA graphs (piecewise ones included)",
        named_elsewhere=("--enforce-eager",),  # vLLM's
    )
    cuda_graph_max_bs: int = option(256, help="largest decode batch captured in a CUDA graph", ge=1)
    enable_piecewise_cuda_graph: bool = option(
        False,
        help="prefill and mixed steps of up to --piecewise-cuda-graph-max-tokens tokens replay CUDA "
        "graphs of the layers' parts between attention calls, attention running eagerly "
        "between them: less host time for small chunks and mixed steps",
    )
    piecewise_cuda_graph_max_tokens: int = option(
        1024, help="largest step, in tokens, captured in piecewise CUDA graphs", ge=1
    )
    # What one request may ask for, so that none holds up the others (docs/server.md, Limits)
    max_sequences_per_request: int = option(
        256, help="sequences one request may ask for: its prompts times n; more is a 400", ge=1
    )
    max_stop_string_length: int = option(
        1024, help="characters of one stop string; longer is a 400", ge=1
    )
    max_request_body_bytes: int = option(
        16 * 1024 * 1024, help="bytes of one request body (16 MiB); larger is a 413", ge=1024
    )
    max_prompt_chars_per_token: int = option(
        16,
        help="a text prompt (chat: its messages' text) longer than the context length times this many "
        "characters is a 400 before it is tokenized (text averages about 4 characters per token)",
        ge=1,
    )
    disaggregation_bootstrap_port: int = option(
        BOOTSTRAP_PORT,
        help="port of this engine's KV bootstrap server (prefill role); for decode engines, "
        "the port assumed when a request's bootstrap_port is null",
        ge=0,
        le=65535,
    )
    disaggregation_timeout: float = option(
        60.0,
        help="seconds a prefill or decode engine waits for its partner's side of one request's KV "
        "transfer before failing it",
        gt=0,
    )

    def validate(self) -> None:
        for opt in ENGINE_OPTIONS.values():
            problem = opt.problem(getattr(self, opt.name))
            if problem:
                raise ValueError(problem)
        if self.max_total_tokens is not None and self.max_total_tokens < 2 * self.page_size:
            raise ValueError("--max-total-tokens must hold at least two pages")
        if self.enable_mixed_chunk and 0 < self.chunked_prefill_size <= self.max_running_requests:
            raise ValueError(
                f"--enable-mixed-chunk: --chunked-prefill-size ({self.chunked_prefill_size}) must be "
                f"larger than --max-running-requests ({self.max_running_requests}): a mixed step's "
                "decodes, one token each, count against it and leave the rest to the prefill chunk"
            )
        if self.enable_piecewise_cuda_graph and self.disable_cuda_graph:
            raise ValueError(
                "--enable-piecewise-cuda-graph: --disable-cuda-graph turns every CUDA graph off, "
                "piecewise ones included; give one of the two"
            )


@dataclass(frozen=True)
class EngineOption:
    """One EngineConfig field as the command line, the operator and the docs see it."""

    name: str
    type: type  # of a value: str, int, float or bool
    default: Any  # dataclasses.MISSING for a required option
    help: str
    choices: tuple[str, ...]  # empty: any value of the type
    optional: bool  # None is a value: left to the engine (a model's or the machine's)
    bounds: Bounds
    cli: bool
    aliases: tuple[str, ...] = ()  # more flags for it
    named_elsewhere: tuple[str, ...] = ()  # other servers' flags for it, refused with its flag

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def flags(self) -> tuple[str, ...]:
        """Every flag of the option, its own first."""
        return (self.flag, *self.aliases)

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING

    @property
    def is_switch(self) -> bool:
        return self.type is bool

    def problem(self, value: Any) -> str | None:
        """Why `value` is not a valid value of this option, or None."""
        if value is None and self.optional:
            return None
        if self.choices and value not in self.choices:
            *most, last = self.choices
            one_of = f"{', '.join(most)} or {last}" if most else last
            return f"{self.flag} must be {one_of}, got {value!r}"
        if self.type in (int, float) and not self.bounds.holds(value):
            return f"{self.flag} must be {self.bounds.describe()}, got {value!r}"
        return None


def _engine_options() -> dict[str, EngineOption]:
    hints = typing.get_type_hints(EngineConfig)
    options = {}
    for f in dataclasses.fields(EngineConfig):
        hint, optional = hints[f.name], False
        if typing.get_origin(hint) in (typing.Union, types.UnionType):  # `int | None`
            (hint,), optional = (
                [arg for arg in typing.get_args(hint) if arg is not type(None)],
                True,
            )
        choices: tuple[str, ...] = ()
        if typing.get_origin(hint) is Literal:
            hint, choices = str, typing.get_args(hint)
        declared: _Declared = f.metadata[_OPTION]
        options[f.name] = EngineOption(
            f.name,
            hint,
            f.default,
            declared.help,
            choices,
            optional,
            declared.bounds,
            declared.cli,
            declared.aliases,
            declared.named_elsewhere,
        )
    return options


ENGINE_OPTIONS: dict[str, EngineOption] = _engine_options()

# Engine options that only a served engine honours, and why: the offline `LLM` refuses a value
# other than the default (an option is never ignored); `kubesgl generate` refuses their flags.
# Here, not in llm.py, so that `kubesgl generate` builds its parser without importing torch.
OFFLINE_REFUSED: dict[str, str] = {
    "tp_size": "offline generation runs one engine process on one device; "
    "tensor parallelism is served (kubesgl serve --tp-size N)",
    "role": "offline generation runs the whole request in one engine; "
    "prefill and decode engines are served (kubesgl serve --role ...)",
    "disaggregation_bootstrap_port": "only prefill and decode engines, which are served, have a bootstrap server",
    "disaggregation_timeout": "only prefill and decode engines, which are served, transfer KV",
    "max_queued_requests": "offline generation takes one request at a time "
    "(each LLM.generate call), queued whole; only a server's queue fills",
    **dict.fromkeys(
        (
            "max_sequences_per_request",
            "max_stop_string_length",
            "max_request_body_bytes",
            "max_prompt_chars_per_token",
        ),
        "a limit of the HTTP server's requests; offline generation serves none",
    ),
}
