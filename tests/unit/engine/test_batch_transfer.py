"""A step's batch goes to the device in one copy: every tensor of it (its sampling's and
penalties' too) arrives whole, as a view of one buffer, and an engine run on such batches
answers exactly as one run on the scheduler's own tensors."""

from __future__ import annotations

import dataclasses

import torch

from kubesgl.engine.forward_batch import ForwardBatch, _tensors, move_in_one_copy
from kubesgl.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")


def _answers(llm, prompts, moved: list[tuple[ForwardBatch, ForwardBatch]] | None):
    """Every prompt's tokens, greedy, sampled with a seed and penalised; with `moved`, every
    batch is moved in one copy before it runs, and (original, moved) is kept."""
    llm.engine.scheduler.kv.flush_cache()  # both runs start cold and batch alike
    executor = llm.engine.executor
    launch = executor.launch

    def launch_moved(batch):
        copy = move_in_one_copy(batch, CPU)
        moved.append((batch, dataclasses.replace(copy)))  # before the run sets its attn
        return launch(copy)

    if moved is not None:
        executor.launch = launch_moved
    params = [
        SamplingParams(max_tokens=8, temperature=0, logprobs=2),
        SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, top_k=20, seed=7),
        SamplingParams(max_tokens=8, temperature=0, frequency_penalty=0.5, repetition_penalty=1.3),
    ]
    try:
        outputs = llm.generate(prompts, params)
    finally:
        executor.launch = launch
    return [(o.token_ids, [lp.top for lp in o.logprobs or []]) for o in outputs]


def test_an_engine_answers_the_same_on_batches_moved_in_one_copy(
    tiny_model, make_llm, random_prompts
):
    llm = make_llm(
        tiny_model("llama"),
        chunked_prefill_size=32,
        max_running_requests=8,
        enable_mixed_chunk=True,
    )
    prompts = random_prompts(3, 20, 70, seed=3)
    pairs: list[tuple[ForwardBatch, ForwardBatch]] = []
    assert _answers(llm, prompts, pairs) == _answers(llm, prompts, None)
    modes = {original.mode.name for original, _ in pairs}
    assert {"MIXED", "DECODE"} <= modes, modes
    for original, copy in pairs:
        before, after = list(_tensors(original)), list(_tensors(copy))
        assert len(before) == len(after) >= 16
        for a, b in zip(before, after):
            assert (b.dtype, b.shape) == (a.dtype, a.shape) and torch.equal(a, b)
        buffers = {t.untyped_storage().data_ptr() for t in after}
        assert len(buffers) == 1, "one buffer, filled by one copy"
        assert all(t.data_ptr() % 16 == 0 for t in after)  # as Triton specialises pointers
        assert all(t.untyped_storage().data_ptr() not in buffers for t in before)
        plain = {f.name for f in dataclasses.fields(ForwardBatch)} - {"sampling"}
        for name in plain:
            if not isinstance(getattr(original, name), torch.Tensor):
                assert getattr(copy, name) == getattr(original, name), name
        assert copy.sampling.penalties is None or (
            copy.sampling.penalties.resets == original.sampling.penalties.resets
        )
