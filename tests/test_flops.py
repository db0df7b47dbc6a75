"""diffjax.infra.flops: the FLOP formula against what the model computes, the peak table, MFU.

Two checks of the formula, both from abstract shapes (nothing is run, nothing allocated):

- exact: the matmuls of the traced forward pass and train step (every ``dot_general`` of the
  jaxpr, nested jaxprs included, ``2 * output size * contracted size`` FLOPs) equal the formula
  with full (un-halved) attention maps, which is what the XLA path multiplies, and the train
  step's are exactly 3x the forward's;
- XLA's own count (``compiled.cost_analysis()["flops"]``), which adds the elementwise work, is
  within a few percent above the formula, for the whole forward and train step and for the
  attention term alone (the difference between two sequence lengths at equal token counts).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.extend import core as jcore

from diffjax.infra import flops
from diffjax.config import ModelConfig, twin
from diffjax.nn.model import TransformerLM
from diffjax.train.step import weighted_cross_entropy

# Small, but with head widths of 32-64 so that the elementwise work XLA also counts stays a
# few percent of the matmuls (a softmax map element costs ~10 elementwise FLOPs against
# 2 * (d_qk + d_v) >= 128 in the two products).
BASE = dict(vocab_size=512, d_model=256, num_layers=2, max_seq_len=512, attention_impl="xla")
CONFIGS = {
    "v1": ModelConfig(**BASE, num_heads=2, attention="diff_v1"),  # d = 64
    "v1_gqa": ModelConfig(**BASE, num_heads=4, num_kv_heads=2, attention="diff_v1"),  # d = 32
    "v2": ModelConfig(**BASE, num_heads=4, attention="diff_v2"),  # d = 64
    "v2_gqa": ModelConfig(**BASE, num_heads=4, num_kv_heads=2, attention="diff_v2"),
    "standard": ModelConfig(**BASE, num_heads=4, attention="standard"),
    "standard_gqa": ModelConfig(**BASE, num_heads=4, num_kv_heads=1, attention="standard"),
    # the other layouts: scanned layers (the matmuls inside a scan), tied embeddings (the
    # head is the embedding table), DIFF V1 without its per-head norm, a non-default FFN width
    "v1_scan_tied": ModelConfig(
        **BASE, num_heads=2, attention="diff_v1", scan_layers=True, tie_embeddings=True
    ),
    "v2_head_dim_ffn": ModelConfig(
        **BASE, num_heads=2, head_dim=48, ffn_dim=320, attention="diff_v2"
    ),
    # gated attention's output gate: its projection, per head or per output channel
    "v1_gate_elementwise": ModelConfig(
        **BASE, num_heads=2, attention="diff_v1", gate="elementwise"
    ),
    "standard_gate_headwise": ModelConfig(
        **BASE, num_heads=4, attention="standard", gate="headwise"
    ),
}
for _name in ("v1", "v1_gqa", "v2", "v2_gqa"):
    CONFIGS[f"{_name}_twin"] = twin(CONFIGS[_name])


def _subjaxprs(eqn):
    for value in eqn.params.values():
        for x in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(x, jcore.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jcore.Jaxpr):
                yield x


def matmul_flops(jaxpr) -> int:
    """2 x multiply-adds of every ``dot_general`` in ``jaxpr`` and its nested jaxprs (a scan's
    body counted ``length`` times)."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contracting, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += (
                2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in contracting)
            )
        times = eqn.params["length"] if eqn.primitive.name == "scan" else 1
        total += times * sum(matmul_flops(sub) for sub in _subjaxprs(eqn))
    return total


