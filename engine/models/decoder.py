"""The decoder shared by every supported architecture (Llama, Mistral, Qwen2, Qwen3,
Qwen3-MoE). What differs between them is data in ModelConfig: biases on the projections,
RMS norms on q and k, sliding windows, and a sparse MoE block in place of the MLP."""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

from kubesgl.engine.attention import AttentionBackend, AttentionLayerSpec
from kubesgl.engine.forward_batch import ForwardBatch, ForwardMode
from kubesgl.engine.layers.activation import gated_activation
from kubesgl.engine.layers.embedding import VocabParallelEmbedding
from kubesgl.engine.layers.kernels import LayerKernels
from kubesgl.engine.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from kubesgl.engine.layers.moe import SparseMoeBlock
from kubesgl.engine.layers.norm import RMSNorm
from kubesgl.engine.layers.rotary import RotaryEmbedding
from kubesgl.engine.model_config import ModelConfig


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        kernels: LayerKernels,
    ):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_heads,
            config.num_kv_heads,
            config.qkv_bias,
            dtype,
            kernels,
        )
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim,
            config.hidden_size,
            config.o_proj_bias,
            dtype,
            kernels=kernels,
        )
        self.q_norm = (
            RMSNorm(config.head_dim, config.rms_norm_eps, dtype, kernels)
            if config.qk_norm
            else None
        )
        self.k_norm = (
            RMSNorm(config.head_dim, config.rms_norm_eps, dtype, kernels)
            if config.qk_norm
            else None
        )
        self.rotary = rotary
        self.spec = AttentionLayerSpec(
            layer_id=layer_id,
            num_heads=self.qkv_proj.num_heads,
            num_kv_heads=self.qkv_proj.num_kv_heads,
            head_dim=config.head_dim,
            scaling=config.head_dim**-0.5,
            sliding_window=config.sliding_windows[layer_id],
        )

    def project(
        self, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, dim], k and v [T, kv_heads, dim], rotated: what attention takes."""
        q, k, v = self.spec.split_qkv(self.qkv_proj(hidden))
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (qk_norm)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return q, k, v


class MLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        bias: bool,
        dtype: torch.dtype,
        kernels: LayerKernels,
    ):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias, dtype, kernels
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias, dtype, kernels=kernels
        )
        self.act = gated_activation(hidden_act, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        kernels: LayerKernels,
    ):
        super().__init__()
        self.self_attn = Attention(config, layer_id, rotary, dtype, kernels)
        moe = config.moe
        if moe is not None and layer_id in moe.sparse_layers:
            self.mlp: nn.Module = SparseMoeBlock(
                config.hidden_size,
                moe.intermediate_size,
                moe.num_experts,
                moe.top_k,
                moe.normalize_top_k,
                config.hidden_act,
                dtype,
                kernels,
            )
        else:
            self.mlp = MLP(
                config.hidden_size,
                config.intermediate_size,
                config.hidden_act,
                config.mlp_bias,
                dtype,
                kernels,
            )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, kernels)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype, kernels
        )

    # A layer is the part before attention and the part after it, so that piecewise CUDA
    # graphs (executor/piecewise_graph.py) can capture each and run attention between them.
    def before_attention(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v and the residual stream; residual None: the first layer's input."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        q, k, v = self.self_attn.project(hidden, positions)
        return q, k, v, residual

    def after_attention(
        self, attention: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """attention: [T, heads * dim]. Returns (this layer's output, the residual stream
        before it); the next norm adds them."""
        hidden = self.self_attn.o_proj(attention)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def forward(self, hidden, residual, positions, batch, backend):
        q, k, v, residual = self.before_attention(hidden, residual, positions)
        out = backend.forward(q, k, v, self.self_attn.spec, batch)
        return self.after_attention(out.reshape(q.shape[0], -1), residual)


class CausalLM(nn.Module):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device, kernels: LayerKernels
    ):
        super().__init__()
        self.config = config
        rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope, device, kernels
        )
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, dtype, kernels
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, rotary, dtype, kernels) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, kernels)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, kernels)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Float32 logits at the last new token of every request: [B, vocab]."""
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, positions, batch, backend)
        assert residual is not None  # set by the first layer
        return self.logits(hidden, residual, batch)

    def logits(
        self, hidden: torch.Tensor, residual: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """The last layer's output and residual stream -> logits of each request's last token."""
        if batch.mode is not ForwardMode.DECODE:  # logits of each request's last new token only
            last = batch.extend_lens.cumsum(0) - 1
            hidden, residual = hidden[last], residual[last]
        hidden, _ = self.norm(hidden, residual)
        return self.lm_head.logits(hidden)

    def attention_specs(self) -> list[AttentionLayerSpec]:
        return [cast(DecoderLayer, layer).self_attn.spec for layer in self.layers]

    # -- weights ---------------------------------------------------------------------
    _STACKED = {  # checkpoint projection -> (fused parameter, shard)
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face checkpoint tensors; raises if any parameter is left unset."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (
                self.config.tie_word_embeddings and name.startswith("lm_head.")
            ):
                continue  # recomputed, or tied to the embedding
            parts = name.split(".")
            if ".mlp.experts." in name:
                loaded |= self._load_expert(parts, tensor)
            elif len(parts) >= 2 and parts[-2] in self._STACKED:
                fused, shard = self._STACKED[parts[-2]]
                target = ".".join(parts[:-2] + [fused, parts[-1]])
                param = self._param(params, target, name)
                param.weight_loader(param, tensor, shard)  # type: ignore[attr-defined]  # _attach_loader
                loaded.add(f"{target}#{shard}")
            else:
                param = self._param(params, name, name)
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(name)
        missing = [name for name in params if not self._expected_entries(name) <= loaded]
        if missing:
            raise ValueError(
                f"checkpoint lacks tensors for {len(missing)} parameters, for example {missing[:3]}"
            )

    def _param(self, params: dict[str, nn.Parameter], target: str, source: str) -> nn.Parameter:
        if target not in params:
            raise ValueError(
                f"checkpoint tensor {source!r} has no place in {self.config.architecture}"
            )
        return params[target]

    def _load_expert(self, parts: list[str], tensor: torch.Tensor) -> set[str]:
        layer = int(parts[1])
        block = self.layers[layer].mlp
        if not isinstance(block, SparseMoeBlock):
            raise ValueError(
                f"layer {layer} has no experts but the checkpoint has {'.'.join(parts)}"
            )
        prefix = f"layers.{layer}.mlp.experts"
        if parts[-1] == "weight":  # one expert: layers.L.mlp.experts.E.gate_proj.weight
            expert = int(parts[-3])
            block.load_expert(expert, parts[-2], tensor)
            return {f"{prefix}.{expert}.{parts[-2]}"}
        block.load_fused(parts[-1], tensor)  # stacked: layers.L.mlp.experts.gate_up_proj
        projections = ["down_proj"] if parts[-1] == "down_proj" else ["gate_proj", "up_proj"]
        return {f"{prefix}.{e}.{p}" for e in range(block.num_experts) for p in projections}

    def _expected_entries(self, name: str) -> set[str]:
        """What `load_weights` records once parameter `name` is fully loaded."""
        if name.endswith((".w13", ".w2")):
            prefix = name.rsplit(".", 1)[0] + ".experts"
            projections = ["down_proj"] if name.endswith(".w2") else ["gate_proj", "up_proj"]
            assert self.config.moe is not None  # expert weights exist in MoE models only
            num_experts = self.config.moe.num_experts
            return {f"{prefix}.{e}.{p}" for e in range(num_experts) for p in projections}
        if ".qkv_proj." in name:
            return {f"{name}#{shard}" for shard in "qkv"}
        if ".gate_up_proj." in name:
            return {f"{name}#0", f"{name}#1"}
        return {name}
