"""The tokenizer the scheduler needs for stop strings is loaded with the engine, before it
serves: loaded at the first request with a stop string, inside the scheduler loop, it held every
running request for 1.3 s (3.2 s at TP 2). The server's warm-up request goes through the stop
string path too, so the first real one pays no first-use cost."""

from __future__ import annotations

import logging
import shutil

import pytest
import transformers

from kubesgl.engine.sampling_params import InvalidRequestError, SamplingParams
from kubesgl.engine.scheduler.process import _warm_up
from kubesgl.engine.scheduler.stop_strings import StopStringChecker


def test_the_tokenizer_is_loaded_once_with_the_engine_and_never_while_serving(
    tiny_model, make_llm, monkeypatch
):
    loads = []
    load = transformers.AutoTokenizer.from_pretrained

    def counted(*args, **kwargs):
        loads.append(args)
        return load(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counted)
    llm = make_llm(tiny_model("llama"))
    assert len(loads) == 1 and llm.engine.scheduler.stop_checker.tokenizer is llm.tokenizer

    def refused(*args, **kwargs):
        raise AssertionError("a tokenizer was loaded while serving")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refused)
    free = llm.generate(["The capital of France is"], SamplingParams(max_tokens=12, temperature=0))[
        0
    ]
    stop = free.text[3:6]
    assert stop.strip()
    out = llm.generate(
        ["The capital of France is"], SamplingParams(max_tokens=12, temperature=0, stop=[stop])
    )[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[: free.text.index(stop)]


def test_the_servers_warm_up_takes_the_stop_string_path(tiny_model, make_llm, monkeypatch):
    llm = make_llm(tiny_model("llama"))
    checked = []
    match = StopStringChecker.match

    def spy(self, req):
        checked.append(req.rid)
        return match(self, req)

    monkeypatch.setattr(StopStringChecker, "match", spy)
    _warm_up(llm.engine)
    assert checked and set(checked) == {"warmup"}


def test_a_model_without_a_tokenizer_starts_and_refuses_stop_strings(
    tiny_model, make_llm, tmp_path
):
    path = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model("llama"), path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink()
    llm = make_llm(str(path))
    assert llm.tokenizer is None
    _warm_up(llm.engine)  # without a stop string
    assert (
        len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids)
        == 3
    )
    with pytest.raises(InvalidRequestError, match="no tokenizer: stop strings cannot be matched"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, stop=["x"]))


def test_a_prompt_longer_than_the_tokenizers_own_limit_logs_no_indexing_warning(tiny_model):
    """The engine refuses a prompt longer than its context with a 400; the tokenizer's own
    limit only added transformers' warning of "indexing errors", which no model run here has."""
    from kubesgl.engine.tokenizer.loader import load_tokenizer

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    transformers_logger = transformers.utils.logging.get_logger("transformers")
    transformers_logger.addHandler(handler)
    try:
        tokenizer = load_tokenizer(tiny_model("llama"))
        assert len(tokenizer.encode("hello world " * 3000)) > 2048
    finally:
        transformers_logger.removeHandler(handler)
    assert not [r for r in records if "indexing errors" in r.getMessage()]
