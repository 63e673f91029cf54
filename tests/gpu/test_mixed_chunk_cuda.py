"""Mixed chunks on the GPU (--enable-mixed-chunk): a mixed step's attention through the Triton
and FlashInfer backends against the torch backend's extend path, and whole generations where
long prompts arrive while others decode, against the same engine without mixed chunks, with
the pure decode steps still replayed from CUDA graphs."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from gpu_backends import BACKENDS, FLASHINFER

from kubesgl.engine import LLM, SamplingParams
from kubesgl.engine.attention import AttentionLayerSpec, create_backend
from kubesgl.engine.attention.mixed import MixedAttention
from kubesgl.engine.forward_batch import ForwardMode
from kubesgl.engine.kvcache.pools import KVPool, ReqToTokenTable
from kubesgl.engine.messages import GenerateRequest

pytestmark = pytest.mark.gpu


# FlashInfer attends a mixed batch of short requests in one prefill pass: both ways here
MIXED_PATHS = [
    pytest.param("triton", False, id="triton"),
    pytest.param("flashinfer", False, marks=FLASHINFER.marks, id="flashinfer-two-passes"),
    pytest.param("flashinfer", True, marks=FLASHINFER.marks, id="flashinfer-one-pass"),
]


@pytest.mark.parametrize("backend,one_pass", MIXED_PATHS)
@pytest.mark.parametrize("window", [None, 37])
def test_mixed_attention_matches_the_torch_extend_path(
    backend, one_pass, window, attention_batch, monkeypatch
):
    from kubesgl.engine.attention import flashinfer_backend

    for limit in ("ONE_PASS_MIXED_MAX_KV", "ONE_PASS_MIXED_MAX_CHUNK"):
        monkeypatch.setattr(flashinfer_backend, limit, 4096 if one_pass else 0)
    device, dtype, heads, kv_heads, head_dim = torch.device("cuda"), torch.bfloat16, 8, 2, 128
    pool = KVPool(16384, 1, kv_heads, head_dim, dtype, device)
    table = ReqToTokenTable(8, 1024, device)
    gen = torch.Generator().manual_seed(0)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=gen))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=gen))
    table.table.copy_((torch.randperm(16383, generator=gen)[: 8 * 1024] + 1).view(8, 1024))
    spec = [AttentionLayerSpec(0, heads, kv_heads, head_dim, head_dim**-0.5, window)]
    # two prompt chunks (one after a cached prefix), then three decodes
    seq_lens, extend_lens, rows = [300, 77, 1000, 1, 513], [300, 20, 1, 1, 1], [5, 0, 3, 7, 2]
    batch = dataclasses.replace(
        attention_batch(ForwardMode.MIXED, seq_lens, extend_lens, rows, table.table), prefill_rows=2
    )
    q = torch.randn(sum(extend_lens), heads, head_dim, generator=gen).to(dtype).to(device)
    k = torch.randn(sum(extend_lens), kv_heads, head_dim, generator=gen).to(dtype).to(device)
    v = torch.randn(sum(extend_lens), kv_heads, head_dim, generator=gen).to(dtype).to(device)
    reference = create_backend(
        "torch", kv_pool=pool, req_to_token=table, layers=spec
    )  # MIXED as one extend
    reference.prepare(batch)
    expected = reference.forward(q, k, v, spec[0], batch).float()
    mixed = MixedAttention(create_backend(backend, kv_pool=pool, req_to_token=table, layers=spec))
    mixed.prepare(batch)
    assert (batch.attn.decode is None) == one_pass
    fresh = mixed.forward(q, k, v, spec[0], batch)
    torch.testing.assert_close(fresh.float(), expected, atol=2e-2, rtol=2e-2)
    out = torch.full_like(q, float("nan"))  # the piecewise graphs' buffer is written in place
    mixed.attend(q, spec[0], batch, out)
    torch.testing.assert_close(out, fresh, rtol=0, atol=0)


def long_prompts_while_decoding(llm: LLM, seed: int) -> tuple[dict[str, list], list[str]]:
    """Eight requests decode; four long prompts arrive one step apart. Returns every request's
    greedy tokens with their logprobs, and the modes of the steps launched."""
    engine, rng = llm.engine, random.Random(seed)
    modes: list[str] = []
    launch = engine.executor.launch
    engine.executor.launch = lambda batch: modes.append(batch.mode.name) or launch(batch)
    tokens: dict[str, list] = {}

    def submit(rid: str, length: int) -> None:
        prompt = [rng.randrange(3, 600) for _ in range(length)]
        tokens[rid] = []
        engine.add_request(
            GenerateRequest(
                rid=rid,
                input_ids=prompt,
                params=SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, logprobs=2),
            )
        )

    def step() -> None:
        for out in engine.step():
            tokens[out.rid] += out.logprobs

    for i in range(8):
        submit(f"short{i}", rng.randint(4, 40))
    while not all(tokens.values()):
        step()
    for i in range(4):
        submit(f"long{i}", rng.randint(300, 900))
        step()
    while engine.has_work():
        step()
    engine.scheduler.drain()
    engine.scheduler.check_integrity()
    return tokens, modes


def agreed_until_near_tie(reference: list, candidate: list, tie: float = 0.05) -> bool:
    """True if two greedy runs (their TokenLogprobs) agree token for token; False if they part
    where the reference's two best tokens were within `tie` nats; any other difference fails."""
    for step, (a, b) in enumerate(zip(reference, candidate)):
        if a.token_id != b.token_id:
            (_, first), (_, second) = sorted(a.top, key=lambda t: -t[1])[:2]
            assert first - second < tie, (
                f"step {step}: {a.token_id} != {b.token_id}, margin {first - second:.3f}"
            )
            return False
    assert len(reference) == len(candidate)
    return True


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "qwen3-moe"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_chunk_generations_equal_separate_steps(arch, backend, page_size, tiny_model):
    """A mixed step's GEMMs have more rows than the separate steps', so they may round
    differently (float32 for Triton, float16 for FlashInfer, which has no float32 kernels):
    the runs must agree until a near tie, and most of them throughout."""
    dtype = "float32" if backend == "triton" else "float16"
    common = dict(
        device="cuda",
        dtype=dtype,
        page_size=page_size,
        max_total_tokens=32768,
        max_running_requests=16,
        chunked_prefill_size=128,
        attention_backend=backend,
    )
    path = tiny_model(arch, head_dim=64)
    with LLM(path, **common) as llm:
        expected, modes = long_prompts_while_decoding(llm, seed=5)
    assert "MIXED" not in modes
    with LLM(path, enable_mixed_chunk=True, **common) as llm:
        replays = 0
        run = llm.engine.executor.runner.cuda_graphs.run

        def counted(*args):
            nonlocal replays
            replays += 1
            return run(*args)

        llm.engine.executor.runner.cuda_graphs.run = counted
        got, modes = long_prompts_while_decoding(llm, seed=5)
    assert modes.count("MIXED") >= 4 and replays == modes.count("DECODE") > 0
    same = [agreed_until_near_tie(expected[rid], got[rid]) for rid in expected]
    assert sum(same) >= len(same) - 2, same


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3-moe"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_piecewise_cuda_graphs_agree_with_eager_steps(arch, backend, tiny_model):
    """Prefill and mixed steps replayed from piecewise graphs (padded to a captured token
    count) against the same steps run eagerly."""
    dtype = "float32" if backend == "triton" else "float16"
    common = dict(
        device="cuda",
        dtype=dtype,
        max_total_tokens=32768,
        max_running_requests=16,
        chunked_prefill_size=200,  # captured counts end 128, 192, 200: smaller steps are padded
        enable_mixed_chunk=True,
        attention_backend=backend,
    )
    path = tiny_model(arch, head_dim=64)
    with LLM(path, **common) as llm:
        expected, _ = long_prompts_while_decoding(llm, seed=7)
    with LLM(path, enable_piecewise_cuda_graph=True, **common) as llm:
        pieces = llm.engine.executor.runner.piecewise_graphs
        assert pieces.token_counts[-1] == 200
        replayed: list[str] = []
        run = pieces.run
        pieces.run = lambda ids, batch, attn: (
            replayed.append(batch.mode.name) or run(ids, batch, attn)
        )
        got, modes = long_prompts_while_decoding(llm, seed=7)
    assert sorted(replayed) == sorted(m for m in modes if m != "DECODE")
    assert "MIXED" in replayed and "EXTEND" in replayed
    same = [agreed_until_near_tie(expected[rid], got[rid]) for rid in expected]
    assert sum(same) >= len(same) - 2, same


