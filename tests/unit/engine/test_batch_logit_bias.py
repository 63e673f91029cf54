"""A step's logit bias: each request's entries, built once when it arrives (Req.bias), joined
in row order, each on its own row; none when no request of the step has a bias."""

from __future__ import annotations

import torch

from kubesgl.engine.sampling_params import SamplingParams
from kubesgl.engine.scheduler.batch_builder import BatchBuilder
from kubesgl.engine.scheduler.request import Req


def _req(rid: str, bias: dict[int, float]) -> Req:
    return Req(rid=rid, prompt_ids=[1, 2], params=SamplingParams(max_tokens=4, logit_bias=bias))


def _sampling(reqs: list[Req]):
    builder = BatchBuilder(kv=None, vocab_size=64, future_capacity=8)  # type: ignore[arg-type]
    return builder._sampling(reqs, [True] * len(reqs))


def test_each_row_gets_its_requests_entries():
    reqs = [_req("a", {}), _req("b", {7: 1.5, 3: -100}), _req("c", {}), _req("d", {9: 100})]
    bias = _sampling(reqs).logit_bias
    assert bias is not None
    assert bias.rows.tolist() == [1, 1, 3]
    assert bias.token_ids.tolist() == [7, 3, 9]
    assert bias.values.tolist() == [1.5, -100.0, 100.0]
    assert bias.rows.dtype == bias.token_ids.dtype == torch.int64
    assert bias.values.dtype == torch.float32


def test_a_step_reuses_no_tensor_of_a_request():
    """The batch's tensors are its own (the step may move them, or write into them)."""
    req = _req("a", {7: 1.0})
    bias = _sampling([req]).logit_bias
    assert req.bias is not None and bias is not None
    assert bias.token_ids.data_ptr() != req.bias[0].data_ptr()
    assert bias.values.data_ptr() != req.bias[1].data_ptr()


def test_no_bias_in_the_step_is_none():
    assert _sampling([_req("a", {}), _req("b", {})]).logit_bias is None
