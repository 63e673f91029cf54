"""`--model`: which values are Hugging Face ids (tests/integration/engine/test_hub_models.py
downloads and serves one), and the log lines while weights load."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kubesgl.engine.models import weights
from kubesgl.engine.models.hub import looks_like_hub_id, resolve_model


@pytest.mark.parametrize(
    ("model", "is_id"),
    [
        ("Qwen/Qwen3-0.6B", True),
        ("meta-llama/Llama-3.1-8B-Instruct", True),
        ("gpt2", True),
        ("/models/qwen", False),
        ("./qwen", False),
        ("~/models/qwen", False),
        ("a/b/c", False),
        ("../qwen", False),
        ("qwen/", False),
        ("", False),
    ],
)
def test_what_a_hub_id_looks_like(model, is_id):
    assert looks_like_hub_id(model) is is_id


def test_a_local_folder_is_itself_even_if_it_looks_like_an_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert resolve_model("org/name") == "org/name"  # never sent to the Hub
    assert (
        resolve_model("/no/such/folder") == "/no/such/folder"
    )  # a path: the caller says it is missing


def test_weights_loading_is_logged_from_start_to_end(tiny_model, monkeypatch, caplog):
    monkeypatch.setattr(weights, "PROGRESS_EVERY_S", 0.0)  # a progress line after every tensor
    caplog.set_level(logging.INFO, logger=weights.__name__)
    tensors = list(weights.read_safetensors(Path(tiny_model("llama")), torch.float32))
    lines = [record.getMessage() for record in caplog.records]
    assert lines[0].startswith("loading weights: 1 file(s), 0.00 GiB from ")
    assert sum("(" in line and "%)" in line for line in lines) == len(tensors)
    assert lines[-2].startswith("loading weights: ") and "%), " in lines[-2]
    assert lines[-1].startswith("weights loaded: ")