@pytest.mark.parametrize("arch", ["llama", "qwen3-moe"])
def test_piecewise_logits_equal_the_eager_forward_pass(arch, tiny_model):
    """Every prefill and mixed step replayed from piecewise graphs gives the logits of the eager
    forward pass over the same prepared batch, whatever the padding rows hold (NaN here),
    at captured token counts and between them."""
    path = tiny_model(arch, head_dim=64)
    options = dict(
        device="cuda",
        dtype="float32",
        attention_backend="triton",
        max_total_tokens=32768,
        max_running_requests=16,
        chunked_prefill_size=200,
        enable_mixed_chunk=True,
        enable_piecewise_cuda_graph=True,
    )
    with LLM(path, **options) as llm:
        runner = llm.engine.executor.runner
        pieces, model, replay = runner.piecewise_graphs, runner.model, runner.piecewise_graphs.run
        token_counts: list[int] = []

        def checked(input_ids, batch, backend):
            t = batch.num_tokens
            expected = model(input_ids, batch.positions, batch, backend)
            pieces.attention[t:].fill_(float("nan"))
            got = replay(input_ids, batch, backend)
            torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)
            token_counts.append(t)
            return got

        pieces.run = checked
        long_prompts_while_decoding(llm, seed=3)
    assert {t in pieces.token_counts for t in token_counts} == {True, False}
