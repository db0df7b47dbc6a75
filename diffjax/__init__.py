"""diffjax: the Differential Transformer (DIFF V1 and V2) and its standard twin in JAX/Flax NNX."""

from . import decode, hf, interop, ops
from .attention import (
    AttentionLayer,
    MultiheadAttention,
    MultiheadDiffAttn,
    MultiheadDiffAttnV2,
    Projection,
)
from .compile_options import cpu_compile_options
from .config import ConfigError, ModelConfig, lambda_init_fn, twin
from .decode import KVCache, generate
from .hf import PretrainedError, from_pretrained, save_pretrained
from .interop import load_unilm_state_dict, unilm_state_dict
from .layers import RMSNorm, SwiGLU, apply_rotary, rotary_angles
from .model import Block, TransformerLM
from .ops import differential_attention, dot_product_attention
from .param_count import ParamCount, compare_params, count_params

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
