"""One engine instance in this process: model, KV cache, executor and scheduler, wired from
an EngineConfig. The offline `LLM` drives it directly; the server drives it from its
scheduler process."""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kubesgl import contract
from kubesgl.engine.attention import AttentionLayerSpec, auto_backend
from kubesgl.engine.config import CPU_MEM_FRACTION, GPU_MEM_FRACTION, EngineConfig
from kubesgl.engine.disagg.kv_transfer import layout_of
from kubesgl.engine.disagg.link import BootstrapLink
from kubesgl.engine.distributed import get_tp_group
from kubesgl.engine.executor.model_runner import ModelRunner
from kubesgl.engine.executor.worker import OverlapExecutor, SyncExecutor
from kubesgl.engine.host_memory import host_memory
from kubesgl.engine.kvcache.allocator import PageAllocator
from kubesgl.engine.kvcache.pools import KVPool, ReqToTokenTable
from kubesgl.engine.kvcache.radix_cache import NoPrefixCache, RadixCache
from kubesgl.engine.messages import GenerateRequest, TokenOutput
from kubesgl.engine.model_config import ModelConfig, load_model_config
from kubesgl.engine.models.loader import load_model, resolve_dtype
from kubesgl.engine.scheduler.grammar import GrammarBackend
from kubesgl.engine.scheduler.kv_manager import KVManager
from kubesgl.engine.scheduler.roles import Role, create_role
from kubesgl.engine.scheduler.scheduler import Scheduler, SchedulerLimits
from kubesgl.engine.scheduler.stop_strings import StopStringChecker
from kubesgl.engine.tokenizer.loader import load_tokenizer

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """cpu, or the current CUDA device with its index (`auto` prefers CUDA)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda was given but no CUDA device is available")
    return torch.device("cuda", torch.cuda.current_device())


def _available_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of the device's memory; on the CPU, of the memory this process may use
    (its cgroup's limit where one is set)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    memory = host_memory()
    return memory.available, memory.total


def kv_pool_tokens(
    config: EngineConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    kv_heads: int,
    context_length: int,
) -> int:
    """Size of the KV pool in tokens: --max-total-tokens, or what the memory left after the
    weights allows under --mem-fraction-static (never more than the running requests can use)."""
    if config.max_total_tokens is not None:
        return config.max_total_tokens
    per_token = KVPool.bytes_per_slot(
        model_config.num_layers, kv_heads, model_config.head_dim, dtype
    )
    free, total = _available_memory(device)
    if device.type == "cuda":
        budget = free - total * (1 - (config.mem_fraction_static or GPU_MEM_FRACTION))
    else:
        # The host is shared (other engines, the desktop): a share of what is still free, so that
        # a second engine started beside this one finds memory too.
        budget = free * (config.mem_fraction_static or CPU_MEM_FRACTION)
    tokens = min(int(budget // per_token), config.max_running_requests * context_length)
    if tokens < 2 * config.page_size:
        raise RuntimeError(
            f"no memory left for the KV cache ({free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB); "
            "raise --mem-fraction-static or give --max-total-tokens"
        )
    return tokens


def short_pool_warning(
    config: EngineConfig, role: Role, pool_tokens: int, context_length: int
) -> str | None:
    """What to say at start where the KV pool cannot hold a request of the whole context: every
    longer one is refused. (vLLM refuses to start; a pool sized from the memory left may be all
    this machine has, and serves shorter requests.)"""
    longest, what = role.longest_request(pool_tokens)
    if longest >= context_length:
        return None
    if config.max_total_tokens is not None:
        fix = f"give --max-total-tokens of at least {context_length}"
    else:
        fix = "give the engine more memory (--mem-fraction-static)"
    return (
        f"the KV pool holds {pool_tokens} tokens, fewer than the context length "
        f"({context_length}): the longest {what} that fits is {longest} tokens, and longer ones "
        f"are refused; to serve the whole context, {fix}, or lower --context-length to {longest}"
    )


def kv_cache_dtype(config: EngineConfig, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's element type: --kv-cache-dtype, "auto" being the model's `dtype`."""
    if config.kv_cache_dtype != "fp8_e4m3":
        return dtype
    if device.type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        raise ValueError(
            "--kv-cache-dtype fp8_e4m3 needs a GPU of compute capability 8.9 or newer (Ada, Hopper)"
        )
    return torch.float8_e4m3fn