def _steps(cfg: ModelConfig, batch: int, seq: int):
    """``((forward, args), (train step, args))`` on abstract parameters and inputs: the model's
    forward pass, and value_and_grad of the training loss (the weighted cross-entropy of
    diffjax.train.loop). The non-parameter state (DIFF V1's lambda_init) is a constant of the
    function, as the train loop binds it; ``copy=True``: scanned layers refuse variables shared
    with another trace level."""
    model = TransformerLM(cfg, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    data = {
        "inputs": tokens,
        "targets": tokens,
        "weights": jax.ShapeDtypeStruct((batch, seq), jnp.float32),
    }

    def forward(params, tokens):
        return nnx.merge(graphdef, params, rest, copy=True)(tokens)

    def loss(params, data):
        logits = forward(params, data["inputs"])
        total, weight = weighted_cross_entropy(logits, data["targets"], data["weights"])
        return total / weight

    def train(params, data):
        return jax.value_and_grad(loss)(params, data)

    return (forward, (params, tokens)), (train, (params, data))


def xla_flops(fn, args) -> float:
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per computation
        cost = cost[0]
    return float(cost["flops"])


# ---------------------------------------------------------------------------- the formula
@pytest.mark.parametrize("name", list(CONFIGS))
def test_formula_is_the_traced_matmuls_exactly(name):
    """Every matmul of the forward pass and of the train step is counted, and nothing else:
    any wrong or missing term (a V2 query head, lambda_proj's D x h, a 2d-wide value, the GQA
    widths, the head) changes the count."""
    cfg, batch, seq = CONFIGS[name], 2, 64
    (forward, fargs), (train, targs) = _steps(cfg, batch, seq)
    tokens = batch * seq
    fwd = matmul_flops(jax.make_jaxpr(forward)(*fargs).jaxpr)
    assert fwd == flops.forward_flops_per_token(cfg, seq, causal=False) * tokens
    trained = matmul_flops(jax.make_jaxpr(train)(*targs).jaxpr)
    assert trained == 3 * fwd
    assert trained == flops.train_flops_per_token(cfg, seq, causal=False) * tokens


def test_terms_by_hand():
    """The breakdown of one V1 config, its twin and a V2 config, term by term."""
    D, L, F, V, T = 256, 2, 704, 512, 128  # resolved ffn: 8/3 * 256 = 682 -> 704
    v1 = CONFIGS["v1_gqa"]  # h = 4 DIFF heads, h_kv = 2, d = 32
    h, hkv, d = 4, 2, 32
    b = flops.flops_breakdown(v1, T)
    # q: D -> 2h d; k: D -> 2 h_kv d; v: D -> h_kv 2d; out: h 2d -> D
    assert b.projections == L * 2 * D * (2 * h * d + 2 * hkv * d + hkv * 2 * d + h * 2 * d)
    # two maps of width d and one value product 2d wide per DIFF head, causal: T/2 keys
    assert b.attention == L * 2 * (T / 2) * (2 * h * d + h * 2 * d)
    assert b.ffn == L * 3 * 2 * D * F and b.head == 2 * D * V
    assert flops.flops_breakdown(v1, T, causal=False).attention == 2 * b.attention
    # V1 costs what its twin (2h heads of width d, 2h_kv kv heads) costs, term by term
    assert flops.flops_breakdown(twin(v1), T) == b
    v2 = CONFIGS["v2_gqa"]  # h = 4, h_kv = 2, d = 64
    h, hkv, d = 4, 2, 64
    b2, tw = flops.flops_breakdown(v2, T), flops.flops_breakdown(twin(v2), T)
    # V2: 2h query heads, lambda_proj D -> h; maps of 2h heads, value products of h heads
    assert b2.projections == L * 2 * D * (2 * h * d + hkv * d + hkv * d + h * d + h)
    assert b2.attention == L * 2 * (T / 2) * (2 * h * d + h * d)
    assert b2.projections - tw.projections == L * 2 * D * (h * d + h)
    assert b2.attention == 1.5 * tw.attention
    assert b2.ffn == tw.ffn and b2.head == tw.head
    assert (
        flops.train_flops_per_token(v2, T)
        == 3 * b2.total
        == 3 * flops.forward_flops_per_token(v2, T)
    )
    assert b2.to_dict()["total"] == b2.total
    with pytest.raises(ValueError, match="seq_len"):
        flops.flops_breakdown(v2, 0)


# ---------------------------------------------------------------------------- XLA's count
# XLA counts the matmuls (the same 2 FLOPs per multiply-add) plus about one FLOP per element
# of every elementwise op and reduction: norms, rotary, SiLU, softmax, the mask, the loss.
# Measured on these configs: forward 1.008-1.014x the formula, train step 1.008-1.014x 3x the
# formula. So it must be at least the formula (it counts every matmul) and at most 3% above;
# a missing V2 query projection is 6% of the forward, a second value product per DIFF V1 head
# 7%, so a wrong formula fails.
XLA_TOTAL_SLACK = 0.03
# The attention term alone (below): the elementwise work on the maps (scale, mask, max,
# subtract, exp, sum, divide, and DIFF's A1 - lambda A2) is ~10-20 FLOPs per map element against
# 2 * (d_qk + d_v) in the two products, 128-256 here: measured 1.03-1.06x. A V1 formula with
# two value products per DIFF head would read 0.69x, a V2 one with value products for all 2h
# query heads 0.78x.
XLA_ATTENTION_SLACK = 0.10


@pytest.mark.parametrize("name", ["v1", "v2_gqa", "standard_gqa"])
def test_formula_against_xla_cost_analysis(name):
    cfg, batch, seq = CONFIGS[name], 2, 128
    (forward, fargs), (train, targs) = _steps(cfg, batch, seq)
    per_token = flops.forward_flops_per_token(cfg, seq, causal=False)
    fwd = xla_flops(forward, fargs) / (batch * seq)
    assert 1.0 <= fwd / per_token <= 1 + XLA_TOTAL_SLACK, fwd / per_token
    trained = xla_flops(train, targs) / (batch * seq)
    ratio = trained / flops.train_flops_per_token(cfg, seq, causal=False)
    assert 1.0 <= ratio <= 1 + XLA_TOTAL_SLACK, ratio


@pytest.mark.parametrize("name", ["v1", "v2", "v1_twin"])
def test_attention_term_against_xla(name):
    """At one token count, the forward at T=512 minus the forward at T=128: everything per
    token cancels, what is left is the attention maps (full: XLA multiplies the masked ones)."""
    cfg = CONFIGS[name]
    (long, largs), _ = _steps(cfg, 1, 512)
    (short, sargs), _ = _steps(cfg, 4, 128)
    measured = xla_flops(long, largs) - xla_flops(short, sargs)
    a = flops.flops_breakdown(cfg, 512, causal=False).attention
    b = flops.flops_breakdown(cfg, 128, causal=False).attention
    ratio = measured / (512 * (a - b))
    assert 1.0 <= ratio <= 1 + XLA_ATTENTION_SLACK, ratio


# ---------------------------------------------------------------------------- peaks and MFU
@pytest.mark.parametrize(
    "kind, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA H200 NVL", 835.0),
        ("NVIDIA GH200 480GB", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA A100-PCIE-40GB", 312.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA L40S", 362.0),  # not taken for an L4
        ("TPU v4", 275.0),
        ("TPU v5 lite", 197.0),  # v5e: not taken for v5p
        ("TPU v5e", 197.0),
        ("TPU v5", 459.0),  # v5p reports "TPU v5"
        ("TPU v5p", 459.0),
        ("TPU v6 lite", 918.0),  # v6e
        ("cpu", None),
        ("TPU v4 lite", None),  # v4i: not a v4
        ("TPU v5 lite extra", None),
        ("Some GPU", None),
        ("", None),
    ],
)
def test_peak_by_device_kind(kind, peak):
    assert flops.peak_tflops(kind) == peak


