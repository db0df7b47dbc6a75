"""Model FLOPs per token (forward, and forward plus backward) for the three attention kinds,
the accelerators' peak dense bf16 TFLOP/s, and MFU (model FLOPs utilisation).

The count is of the matrix multiplications the model computes (2 FLOPs per multiply-add), from
the real shapes of :mod:`diffjax.nn.attention` and :mod:`diffjax.nn.model`. Per token and per layer,
with D = ``d_model``, h = ``num_heads``, h_kv = ``kv_heads``, d = ``resolved_head_dim``,
F = ``resolved_ffn_dim``, T = the sequence length:

======================  ===================  =====================  ===================
term                    standard             DIFF V1                DIFF V2
======================  ===================  =====================  ===================
q_proj                  2 D h d              2 D (2h d) = 2 D D     2 D (2h d)
k_proj                  2 D h_kv d           2 D (2h_kv d)          2 D h_kv d
v_proj                  2 D h_kv d           2 D (h_kv 2d)          2 D h_kv d
out_proj                2 (h d) D            2 (h 2d) D = 2 D D     2 (h d) D
lambda_proj             -                    -                      2 D h
Q K^T maps              2 T' h d             2 T' (2h) d            2 T' (2h) d
A V products            2 T' h d             2 T' h (2d)            2 T' h d
SwiGLU (w1, w3, w2)     3 * 2 D F            3 * 2 D F              3 * 2 D F
======================  ===================  =====================  ===================

where T' = T / 2 for causal attention (T with ``causal=False``), plus the output head,
``2 D vocab`` per token (the same with tied embeddings: the logits are a
matmul with the embedding table); the embedding lookup is a gather (no FLOPs).

- Attention: DIFF V1 has two maps per DIFF head (Q1 K1^T and Q2 K2^T, width d) and one value
  product of width 2d on the differential map ``(A1 - lambda A2) V`` (lambda is constant along
  a map row, so it is one product: :func:`diffjax.kernels.reference.differential_attention`).
  DIFF V2 has the maps of its 2h query heads (width d) and one value product per output head,
  on ``A_{2i} - lambda_i A_{2i+1}``. So V1's attention costs what its twin's does (2h maps of
  width d, 2h value products of width d), and V2's is 1.5x its twin's.
- Causal maps are halved: a query sees on average about T/2 keys (the convention of
  MaxText's and FlashAttention's counts; PaLM's and Megatron's count the full maps).
  ``causal=False`` gives the full maps, which is what XLA's masked attention multiplies.
- Gated attention's output gate (``ModelConfig.gate``) adds its projection, ``2 D h``
  (headwise) or ``2 D h dv`` (elementwise, ``dv`` a head's output width) per token and layer,
  to the projections; its sigmoid and product are elementwise.
- Not counted: elementwise work (norms, rotary, softmax, SiLU, the lambda arithmetic, the
  gate's sigmoid, the loss) and DIFF V1's lambda, ``exp(lq1 . lk1) - exp(lq2 . lk2)``, which is per layer
  and not per token. XLA's own count, which has them, is 1-1.5% above the formula at
  d_model 256 (``tests/test_flops.py``), less at larger widths.
- Training: the backward pass computes two matmuls for each forward one (the gradient with
  respect to the input and to the weight; for the attention maps, with respect to both
  operands), so a trained token costs 3x the forward. Rematerialization (``ModelConfig.remat``)
  recomputes forward matmuls in the backward pass: that is hardware FLOPs, not model FLOPs,
  and is left out (as in PaLM's definition of MFU), and so is the fused kernels' extra work
  (the Pallas forward takes both value products of a DIFF pair, A1 V and A2 V, and its backward
  recomputes the maps).

MFU = achieved model TFLOP/s per device / the device's peak dense bf16 TFLOP/s
(:data:`PEAK_TFLOPS`), whatever the compute dtype (a float32 run is measured against the bf16
peak too).

This module imports nothing from diffjax but :mod:`diffjax.config`.
"""

from __future__ import annotations

import dataclasses
import re

from diffjax.config import ModelConfig

# ---------------------------------------------------------------------------- the formula


