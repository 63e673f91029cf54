"""Engine options: the flags of `kubesgl serve` (DESIGN.md, command line) as one dataclass,
shared by the offline `LLM` and the server."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    model: str
    tp_size: int = 1
    role: str = "mixed"  # mixed | prefill | decode
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8_e4m3
    load_format: str = "auto"  # auto | dummy
    seed: int = 0  # seeds dummy weights, and sampling (the same on every tensor-parallel rank)
    page_size: int = 1
    max_running_requests: int = 256
    chunked_prefill_size: int = 8192  # tokens of prompt per prefill step; <= 0 disables chunking
    max_prefill_tokens: int = 16384  # tokens of prompt admitted in one prefill step
    max_total_tokens: int | None = None  # KV pool size in tokens; None: from available memory
    mem_fraction_static: float = 0.85  # share of device memory for weights and KV when sizing from memory
    context_length: int | None = None  # None: the model's max_position_embeddings
    default_max_tokens: int = 4096  # output limit of requests that set none
    attention_backend: str = "auto"  # auto (attention.auto_backend) | torch | triton | flashinfer
    disable_radix_cache: bool = False
    disable_overlap_schedule: bool = False
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 256  # largest decode batch captured in a CUDA graph
    disaggregation_bootstrap_port: int = 8998  # prefill: its bootstrap server; decode: for bootstrap_port null
    disaggregation_timeout: float = 60.0  # seconds either side waits on its partner for one request's KV

    def validate(self) -> None:
        checks = [
            (self.tp_size >= 1, "--tp-size must be at least 1"),
            (self.role in ("mixed", "prefill", "decode"), f"--role must be mixed, prefill or decode, got {self.role!r}"),
            (self.device in ("auto", "cpu", "cuda"), f"--device must be auto, cpu or cuda, got {self.device!r}"),
            (self.kv_cache_dtype in ("auto", "fp8_e4m3"),
             f"--kv-cache-dtype must be auto or fp8_e4m3, got {self.kv_cache_dtype!r}"),
            (self.page_size >= 1, "--page-size must be at least 1"),
            (self.max_running_requests >= 1, "--max-running-requests must be at least 1"),
            (self.max_prefill_tokens >= 1, "--max-prefill-tokens must be at least 1"),
            (self.default_max_tokens >= 1, "--default-max-tokens must be at least 1"),
            (self.max_total_tokens is None or self.max_total_tokens >= 2 * self.page_size,
             "--max-total-tokens must hold at least two pages"),
            (0 < self.mem_fraction_static < 1, "--mem-fraction-static must be in (0, 1)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
