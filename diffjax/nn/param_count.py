"""Parameter counts by part, for a config and its twin, without allocating any weights."""

from __future__ import annotations

import dataclasses
import math

import jax
from flax import nnx

from diffjax.nn.attention import Ramp
from diffjax.config import ModelConfig, twin
from diffjax.nn.model import TransformerLM

# Parts, in report order, keyed by the last path components that identify them.
PARTS = (
    "embedding",
    "attn.q_proj",
    "attn.k_proj",
    "attn.v_proj",
    "attn.out_proj",
    "attn.lambda",
    "attn.subln",
    "attn.gate",
    "ffn",
    "norms",
    "lm_head",
)


def _part(path: tuple) -> str:
    keys = jax.tree_util.keystr(path, simple=True, separator="/").split("/")
    if keys[0] == "embed":
        return "embedding"
    if keys[0] == "lm_head":
        return "lm_head"
    if "attn" in keys:
        name = keys[keys.index("attn") + 1]
        if name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            return f"attn.{name}"
        if name.startswith("lambda"):
            return "attn.lambda"
        if name == "subln":
            return "attn.subln"
        if name == "gate_proj":
            return "attn.gate"
    if "ffn" in keys:
        return "ffn"
    return "norms"


@dataclasses.dataclass(frozen=True)
class ParamCount:
    """Total parameters and a per-part breakdown (``PARTS``)."""

    total: int
    parts: dict[str, int]

    def __str__(self) -> str:
        return f"{self.total:,} parameters"


def count_params(config_or_model: ModelConfig | nnx.Module) -> ParamCount:
    """Count a model's parameters by part. A config is counted from abstract shapes only."""
    if isinstance(config_or_model, ModelConfig):
        model = nnx.eval_shape(lambda: TransformerLM(config_or_model, rngs=nnx.Rngs(0)))
    else:
        model = config_or_model
    parts = dict.fromkeys(PARTS, 0)
    # a retrofit's ramp w is a parameter in name only (never trained): not counted
    state = nnx.state(model, nnx.All(nnx.Param, nnx.Not(Ramp)))
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        parts[_part(path)] += math.prod(leaf.shape)
    return ParamCount(total=sum(parts.values()), parts=parts)


def compare_params(config: ModelConfig) -> str:
    """A Markdown table: each part's count for the DIFF config, its twin, and the difference."""
    other = twin(config)
    a, b = count_params(config), count_params(other)
    rows = [f"| part | {config.attention} | standard twin | difference |", "|---|---:|---:|---:|"]
    for part in PARTS:
        if a.parts[part] or b.parts[part]:
            rows.append(
                f"| {part} | {a.parts[part]:,} | {b.parts[part]:,} | "
                f"{a.parts[part] - b.parts[part]:+,} |"
            )
    rows.append(f"| **total** | **{a.total:,}** | **{b.total:,}** | **{a.total - b.total:+,}** |")
    return "\n".join(rows)
