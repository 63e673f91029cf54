"""Choosing an attention backend, and the errors a backend gives where it cannot run."""

from __future__ import annotations

import importlib.util
import typing

import pytest
import torch

from kubesgl.engine.attention import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    AttentionLayerSpec,
    auto_backend,
    create_backend,
)
from kubesgl.engine.config import ENGINE_OPTIONS, AttentionBackendName
from kubesgl.engine.kvcache.pools import KVPool, ReqToTokenTable

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None


def test_the_registry_has_exactly_the_backends_the_option_declares():
    """engine/config.py declares the names torch-free (the CLI and the CRD read them); the registry
    in engine/attention holds the classes: a backend in one but not the other fails here."""
    assert set(ATTENTION_BACKENDS) == set(typing.get_args(AttentionBackendName))
    assert set(ENGINE_OPTIONS["attention_backend"].choices) == {"auto", *ATTENTION_BACKENDS}
    for name, entry in ATTENTION_BACKENDS.items():  # flashinfer itself is imported only when built
        assert issubclass(entry.load(), AttentionBackend), name


def test_an_unknown_backend_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="available: flashinfer, triton, torch"):
        create_backend("xformers")


def test_auto_picks_torch_on_the_cpu():
    assert auto_backend(torch.device("cpu"), torch.bfloat16, 128) == "torch"


@pytest.mark.parametrize(
    "dtype,head_dim,installed,expected",
    [
        (torch.bfloat16, 128, True, "flashinfer"),
        (torch.float16, 64, True, "flashinfer"),
        (torch.float32, 128, True, "triton"),  # FlashInfer has no float32 kernels
        (torch.bfloat16, 80, True, "torch"),  # nor this head size, which Triton's kernels lack too
        (torch.bfloat16, 128, False, "triton"),
        (torch.float16, 96, False, "torch"),
    ],
)
def test_auto_on_cuda_prefers_flashinfer_where_it_can(
    monkeypatch, dtype, head_dim, installed, expected
):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (
            (object() if installed else None) if name == "flashinfer" else real(name, *a)
        ),
    )
    assert auto_backend(torch.device("cuda"), dtype, head_dim) == expected


@pytest.mark.parametrize(
    "installed,dtype,head_dim,problem",
    [
        (False, torch.bfloat16, 128, "needs the flashinfer-python package"),
        (True, torch.float32, 128, "needs --dtype bfloat16 or float16"),
        (True, torch.bfloat16, 80, "needs a head size in (64, 128, 256), and this model's is 80"),
    ],
)
def test_flashinfer_names_the_first_reason_it_cannot_run_a_model(
    monkeypatch, installed, dtype, head_dim, problem
):
    """The reason preflight refuses `--attention-backend flashinfer` with."""
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if installed else None
    )
    found = ATTENTION_BACKENDS["flashinfer"].problem(dtype, head_dim)
    assert found is not None and problem in found


def test_flashinfer_backend_refuses_what_it_cannot_run_with_a_clear_error():
    pool = KVPool(64, 1, 2, 64, torch.bfloat16, torch.device("cpu"))
    table = ReqToTokenTable(4, 32, torch.device("cpu"))
    layers = [AttentionLayerSpec(0, 4, 2, 64, 0.125, None)]
    match = (
        "runs on CUDA devices only" if HAS_FLASHINFER else r"pip install 'kubesgl\[flashinfer\]'"
    )
    with pytest.raises(ValueError, match=match):
        create_backend("flashinfer", kv_pool=pool, req_to_token=table, layers=layers)


def test_unknown_backend_is_named_in_the_error():
    with pytest.raises(ValueError, match="'flash' is not available"):
        create_backend("flash", kv_pool=None, req_to_token=None, layers=[])


def test_triton_backend_refuses_head_sizes_its_kernels_cannot_run():
    pool = KVPool(64, 1, 2, 80, torch.float32, torch.device("cpu"))
    table = ReqToTokenTable(4, 32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"power-of-two head sizes of at least 16, not \[80\]"):
        create_backend(
            "triton",
            kv_pool=pool,
            req_to_token=table,
            layers=[AttentionLayerSpec(0, 4, 2, 80, 0.1, None)],
        )


def test_flashinfer_prefill_splits_the_kv_only_over_prefixes_long_against_the_new_tokens():
    from kubesgl.engine.attention.flashinfer_backend import prefill_splits_kv

    assert not prefill_splits_kv([256], [256])  # a first chunk: no prefix
    assert not prefill_splits_kv([1536], [512])  # 1024 cached, 512 new
    assert prefill_splits_kv([4096 + 256], [256])  # a long prefix, one chunk
    # the longest prefix against all the step's new tokens: many requests fill the device
    assert not prefill_splits_kv([4096 + 256] + [512] * 4, [256] + [512] * 4)
    assert prefill_splits_kv([8192 + 16, 16], [16, 16])


def test_flashinfer_attends_a_mixed_step_in_one_pass_only_with_short_requests_and_a_small_chunk():
    from kubesgl.engine.attention.flashinfer_backend import mixed_in_one_pass

    assert mixed_in_one_pass(chunk_tokens=224, longest_request=768)
    assert mixed_in_one_pass(chunk_tokens=256, longest_request=2048)
    assert not mixed_in_one_pass(chunk_tokens=224, longest_request=4096)  # long decodes
    assert not mixed_in_one_pass(chunk_tokens=512, longest_request=768)  # a large chunk


def test_flashinfer_counts_each_requests_kv_in_pages_and_the_tokens_of_its_last_page():
    from kubesgl.engine.attention.flashinfer_backend import PagedKVLengths

    lengths = PagedKVLengths([1, 16, 17, 33], page_size=16)
    assert lengths.total_pages == 7
    assert lengths.indptr.tolist() == [0, 1, 2, 4, 7]
    assert lengths.last_page_len.tolist() == [1, 16, 1, 1]
    single = PagedKVLengths([5, 3], page_size=1)  # pages of one token are slots
    assert single.indptr.tolist() == [0, 5, 8] and single.last_page_len.tolist() == [1, 1]


def test_kv_pool_refuses_slots_that_are_not_whole_pages():
    with pytest.raises(ValueError, match="whole number of 16-slot pages"):
        KVPool(40, 1, 1, 8, torch.float32, torch.device("cpu"), page_size=16)
