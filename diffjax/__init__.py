"""diffjax: the Differential Transformer (DIFF V1 and V2) and its standard twin in JAX/Flax NNX.

The library, by folder (docs/api.md has the whole map): ``nn`` (the Flax modules), ``ops``
(the attention computation) over ``kernels`` (Pallas, cuDNN, Splash), ``infra`` (runtime,
sharding, storage), ``interop`` (Hugging Face, the official weights, conversion), ``data`` and
``train``; ``config`` and ``cli`` at the bottom. The experiment layer above it: ``compare``,
``evaluate``, ``sweep``, ``retrofit``, ``lm_eval``, and the ``plan`` and ``sample`` commands.
"""

from diffjax import interop, ops
from diffjax.config import ConfigError, ModelConfig, lambda_init_fn, twin
from diffjax.infra.compile_options import cpu_compile_options
from diffjax.interop import hf
from diffjax.interop.hf import PretrainedError, from_pretrained, save_pretrained
from diffjax.interop.unilm import load_unilm_state_dict, unilm_state_dict
from diffjax.nn import decode
from diffjax.nn.attention import (
    AttentionLayer,
    MultiheadAttention,
    MultiheadDiffAttn,
    MultiheadDiffAttnV2,
    Projection,
)
from diffjax.nn.decode import KVCache, generate
from diffjax.nn.layers import RMSNorm, SwiGLU, apply_rotary, rotary_angles
from diffjax.nn.model import Block, TransformerLM
from diffjax.nn.param_count import ParamCount, compare_params, count_params
from diffjax.ops import differential_attention, dot_product_attention

__version__ = "0.1.0"

__all__ = [
    "AttentionLayer",
    "Projection",
    "Block",
    "ConfigError",
    "KVCache",
    "ModelConfig",
    "MultiheadAttention",
    "MultiheadDiffAttn",
    "MultiheadDiffAttnV2",
    "ParamCount",
    "PretrainedError",
    "RMSNorm",
    "SwiGLU",
    "TransformerLM",
    "apply_rotary",
    "compare_params",
    "count_params",
    "cpu_compile_options",
    "decode",
    "differential_attention",
    "dot_product_attention",
    "from_pretrained",
    "generate",
    "hf",
    "interop",
    "lambda_init_fn",
    "load_unilm_state_dict",
    "ops",
    "rotary_angles",
    "save_pretrained",
    "twin",
    "unilm_state_dict",
]
