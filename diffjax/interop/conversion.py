"""The conversion behind a retrofit (:mod:`diffjax.retrofit`): a pretrained standard-attention
model into DIFF V2 or DIFF V1. The settings, the ramp of the negative map's weight, and the
weight mapping (pure functions on the parameters).

How a source becomes DIFF (``ModelConfig.ramp``: each DIFF layer uses ``w * lambda``, with w a
:class:`diffjax.nn.attention.Ramp` the train step moves from 0 to 1 over
``retrofit.warmup_steps``):

- **DIFF V2 starts exactly where the source is.** Same ``num_heads``, ``num_kv_heads`` and
  head width; query head ``2i`` of pair ``i`` (its positive map) is the source's query head
  ``i``; keys, values, ``out_proj``, rotary and every other weight are copied. The odd query
  heads (the negative maps) are ``retrofit.second``: zero, a mirror of the positive query, or
  a fresh random init. At w = 0 the negative term is gone, so the logits are the source's
  (``lambda_proj`` has no bias: sigma(lambda) alone cannot reach 0, hence the ramp). Pairs
  never straddle kv groups: pair ``i`` reads group ``i // (h / h_kv)``, as source head ``i``.
- **DIFF V1 cannot.** Its per-head RMSNorm over 2d is scale-invariant and nonlinear, and a V1
  head applies one map to a 2d-wide value where the source applies two maps to d-wide values.
  The closest start: DIFF head ``i`` (kv group ``g = i // n_rep``, ``r = i % n_rep``) takes as
  its first query the source head ``j1 = 2 g n_rep + r``, which reads source kv head ``2g`` (its
  K1); the source head ``j2 = (2g + 1) n_rep + r`` reads kv head ``2g + 1`` (K2) and is the one
  whose map is dropped: its value half and its rows of ``out_proj`` are kept. With MHA this is
  the identity (``j1 = 2i``, ``j2 = 2i + 1``). It needs even head and kv-head counts and a
  source head width of ``d_model / num_heads``; the step-0 gap is measured, not zero.
  ``retrofit.second=zero`` zeroes only the second query (zeroing both Q2 and K2 is a saddle:
  each one's gradient is proportional to the other); ``mirror`` copies Q1 to Q2 and K1 to K2.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from diffjax.nn.attention import Ramp
from diffjax.config import ConfigError, ModelConfig, check_fields, fail
from diffjax.nn.model import TransformerLM

RAMPS = ("linear", "cosine")
SECONDS = ("zero", "mirror", "random")
LAMBDA_PROJ = ("default", "zero")


@dataclasses.dataclass(frozen=True)
class RetrofitConfig:
    """How a standard model becomes DIFF (``python -m diffjax.retrofit``, or ``train.py
    train.init_from=SOURCE train.retrofit=true``). V1's ``lambda_init`` and per-head norm are
    ``model.lambda_init`` and ``model.diff_norm``."""

    # steps over which the negative map's weight w goes from 0 to 1 (0: w = 1 from the start)
    warmup_steps: int = 1000
    ramp: str = "linear"  # the shape of w over warmup_steps
    # the negative maps' queries at the start: zero, a mirror of the positive query (V1: and
    # of K1 to K2), or random (a fresh init)
    second: str = "zero"
    # DIFF V2's lambda_proj at the start: the default init (sigma(lambda) ~ 0.5), or zero
    # (sigma = 0.5 exactly)
    lambda_proj: str = "default"

    def __post_init__(self):
        check_fields(self)
        c = "RetrofitConfig"
        if self.warmup_steps < 0:
            fail(c, "warmup_steps", f"must be >= 0, got {self.warmup_steps}", "use e.g. 1000")
        for name, allowed in (("ramp", RAMPS), ("second", SECONDS), ("lambda_proj", LAMBDA_PROJ)):
            if getattr(self, name) not in allowed:
                fail(
                    c,
                    name,
                    f"unknown value {getattr(self, name)!r}",
                    f"use one of {', '.join(map(repr, allowed))}",
                )

    @property
    def schedule(self) -> "RampSchedule":
        return RampSchedule(self.warmup_steps, self.ramp)


@dataclasses.dataclass(frozen=True)
class RampSchedule:
    """``w(step)``: 0 at step 0, 1 from ``warmup_steps`` on, linear or cosine between; a jnp
    function of a traced step (the train step computes it: no recompilation as w moves)."""

    warmup_steps: int
    shape: str = "linear"

    def __call__(self, step) -> jax.Array:
        if self.warmup_steps == 0:
            return jnp.ones((), jnp.float32)
        t = jnp.clip(jnp.asarray(step, jnp.float32) / self.warmup_steps, 0.0, 1.0)
        if self.shape == "cosine":
            return (0.5 - 0.5 * jnp.cos(jnp.pi * t)).astype(jnp.float32)
        return t


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def set_ramp(params: nnx.State, w) -> nnx.State:
    """``params`` (an ``nnx.State``) with every :class:`Ramp` set to ``w`` (stacked layers:
    each layer's entry); jittable."""

    def one(v):
        if isinstance(v, Ramp):
            # a new buffer per layer (the donated train state must not hold one twice)
            return v.replace(jnp.array(jnp.broadcast_to(w, v.shape), v.dtype, copy=True))
        return v

    return jax.tree.map(one, params, is_leaf=_is_variable)


def ramp_values(model: nnx.Module) -> np.ndarray | None:
    """Every layer's w (float32), or None when the model has no ramp."""
    leaves = jax.tree.leaves(nnx.state(model, Ramp))
    if not leaves:
        return None
    return np.concatenate([np.asarray(x, np.float32).reshape(-1) for x in leaves])


# ---------------------------------------------------------------------------- configs
def _refuse(problem: str, fix: str):
    raise ConfigError(f"retrofit: {problem}. Fix: {fix}.")


def check_source(source: ModelConfig, where: str = "the source") -> None:
    """Refuse a source that is not a standard-attention model."""
    if source.attention != "standard":
        _refuse(
            f"{where} is a {source.attention} model; a retrofit converts a standard-attention "
            f"model (a diffjax twin or a Hugging Face Llama)",
            "pass a standard model; a DIFF checkpoint is trained on with train.init_from alone",
        )
    if source.gate != "none":
        _refuse(
            f"{where} has an attention output gate (model.gate={source.gate!r}), which the "
            f"conversion does not carry over",
            "retrofit a model trained with model.gate=none",
        )


def retrofit_config(
    source: ModelConfig,
    attention: str,
    *,
    lambda_init: float | None = None,
    diff_norm: bool = True,
) -> ModelConfig:
    """The DIFF model a standard ``source`` becomes (``ramp=True``). V2: the source's heads,
    kv heads and width. V1: half the heads and kv heads (each DIFF head a pair of the source's),
    refused (with the fix) for odd counts or a head width other than ``d_model / num_heads``;
    its per-head norm's eps is the source's ``norm_eps`` (so that it exports to DiffLlama)."""
    check_source(source)
    if attention == "diff_v2":
        if lambda_init is not None or not diff_norm:
            _refuse(
                "model.lambda_init and model.diff_norm=false are DIFF V1 settings, but "
                "model.attention=diff_v2",
                "leave them unset for a V2 retrofit, or set model.attention=diff_v1",
            )
        return source.replace(
            attention="diff_v2",
            num_kv_heads=source.kv_heads,
            head_dim=source.resolved_head_dim,
            ramp=True,
        )
    if attention != "diff_v1":
        _refuse(
            f"model.attention={attention!r} is not a DIFF kind",
            "set model.attention=diff_v2 (starts exactly at the source) or diff_v1",
        )
    h, hkv, d = source.num_heads, source.kv_heads, source.resolved_head_dim
    if h % 2 or hkv % 2:
        _refuse(
            f"DIFF V1 pairs the source's heads, but it has {h} heads and {hkv} kv heads (both "
            f"must be even)",
            "retrofit to model.attention=diff_v2, which keeps every head",
        )
    if d * h != source.d_model:
        _refuse(
            f"a DIFF V1 head of this width has maps of d_model / num_heads = "
            f"{source.d_model // h} channels, but the source's heads are {d} wide",
            "retrofit to model.attention=diff_v2, which takes any head width",
        )
    return source.replace(
        attention="diff_v1",
        num_heads=h // 2,
        num_kv_heads=None if source.num_kv_heads is None else hkv // 2,
        head_dim=None,
        lambda_init=lambda_init,
        diff_norm=diff_norm,
        diff_norm_eps=source.norm_eps,
        ramp=True,
    )


# ---------------------------------------------------------------------------- the weights
def v1_source_heads(num_heads: int, num_kv_heads: int) -> tuple[np.ndarray, np.ndarray]:
    """``(j1, j2)``: for each DIFF V1 head ``i`` of a retrofit, the source query head that
    becomes its first map (reads the source kv head ``2g``, V1's K1) and the one whose map is
    dropped (reads kv head ``2g + 1``, K2); see the module."""
    n_rep = num_heads // num_kv_heads
    i = np.arange(num_heads // 2)
    g, r = i // n_rep, i % n_rep
    return 2 * g * n_rep + r, (2 * g + 1) * n_rep + r


def v2_attention(src: dict, fresh: dict, cfg: ModelConfig, rcfg: RetrofitConfig) -> dict:
    """One layer's DIFF V2 attention parameters (numpy pure dicts) from the source's ``src``;
    ``fresh``: the target layer's fresh init (for ``random`` and the default ``lambda_proj``)."""
    q = src["q_proj"]["kernel"]
    n_in, h, d = q.shape[0], cfg.num_heads, cfg.resolved_head_dim
    q1 = q.reshape(n_in, h, d)
    second = {
        "zero": np.zeros_like(q1),
        "mirror": q1,
        "random": fresh["q_proj"]["kernel"].reshape(n_in, h, 2, d)[:, :, 1],
    }[rcfg.second]
    out = dict(fresh)
    out["q_proj"] = {"kernel": np.stack([q1, second], axis=2).reshape(n_in, 2 * h * d)}
    for name in ("k_proj", "v_proj", "out_proj"):
        out[name] = {"kernel": src[name]["kernel"]}
    if rcfg.lambda_proj == "zero":
        out["lambda_proj"] = {"kernel": np.zeros_like(fresh["lambda_proj"]["kernel"])}
    return out


def v1_attention(
    src: dict, fresh: dict, source: ModelConfig, cfg: ModelConfig, rcfg: RetrofitConfig
) -> dict:
    """One layer's DIFF V1 attention parameters from the source's (see :func:`v2_attention`)."""
    q, k = src["q_proj"]["kernel"], src["k_proj"]["kernel"]
    o = src["out_proj"]["kernel"]
    n_in, h, d = q.shape[0], cfg.num_heads, cfg.resolved_head_dim
    j1, j2 = v1_source_heads(source.num_heads, source.kv_heads)
    q_heads = q.reshape(n_in, source.num_heads, d)
    q1 = q_heads[:, j1]
    second = {
        "zero": np.zeros_like(q1),
        "mirror": q1,
        "random": fresh["q_proj"]["kernel"].reshape(n_in, h, 2, d)[:, :, 1],
    }[rcfg.second]
    k_heads = k.reshape(n_in, cfg.kv_heads, 2, d)
    if rcfg.second == "mirror":  # K2 := K1
        k_heads = np.stack([k_heads[:, :, 0], k_heads[:, :, 0]], axis=2)
    o_heads = o.reshape(source.num_heads, d, o.shape[-1])
    out = dict(fresh)
    out["q_proj"] = {"kernel": np.stack([q1, second], axis=2).reshape(n_in, 2 * h * d)}
    out["k_proj"] = {"kernel": k_heads.reshape(n_in, -1)}
    out["v_proj"] = {"kernel": src["v_proj"]["kernel"]}  # group g's value: [v_2g, v_2g+1]
    out["out_proj"] = {
        "kernel": np.stack([o_heads[j1], o_heads[j2]], axis=1).reshape(2 * h * d, -1)
    }
    return out


def _pure(model: nnx.Module) -> dict:
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def retrofit_model(
    source: TransformerLM,
    attention: str,
    rcfg: RetrofitConfig | None = None,
    *,
    lambda_init: float | None = None,
    diff_norm: bool = True,
    seed: int = 0,
) -> TransformerLM:
    """``source`` (a standard :class:`TransformerLM`, unrolled or scanned) as a DIFF model of
    ``attention`` with its ramp at ``w(0)`` (0 unless ``rcfg.warmup_steps == 0``), in the
    source's layout. What is not copied (the negative maps with ``random``, V1's lambda
    vectors, V2's ``lambda_proj``) is a fresh init from ``seed``."""
    rcfg = rcfg or RetrofitConfig()
    cfg = retrofit_config(source.config, attention, lambda_init=lambda_init, diff_norm=diff_norm)
    target = TransformerLM(cfg, rngs=nnx.Rngs(seed))  # in the source's layout
    src, new = _pure(source), _pure(target)
    # host arrays, one entry per layer (numpy: no device work, whatever mesh is in force)
    n, scanned = cfg.num_layers, cfg.scan_layers
    src_layers, new_layers = (
        [jax.tree.map(lambda a, i=i: a[i], tree["layers"]) for i in range(n)]
        if scanned
        else [tree["layers"][i] for i in range(n)]
        for tree in (src, new)
    )
    for key in src:
        if key != "layers":
            new[key] = src[key]
    for layer, fresh in zip(src_layers, new_layers):
        for key in layer:
            if key != "attn":
                fresh[key] = layer[key]
        if attention == "diff_v2":
            attn = v2_attention(layer["attn"], fresh["attn"], cfg, rcfg)
        else:
            attn = v1_attention(layer["attn"], fresh["attn"], source.config, cfg, rcfg)
        attn["ramp"] = np.asarray(rcfg.schedule(0), np.float32)
        fresh["attn"] = attn
    if scanned:
        new["layers"] = jax.tree.map(lambda *xs: np.stack(xs), *new_layers)
    else:
        new["layers"] = dict(enumerate(new_layers))
    nnx.update(target, jax.tree.map(jnp.asarray, new))
    return target


def logit_gap(source: TransformerLM, model: TransformerLM, tokens: np.ndarray) -> dict[str, Any]:
    """How far ``model``'s logits are from ``source``'s on ``tokens`` ``[B, T]``: the largest
    absolute and relative difference and the two losses of next-token prediction."""
    tokens = jnp.asarray(tokens)
    a, b = np.asarray(source(tokens)), np.asarray(model(tokens))

    def loss(logits):
        logp = jax.nn.log_softmax(jnp.asarray(logits[:, :-1]), axis=-1)
        picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)
        return float(-jnp.mean(picked))

    scale = float(np.max(np.abs(a))) or 1.0
    diff = float(np.max(np.abs(a - b)))
    return {
        "max_abs": diff,
        "max_rel": diff / scale,
        "source_loss": loss(a),
        "retrofit_loss": loss(b),
        "finite": bool(np.all(np.isfinite(b))),
        "exact": math.isclose(diff, 0.0, abs_tol=1e-5 * scale),
    }