def cuda_graph_sizes(config: EngineConfig, device: torch.device) -> tuple[int, int]:
    """The largest decode batch captured in a CUDA graph, and the largest step in tokens
    captured in piecewise ones (0: none captured)."""
    if device.type != "cuda" or config.disable_cuda_graph:
        if config.enable_piecewise_cuda_graph:
            # with --disable-cuda-graph it is refused (EngineConfig.validate): the device has none
            logger.warning("piecewise CUDA graphs off: no CUDA graphs on %s", device.type)
        return 0, 0
    max_bs = min(config.max_running_requests, config.cuda_graph_max_bs)
    if not config.enable_piecewise_cuda_graph:
        return max_bs, 0
    # Chunked, no step is larger than the budget; unchunked, a larger step (a long first
    # prompt, or prompts and decodes together) runs eagerly.
    step_tokens = config.chunked_prefill_size
    if step_tokens <= 0:
        step_tokens = config.max_prefill_tokens
    return max_bs, min(config.piecewise_cuda_graph_max_tokens, step_tokens)


@dataclass(frozen=True)
class KVCacheParts:
    """The KV cache of one engine and the bookkeeping over it."""

    pool: KVPool
    table: ReqToTokenTable  # each request's row of token slots
    kv: KVManager  # pages, rows and the prefix cache, as the scheduler hands them out
    tokens: int  # the pool's usable tokens, the padding page excluded


