"""Constrained decoding on the GPU: the bitmask applied by xgrammar's CUDA kernel, with CUDA
graphs and overlap, gives answers that validate, in every sampling mode; unconstrained rows
of the same batch are untouched."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from kubesgl.engine import LLM, SamplingParams
from kubesgl.engine.sampling_params import GrammarSpec

pytestmark = pytest.mark.gpu

SCHEMA = {
    "type": "object",
    "required": ["id", "tags", "ok"],
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}},
        "ok": {"type": "boolean"},
    },
}
MODES = [
    dict(temperature=0),
    dict(temperature=1.0, seed=1),
    dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05),
    dict(temperature=0, repetition_penalty=1.2, presence_penalty=0.5),
]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_grammar_answers_validate_on_cuda(tiny_model, overlap):
    path = tiny_model("llama")
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA))
    params = [
        SamplingParams(max_tokens=80, grammar=grammar, **mode) for mode in MODES
    ] * 8  # batch of 32
    plain = SamplingParams(max_tokens=16, temperature=0)
    prompts = [f"prompt {i}" for i in range(len(params) + 4)]
    gpu = LLM(path, device="cuda", dtype="float32", disable_overlap_schedule=not overlap)
    outputs = gpu.generate(prompts, params + [plain] * 4)
    for out in outputs[: len(params)]:
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), SCHEMA)
    # the same batch without grammars: the masks must leave the unconstrained rows' tokens alone
    free = gpu.generate(
        prompts, [SamplingParams(max_tokens=80, **mode) for mode in MODES] * 8 + [plain] * 4
    )
    assert [o.token_ids for o in outputs[len(params) :]] == [
        o.token_ids for o in free[len(params) :]
    ]
    gpu.shutdown()
    torch.cuda.empty_cache()
