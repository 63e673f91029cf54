from __future__ import annotations

from typing import get_args

import pytest
import torch

from kubesgl.engine.layers.rotary import ROPE_SCALINGS, rope_inv_freq
from kubesgl.engine.model_config import ModelConfigError, RopeType, parse_model_config

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rope_theta": 500000.0,
}


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default"},
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 16,
            "truncate": False,
        },
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 512,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        },
    ],
    ids=["default", "linear", "llama3", "yarn", "yarn-untruncated", "yarn-mscale"],
)
def test_rope_frequencies_equal_transformers(rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = {**BASE, "rope_scaling": {"rope_theta": BASE["rope_theta"], **rope}}
    config = parse_model_config(raw)
    hf_config = LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    expected_freq, expected_scale = (
        ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, None)
        if rope["rope_type"] != "default"
        else (1.0 / (BASE["rope_theta"] ** (torch.arange(0, 16, 2).float() / 16)), 1.0)
    )
    inv_freq, scale = rope_inv_freq(config.head_dim, config.rope)
    torch.testing.assert_close(inv_freq, expected_freq, rtol=0, atol=0)
    assert scale == pytest.approx(expected_scale, rel=1e-12)


def test_every_rope_type_the_config_accepts_has_its_scaling():
    assert set(ROPE_SCALINGS) == set(get_args(RopeType))


def test_per_architecture_differences():
    qwen2 = parse_model_config({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen2.qkv_bias and not qwen2.o_proj_bias and not qwen2.qk_norm
    qwen3 = parse_model_config({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert qwen3.qk_norm and qwen3.head_dim == 32
    mistral = parse_model_config(
        {**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 256}
    )
    assert mistral.sliding_windows == (256, 256)
    moe = parse_model_config(
        {
            **BASE,
            "architectures": ["Qwen3MoeForCausalLM"],
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "mlp_only_layers": [0],
        }
    )
    assert moe.moe.num_experts == 8 and moe.moe.sparse_layers == frozenset({1})
    eos = parse_model_config({**BASE, "eos_token_id": 5}, {"eos_token_id": [5, 7]})
    assert eos.eos_token_ids == {5, 7}


def test_unsupported_inputs_are_named():
    with pytest.raises(ModelConfigError, match="unsupported architecture.*BertModel"):
        parse_model_config({**BASE, "architectures": ["BertModel"]})
    with pytest.raises(
        ModelConfigError,
        match=r"unsupported rope type 'longrope' \(supported: default, linear, llama3, yarn\)",
    ):
        parse_model_config({**BASE, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
