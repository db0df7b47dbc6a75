"""The Differential Transformer V2 (DIFF V2) for ``transformers``, written by diffjax.

``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`` loads a diffjax DIFF V2
export; this file imports torch and transformers only. A Llama model whose attention, per
layer, is DIFF V2 as the official ``multihead_flashdiffv2.py`` computes it:

- ``q_proj: D -> 2h d``, ``k_proj``/``v_proj: D -> h_kv d``; rotary on every query and key head.
- One standard attention call over the 2h query heads (eager, SDPA or any implementation
  transformers has, with its KV cache): ``O [B, T, 2h, d]``.
- ``lambda = sigmoid(lambda_proj(x))`` per token and head (``lambda_proj: D -> h``, no bias,
  float32), ``O_i = O_{2i} - lambda_i O_{2i+1}``, then ``o_proj: h d -> D``.

Everything else (embedding, RMSNorm, SwiGLU, rotary scaling, masks, cache, generation) is
transformers' Llama. The attention call is Llama's own: only the output projection differs.
"""

import torch
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaModel,
)

from .configuration_diff_transformer_v2 import DiffTransformerV2Config


class DiffTransformerV2Output(nn.Linear):
    """``o_proj`` of DIFF V2: the pair difference ``O_{2i} - lambda_i O_{2i+1}`` of the 2h
    heads' outputs, then the projection ``h d -> D`` (a bias-free ``nn.Linear``)."""

    def __init__(self, num_heads: int, head_dim: int, hidden_size: int):
        super().__init__(num_heads * head_dim, hidden_size, bias=False)
        self.num_heads, self.head_dim = num_heads, head_dim
        self.lam = None  # [B, T, h] float32, set by the attention before each call

    def forward(self, o: torch.Tensor) -> torch.Tensor:
        b, t = o.shape[:2]
        o = o.reshape(b, t, self.num_heads, 2, self.head_dim)
        lam = self.lam.to(o.dtype)[..., None]
        self.lam = None
        return super().forward((o[:, :, :, 0] - lam * o[:, :, :, 1]).reshape(b, t, -1))


class DiffTransformerV2Attention(LlamaAttention):
    """Llama's attention over the 2h query heads, with :class:`DiffTransformerV2Output` as its
    ``o_proj`` and the per-token, per-head ``lambda_proj``."""

    def __init__(self, config: DiffTransformerV2Config, layer_idx: int):
        super().__init__(config, layer_idx)
        h = config.num_attention_heads // 2
        self.o_proj = DiffTransformerV2Output(h, self.head_dim, config.hidden_size)
        self.lambda_proj = nn.Linear(config.hidden_size, h, bias=False)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        x = hidden_states.float()
        self.o_proj.lam = torch.sigmoid(nn.functional.linear(x, self.lambda_proj.weight.float()))
        return super().forward(hidden_states, *args, **kwargs)


class DiffTransformerV2Model(LlamaModel):
    config_class = DiffTransformerV2Config

    def __init__(self, config: DiffTransformerV2Config):
        super().__init__(config)
        for i, layer in enumerate(self.layers):
            layer.self_attn = DiffTransformerV2Attention(config, i)
        self.post_init()


class DiffTransformerV2ForCausalLM(LlamaForCausalLM):
    config_class = DiffTransformerV2Config

    def __init__(self, config: DiffTransformerV2Config):
        super().__init__(config)
        self.model = DiffTransformerV2Model(config)
        self.post_init()


__all__ = [
    "DiffTransformerV2Attention",
    "DiffTransformerV2ForCausalLM",
    "DiffTransformerV2Model",
    "DiffTransformerV2Output",
]