def scheduler_limits(config: EngineConfig, context_length: int, vocab_size: int) -> SchedulerLimits:
    return SchedulerLimits(
        context_length=context_length,
        vocab_size=vocab_size,
        max_running_requests=config.max_running_requests,
        max_queued_requests=config.max_queued_requests,
        chunked_prefill_size=config.chunked_prefill_size,
        mixed_chunk=config.enable_mixed_chunk,
        max_prefill_tokens=config.max_prefill_tokens,
        default_max_tokens=config.default_max_tokens,
        schedule_policy=config.schedule_policy,
        schedule_max_wait=config.schedule_max_wait,
    )


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        bootstrap_host: str = "0.0.0.0",
        bootstrap_link: BootstrapLink | None = None,
    ):
        """Prefill and decode roles: `bootstrap_host` is the address a prefill engine's
        bootstrap server listens on; `bootstrap_link`, rank 0's line to the engine's bootstrap
        process (without one, the bootstrap service runs in this process)."""
        config.validate()
        self.config = config
        self.shut_down = False
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._load_model()
        # Loaded with the engine, not at the first request with a stop string or a grammar: a
        # load inside the scheduler's loop holds every running request for a second or more.
        # None for a model without a tokenizer (token ids in and out).
        self.tokenizer = load_tokenizer(config.model, warn=False)
        attn = self.model.attention_specs()[0]
        cache = self._build_kv_cache(attn)
        overlap = not config.disable_overlap_schedule
        # Slots where a step's sampled tokens wait for the next step, launched before they are
        # known (overlap).
        future_capacity = 4 * config.max_running_requests
        self.executor = self._build_executor(cache, attn, overlap, future_capacity)
        self.role = create_role(
            config, cache.kv, cache.pool, get_tp_group(), bootstrap_host, bootstrap_link
        )
        # The fingerprint of the pool's layout, which a prefill and a decode engine must share
        # (PoolLayout.fingerprint): the router pairs them by it; a mixed engine pairs with none
        self.kv_layout: str | None = None
        if self.role.transfers_kv:
            layout = layout_of(cache.pool, agent="")
            self.kv_layout = layout.fingerprint(config.tp_size)
            logger.info(
                "KV layout %s: %d layers of slots %s %s, tensor-parallel size %d; it pairs with "
                "%s engines of this layout only",
                self.kv_layout,
                len(layout.k_addresses),
                list(layout.slot_shape),
                layout.dtype,
                config.tp_size,
                contract.DECODE if config.role == contract.PREFILL else contract.PREFILL,
            )
        warning = short_pool_warning(config, self.role, cache.tokens, self.context_length)
        if warning is not None:
            logger.warning(warning)
        self.scheduler = self._build_scheduler(cache.kv, overlap, future_capacity)
        logger.info(
            "engine ready: %s on %s in %s, KV pool %d tokens (page %d), overlap %s, radix cache %s, role %s",
            self.model_config.architecture,
            self.device,
            self.dtype,
            cache.tokens,
            config.page_size,
            overlap,
            not config.disable_radix_cache,
            config.role,
        )

    def _load_model(self) -> None:
        """The model's config, context length, dtype and weights, on this engine's device."""
        config = self.config
        self.model_config = load_model_config(config.model)
        self.context_length = min(
            config.context_length or self.model_config.context_length,
            self.model_config.context_length,
        )
        self.dtype = resolve_dtype(config.dtype, self.model_config, self.device)
        self.model = load_model(
            config.model,
            self.model_config,
            self.dtype,
            self.device,
            config.load_format,
            config.seed,
        )

    def _build_kv_cache(self, attn: AttentionLayerSpec) -> KVCacheParts:
        """A pool as large as the memory left allows on every rank, in whole pages, and the
        tables that hand it out."""
        config = self.config
        kv_dtype = kv_cache_dtype(config, self.dtype, self.device)
        page = config.page_size
        tokens = self._pool_tokens_on_every_rank(attn, kv_dtype)
        num_pages = tokens // page + 1  # + the padding page
        pool = KVPool(
            num_pages * page,
            self.model_config.num_layers,
            attn.num_kv_heads,
            attn.head_dim,
            kv_dtype,
            self.device,
            compute_dtype=self.dtype,
            page_size=page,
        )
        # Finished requests keep their row until the step in flight completes: leave room.
        # One more row, never handed out, is the padding row of CUDA-graph replays.
        num_rows = 2 * config.max_running_requests
        table = ReqToTokenTable(num_rows + 1, self.context_length, self.device)
        allocator = PageAllocator(num_pages, page)
        radix = NoPrefixCache(allocator) if config.disable_radix_cache else RadixCache(allocator)
        kv = KVManager(allocator, radix, num_rows)
        return KVCacheParts(pool=pool, table=table, kv=kv, tokens=(num_pages - 1) * page)

    def _pool_tokens_on_every_rank(self, attn: AttentionLayerSpec, kv_dtype: torch.dtype) -> int:
        """The KV pool's size in tokens (kv_pool_tokens): every rank must schedule alike, so
        all take the smallest pool any rank can hold."""
        tokens = kv_pool_tokens(
            self.config,
            self.model_config,
            kv_dtype,
            self.device,
            attn.num_kv_heads,
            self.context_length,
        )
        return int(
            get_tp_group()
            .all_reduce(torch.tensor([tokens], device=self.device), dist.ReduceOp.MIN)
            .item()
        )

    def _build_executor(
        self,
        cache: KVCacheParts,
        attn: AttentionLayerSpec,
        overlap: bool,
        future_capacity: int,
    ) -> OverlapExecutor | SyncExecutor:
        """The model runner on `cache`, in an executor that overlaps steps or runs them one at
        a time."""
        backend = self.config.attention_backend
        if backend == "auto":
            backend = auto_backend(self.device, self.dtype, attn.head_dim)
        runner = ModelRunner(
            self.model,
            cache.pool,
            cache.table,
            backend,
            future_capacity,
            *cuda_graph_sizes(self.config, self.device),
        )
        return OverlapExecutor(runner) if overlap else SyncExecutor(runner)

    def _build_scheduler(self, kv: KVManager, overlap: bool, future_capacity: int) -> Scheduler:
        """The scheduler over `kv`, driving this engine's executor and role (built first), with
        the tokenizer's stop strings and grammars where the model has a tokenizer."""
        config = self.config
        stop_checker = grammars = None
        if self.tokenizer is not None:
            stop_checker = StopStringChecker(self.tokenizer)
            grammars = GrammarBackend(
                self.tokenizer,
                self.model_config.vocab_size,
                sorted(self.model_config.eos_token_ids),
            )
        return Scheduler(
            executor=self.executor,
            kv=kv,
            limits=scheduler_limits(config, self.context_length, self.model_config.vocab_size),
            eos_token_ids=self.model_config.eos_token_ids,
            overlap=overlap,
            future_capacity=future_capacity,
            stop_checker=stop_checker,
            role=self.role,
            grammars=grammars,
            wait_for_grammars=config.tp_size > 1,
        )

    def validate(self, request: GenerateRequest) -> None:
        """Raise InvalidRequestError if `request` cannot run here; changes nothing."""
        self._check_running()
        self.scheduler.validate(request)

    def add_request(self, request: GenerateRequest) -> None:
        self._check_running()
        self.scheduler.add_request(request)

    def abort_request(self, rid: str, message: str = "aborted") -> list[TokenOutput]:
        return self.scheduler.abort_request(rid, message)

    def step(self) -> list[TokenOutput]:
        self._check_running()
        return self.scheduler.step()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def check_device(self) -> None:
        """Raises where the device can run no more work: after a CUDA error (an illegal
        address, say) every later call on its context fails."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def shutdown(self) -> None:
        """Finish the step in flight, stop the KV transfers (a prefill engine's writes in
        flight end first), the executor and the grammar compiler, and let go of the model,
        the KV pool and the CUDA graphs, so that their device memory is free when this returns
        even if the Engine object lives on (an offline `LLM` kept in a notebook). Later calls
        do nothing; requests are refused."""
        if self.shut_down:
            return
        self.shut_down = True
        try:
            self.scheduler.drain()
        except Exception:  # its requests are ended either way; what it held must still go
            logger.exception("the step in flight failed at shutdown")
        try:  # first: its NIXL agent must let go of the KV pool before the pool is freed
            self.role.close()
        except Exception:  # what the engine holds must still go
            logger.exception("closing the %s role failed at shutdown", self.role.name)
        self.executor.shutdown()
        if self.scheduler.grammars is not None:
            self.scheduler.grammars.shutdown()
        del self.model
        gc.collect()  # the runner's pieces refer to one another
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _check_running(self) -> None:
        if self.shut_down:
            raise RuntimeError("the engine has been shut down: start a new one")