@dataclasses.dataclass(frozen=True)
class FlopsBreakdown:
    """Forward FLOPs per token by part, summed over the layers (the head once)."""

    projections: float  # q/k/v/out projections (and DIFF V2's lambda_proj, a gate's gate_proj)
    attention: float  # the Q K^T maps and the value products
    ffn: float  # the SwiGLU FFN's three matrices
    head: float  # the output head (vocab logits)

    @property
    def total(self) -> float:
        return self.projections + self.attention + self.ffn + self.head

    def to_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "total": self.total}


def _layer_widths(cfg: ModelConfig) -> tuple[int, ...]:
    """One layer's widths, per token: ``(q_proj, k_proj, v_proj, out_proj input, lambda_proj,
    maps, values)``; ``maps`` is the sum of the head widths of the Q K^T maps, ``values`` the sum
    of the value widths of the value products."""
    h, hkv, d = cfg.num_heads, cfg.kv_heads, cfg.resolved_head_dim
    if cfg.attention == "standard":
        return h * d, hkv * d, hkv * d, h * d, 0, h * d, h * d
    if cfg.attention == "diff_v1":
        # 2h raw q heads and 2h_kv raw k heads of width d; h_kv values 2d wide; per DIFF head
        # two maps of width d and one value product 2d wide
        return 2 * h * d, 2 * hkv * d, hkv * 2 * d, h * 2 * d, 0, 2 * h * d, h * 2 * d
    if cfg.attention == "diff_v2":
        # 2h query heads over h_kv keys/values of width d; lambda_proj D -> h; the maps of the
        # 2h query heads and one value product per output head (width d)
        return 2 * h * d, hkv * d, hkv * d, h * d, h, 2 * h * d, h * d
    raise ValueError(f"unknown attention kind {cfg.attention!r}")