def test_peak_override_mfu_and_cpu():
    cpu_kind = jax.devices("cpu")[0].device_kind
    assert flops.peak_tflops(cpu_kind) is None
    assert flops.peak_tflops(cpu_kind, 100.0) == 100.0
    assert flops.peak_tflops("NVIDIA H100 80GB HBM3", 500) == 500.0  # the override wins
    with pytest.raises(ValueError, match="must be > 0"):
        flops.peak_tflops("cpu", 0.0)
    assert flops.mfu(494.5, 989.0) == pytest.approx(0.5)
    assert flops.mfu(10.0, None) is None and flops.mfu(None, 989.0) is None
    assert flops.mfu(10.0, 0.0) is None
    assert set(flops.PEAK_TFLOPS.values()) >= {989.0, 312.0, 121.0, 197.0, 459.0, 918.0}


def test_tflops_per_device():
    cfg = CONFIGS["v1"]
    per_token = flops.train_flops_per_token(cfg, 256)
    assert flops.tflops_per_device(cfg, 256, 1e6, 4) == pytest.approx(per_token * 1e6 / 4 / 1e12)
    assert flops.tflops_per_device(cfg, 256, None) is None
    assert flops.tflops_per_device(cfg, 256, float("nan")) is None
    assert flops.tflops_per_device(cfg, 256, 0.0) is None