def flops_breakdown(cfg: ModelConfig, seq_len: int, *, causal: bool = True) -> FlopsBreakdown:
    """Forward FLOPs per token of ``cfg`` at sequence length ``seq_len``, by part (see the
    module doc for every term). ``causal=False``: the full attention maps."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"flops_breakdown takes a ModelConfig, got {type(cfg).__name__}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    D, L = cfg.d_model, cfg.num_layers
    q, k, v, o, lam, qk, av = _layer_widths(cfg)
    # gated attention's gate_proj: D -> one value per output head, or per output channel
    gate = {"none": 0, "headwise": cfg.num_heads, "elementwise": o}[cfg.gate]
    keys = seq_len / 2 if causal else seq_len  # keys a query sees (on average)
    return FlopsBreakdown(
        projections=float(L * 2 * D * (q + k + v + o + lam + gate)),
        attention=float(L * 2 * keys * (qk + av)),
        ffn=float(L * 3 * 2 * D * cfg.resolved_ffn_dim),
        head=float(2 * D * cfg.vocab_size),
    )


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, *, causal: bool = True) -> float:
    """Model FLOPs of the forward pass per token (:func:`flops_breakdown`'s total)."""
    return flops_breakdown(cfg, seq_len, causal=causal).total


def train_flops_per_token(cfg: ModelConfig, seq_len: int, *, causal: bool = True) -> float:
    """Model FLOPs per trained token: forward plus backward, 3x the forward's matmuls (see the
    module doc). Multiply by ``batch * seq_len`` for a step."""
    return 3.0 * forward_flops_per_token(cfg, seq_len, causal=causal)


def tflops_per_device(
    cfg: ModelConfig, seq_len: int, tokens_per_s: float | None, num_devices: int = 1
) -> float | None:
    """Achieved model TFLOP/s per device of training ``cfg`` at ``tokens_per_s`` (global, over
    ``num_devices`` devices); None when ``tokens_per_s`` is None or not a positive number."""
    if tokens_per_s is None or not tokens_per_s > 0 or num_devices < 1:
        return None
    return train_flops_per_token(cfg, seq_len) * tokens_per_s / num_devices / 1e12


# ---------------------------------------------------------------------------- peaks
# Dense (no structured sparsity) bf16 peak TFLOP/s per JAX device, by device kind. Sources:
# NVIDIA's datasheets (H100 SXM 989 / PCIe 756 / NVL 835; H200 SXM 989 / NVL 835; GH200 989;
# A100 312 (SXM and PCIe); L4 121; L40S 362; B200 2250: the datasheets' "with sparsity" figures
# halved) and Google Cloud's TPU system-architecture pages (per chip: v4 275, v5e 197,
# v5p 459, v6e 918; v4, v5p and later are one JAX device per chip (megacore), v5e and v6e
# have one TensorCore per chip).
PEAK_TFLOPS: dict[str, float] = {
    "H100 SXM": 989.0,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H200": 989.0,
    "H200 NVL": 835.0,
    "GH200": 989.0,
    "A100": 312.0,
    "L4": 121.0,
    "L40S": 362.0,
    "B200": 2250.0,
    "TPU v4": 275.0,
    "TPU v5e": 197.0,
    "TPU v5p": 459.0,
    "TPU v6e": 918.0,
}

# ``jax.Device.device_kind`` (lower-cased, spaces collapsed) -> PEAK_TFLOPS key, first match
# wins: the specific patterns before the general ones. Device kinds seen: "NVIDIA H100 80GB
# HBM3" (SXM), "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA H200 NVL",
# "NVIDIA GH200 480GB", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA L4",
# "NVIDIA L40S", "NVIDIA B200"; TPUs: v4 "TPU v4", v5e "TPU v5 lite", v5p "TPU v5" (not
# "v5p"), v6e "TPU v6 lite". A TPU pattern matches the whole kind, so "TPU v5 lite" is never
# taken for v5p, nor "TPU v4 lite" (v4i) for v4.
_KIND_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"tpu v5 ?lite|tpu v5e", "TPU v5e"),
    (r"tpu v6 ?lite|tpu v6e", "TPU v6e"),
    (r"tpu v5p?", "TPU v5p"),
    (r"tpu v4", "TPU v4"),
    (r".*\bgh200\b.*", "GH200"),
    (r".*\bh100\b.*\bpcie\b.*", "H100 PCIe"),
    (r".*\bh100\b.*\bnvl\b.*", "H100 NVL"),
    (r".*\bh100\b.*", "H100 SXM"),
    (r".*\bh200\b.*\bnvl\b.*", "H200 NVL"),
    (r".*\bh200\b.*", "H200"),
    (r".*\ba100\b.*", "A100"),
    (r".*\bl40s\b.*", "L40S"),
    (r".*\bl4\b.*", "L4"),
    (r".*\bb200\b.*", "B200"),
)


def device_family(device_kind: str) -> str | None:
    """The :data:`PEAK_TFLOPS` key of a ``jax.Device.device_kind``, or None when unknown."""
    kind = " ".join(str(device_kind).lower().replace("-", " ").replace("_", " ").split())
    for pattern, key in _KIND_PATTERNS:
        if re.fullmatch(pattern, kind):
            return key
    return None


def peak_tflops(device_kind: str, override: float | None = None) -> float | None:
    """The peak dense bf16 TFLOP/s of one device of ``device_kind``: ``override`` when given
    (``TrainConfig.peak_tflops``), else :data:`PEAK_TFLOPS`'s; None for a CPU or a kind not in
    the table."""
    if override is not None:
        if not override > 0:
            raise ValueError(f"peak_tflops override must be > 0, got {override}")
        return float(override)
    key = device_family(device_kind)
    return None if key is None else PEAK_TFLOPS[key]


def mfu(tflops_per_device: float | None, peak: float | None) -> float | None:
    """Model FLOPs utilisation: ``tflops_per_device / peak`` (a fraction), None when either is
    None or the peak is not positive."""
    if tflops_per_device is None or peak is None or not peak > 0:
        return None
    return float(tflops_per_device) / float(peak)


__all__ = [
    "PEAK_TFLOPS",
    "FlopsBreakdown",
    "device_family",
    "flops_breakdown",
    "forward_flops_per_token",
    "mfu",
    "peak_tflops",
    "tflops_per_device",
    "train_flops_per_token",
]
