"""The TPU Pallas kernels (``diffjax/kernels/tpu.py``) in interpret mode on the CPU.

Values and gradients (q1, k1, q2, k2, v and lambda, through ``jax.vjp`` with a random cotangent)
are checked against the plain-JAX references ``reference.differential_attention`` and
``reference.dot_product_attention`` and their autodiff. Shapes are small and blocks tiny (8-32) so
every case has several query and key blocks, partial blocks and wholly padded blocks.

Inputs, the compiled value-and-gradients call and the tolerance check are
``tests/kernel_cases.py``'s, shared with ``test_kernels_gpu.py``.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu
from kernel_cases import assert_close, check_partials, compile_fast, make_inputs, value_and_grads
from kernel_cases import check_logit_max
from kernel_cases import check_differential as _check_differential
from kernel_cases import check_standard as _check_standard

from diffjax.kernels import tpu

# (atol, rtol) per dtype: max |kernel - reference| <= rtol * max |reference| per array (atol 0).
# Observed worst cases over the grids: float32 ~1e-6, bfloat16 ~3e-3 (output) and ~1.2e-2
# (per-token d lambda), float16 ~5e-4.
TOL = {
    # same maths in float32, different summation order
    "float32": dict(value=(0.0, 2e-5), grad=(0.0, 2e-5)),
    # bf16 inputs, P cast to bf16 before P.V, bf16 output vs float32 reference
    "bfloat16": dict(value=(0.0, 2e-2), grad=(0.0, 4e-2)),
    # float16 runs through the kernels in float32; output rounding only
    "float16": dict(value=(0.0, 5e-3), grad=(0.0, 5e-3)),
}


def check_differential(case, *, causal, block_sizes, interpret=True, sm_scale=None):
    kernel = functools.partial(
        tpu.differential_flash_attention, block_sizes=block_sizes, interpret=interpret
    )
    return _check_differential(
        kernel, case, TOL[case["q1"].dtype.name], causal=causal, sm_scale=sm_scale
    )


def check_standard(case, *, causal, block_sizes):
    kernel = functools.partial(tpu.flash_attention, block_sizes=block_sizes, interpret=True)
    return _check_standard(kernel, case, TOL[case["q1"].dtype.name], causal=causal)


def blocks(q=16, k=16, q_dkv=None, k_dkv=None, q_dq=None, k_dq=None):
    return tpu.BlockSizes(
        block_q=q,
        block_k=k,
        block_q_dkv=q_dkv or q,
        block_k_dkv=k_dkv or k,
        block_q_dq=q_dq or q,
        block_k_dq=k_dq or k,
    )


# ============================================================================ explicit cases
@pytest.mark.parametrize(
    "kw, causal, bs",
    [
        # MHA, lengths not block multiples, V twice as wide (DIFF V1), scalar lambda.
        (dict(t=40, s=40, hq=2, hkv=2, dv=64), True, blocks(16, 16)),
        # GQA, T < S (causal offset), per-token lambda, mixed block sizes (wholly padded key blocks).
        (dict(b=2, t=24, s=40, hq=4, hkv=2, lam="token"), True, blocks(16, 16, 8, 32, 16, 8)),
        # MQA, T > S: the first queries see no key at all; separate query / key segment ids.
        (dict(t=40, s=24, hq=2, hkv=1, lam="token", seg="separate"), True, blocks(16, 8, 32, 16)),
        # Packed segments without the causal mask.
        (dict(t=32, s=32, hq=2, hkv=1, seg="shared", dv=64), False, blocks(8, 16)),
    ],
    ids=["mha-v1", "gqa-offset", "mqa-empty-rows", "segments-noncausal"],
)
def test_differential_matches_reference(kw, causal, bs):
    check_differential(make_inputs(0, **kw), causal=causal, block_sizes=bs)


def test_differential_sm_scale_and_default_blocks():
    """Head dim 128, a custom scale; default BlockSizes clamp to the short sequence."""
    check_differential(
        make_inputs(1, t=20, s=20, d=128, lam="token"), causal=True, block_sizes=None, sm_scale=0.3
    )


def test_differential_interpret_params():
    """The TPU interpreter (``pltpu.InterpretParams``: simulated DMAs, VMEM/SMEM scratch)."""
    case = make_inputs(2, t=16, s=16, hq=2, hkv=1, lam="scalar", seg="shared")
    check_differential(
        case, causal=True, block_sizes=blocks(8, 8, 8, 16), interpret=pltpu.InterpretParams()
    )


@pytest.mark.parametrize(
    "kw, causal",
    [
        (dict(b=2, t=40, s=40, hq=4, hkv=2, seg="shared"), True),
        (dict(t=24, s=40, hq=2, hkv=1, dtype="bfloat16"), False),
    ],
    ids=["gqa-segments", "mqa-bf16-noncausal"],
)
def test_flash_attention_matches_reference(kw, causal):
    check_standard(make_inputs(3, **kw), causal=causal, block_sizes=blocks(16, 16, 16, 8))


def _kernel_names(fn, *args) -> set[str]:
    return set(re.findall(r"(?:diff_)?flash_(?:fwd|dkv|dq)\w*", str(jax.make_jaxpr(fn)(*args))))


def test_shared_k_equals_copy():
    """``k2=None`` takes the one-K kernels (dK = dK1 + dK2) and agrees with passing a copy."""
    case = make_inputs(4, b=2, t=40, s=40, hq=4, hkv=2, lam="token")
    bs = blocks(16, 16, 16, 8)

    def shared(q1, k, q2, v, lam):
        return tpu.differential_flash_attention(
            q1, k, q2, None, v, lam, block_sizes=bs, interpret=True
        )

    def copied(q1, k, q2, v, lam):
        return tpu.differential_flash_attention(
            q1, k, q2, k + 0.0, v, lam, block_sizes=bs, interpret=True
        )

    args = tuple(case[n] for n in ("q1", "k1", "q2", "v", "lam"))

    def grad_names(fn):
        return _kernel_names(lambda *a: jax.vjp(fn, *a)[1](case["ct"]), *args)

    assert grad_names(shared) == {
        "diff_flash_fwd_shared_k",
        "diff_flash_dkv_shared_k",
        "diff_flash_dq_shared_k",
    }
    assert grad_names(copied) == {"diff_flash_fwd", "diff_flash_dkv", "diff_flash_dq"}
    out_s, grads_s = value_and_grads(shared, args, case["ct"])
    out_c, grads_c = value_and_grads(copied, args, case["ct"])
    assert_close("output", out_s, out_c, (0.0, 1e-6))
    for name, a, b in zip(("q1", "k", "q2", "v", "lam"), grads_s, grads_c):
        assert_close(f"d{name}", a, b, (0.0, 1e-5))


def test_fully_masked_rows_are_zero():
    """Queries that see no key (T > S under causal alignment, or a segment absent from the keys)
    output exactly 0 and get exactly zero, finite gradients."""
    b, t, s, hq = 1, 40, 24, 2
    case = make_inputs(5, b=b, t=t, s=s, hq=hq, hkv=1, lam="token")
    seg = np.zeros((b, t), np.int32)
    seg[:, -4:] = 7  # the last 4 queries are in a segment no key belongs to
    case["segment_ids"] = jnp.asarray(seg)
    case["kv_segment_ids"] = jnp.zeros((b, s), jnp.int32)
    out, grads = check_differential(case, causal=True, block_sizes=blocks(8, 16, 16, 8))
    empty = np.zeros(t, bool)
    empty[: t - s] = True  # query i sees key j iff j <= i + s - t
    empty[-4:] = True
    out = np.asarray(out)
    assert np.all(out[:, empty] == 0.0) and np.all(np.abs(out[:, ~empty]).sum(-1) > 0)
    dq1, dq2, dlam = np.asarray(grads[0]), np.asarray(grads[2]), np.asarray(grads[5])
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(dq1[:, empty] == 0.0) and np.all(dq2[:, empty] == 0.0)
    assert np.all(dlam[:, empty] == 0.0)


def test_float16_runs():
    case = make_inputs(6, t=24, s=24, hq=2, hkv=1, dtype="float16", lam="token")
    out, grads = check_differential(case, causal=True, block_sizes=blocks(16, 8))
    assert out.dtype == jnp.float16 and grads[0].dtype == jnp.float16


def test_causal_skips_key_blocks_above_the_diagonal():
    """Tiles above the diagonal are not computed: a NaN in the last key's value reaches only the
    query block that may see it (a computed-but-masked tile would spread 0 * NaN = NaN)."""
    case = make_inputs(7, t=32, s=32, hq=1, hkv=1)
    v = case["v"].at[:, -1].set(jnp.nan)
    fn = compile_fast(
        lambda q1, k1, q2, k2, v: tpu.differential_flash_attention(
            q1, k1, q2, k2, v, 0.5, block_sizes=blocks(8, 8), interpret=True
        ),
        case["q1"],
        case["k1"],
        case["q2"],
        case["k2"],
        v,
    )
    out = np.asarray(fn(case["q1"], case["k1"], case["q2"], case["k2"], v))
    assert np.all(np.isfinite(out[:, :24])) and np.all(np.isnan(out[:, -1]))


# ============================================================================ logit maxes
@pytest.mark.parametrize(
    "kw, causal, bs, kind",
    [
        # V1: GQA, T > S under the causal mask (the first rows see no key), separate key
        # segments, padded query and key blocks.
        (dict(b=2, t=20, s=12, hq=4, hkv=2, dv=32, seg="separate"), True, blocks(8, 8), "v1"),
        # V2: the shared-key kernel, per-token lambda, packed segments.
        (dict(t=16, s=16, hq=2, hkv=1, lam="token", seg="shared"), True, blocks(8, 16), "v2"),
        # Standard, MQA, not causal.
        (dict(t=16, s=24, hq=2, hkv=1, seg="separate"), False, blocks(16, 8), "standard"),
    ],
    ids=["v1-gqa-empty-rows", "v2-shared-k", "standard-noncausal"],
)
def test_logit_max_is_the_forward_running_row_max(kw, causal, bs, kind):
    """``return_logit_max=True``: each map's largest visible logit per row (the forward's
    running max ``m``, lane-replicated in VMEM) equals numpy's, -inf for a row that sees no
    key (including one whose every tile is skipped); the output and every gradient are those
    of the call without it, bit for bit."""
    case = make_inputs(4, d=16, **kw)
    if case["kv_segment_ids"] is None:
        case["kv_segment_ids"] = case["segment_ids"]
    case["segment_ids"] = case["segment_ids"].at[:, 3].set(99)  # row 3: in no key's segment
    fn = tpu.flash_attention if kind == "standard" else tpu.differential_flash_attention
    attention = functools.partial(fn, block_sizes=bs, interpret=True)
    maxes = check_logit_max(
        attention, case, causal=causal, shared=kind == "v2", standard=kind == "standard"
    )
    assert np.all(np.isneginf(maxes[:, :, 3]))
    if kind == "v1":
        assert np.all(np.isneginf(maxes[:, :, :8]))  # T - S = 8 rows before the first key


def test_logit_max_adds_one_forward_output_per_map_and_nothing_else():
    """The option is one more output per map of the forward kernel (lane-replicated like the
    log-sum-exps); the backward kernels and their names are unchanged, and without it the
    call is exactly the call without the option (same jaxpr)."""
    case = make_inputs(0, t=16, s=16, hq=2, hkv=1, d=16)
    args = tuple(case[n] for n in ("q1", "k1", "q2", "v"))

    def jaxpr(**opt):
        def loss(q1, k, q2, v):
            res = tpu.differential_flash_attention(
                q1, k, q2, None, v, 0.5, block_sizes=blocks(8, 8), interpret=True, **opt
            )
            return jnp.sum((res[0] if opt.get("return_logit_max") else res) * case["ct"])

        return jax.make_jaxpr(jax.grad(loss, (0, 1, 2, 3)))(*args)

    def outputs(closed):
        calls = [e for e in closed.jaxpr.eqns if e.primitive.name == "pallas_call"]
        return [(e.params["name"], [v.aval for v in e.outvars]) for e in calls]

    plain, off, on = jaxpr(), jaxpr(return_logit_max=False), jaxpr(return_logit_max=True)
    assert str(off) == str(plain)
    names = ["diff_flash_fwd_shared_k", "diff_flash_dkv_shared_k", "diff_flash_dq_shared_k"]
    assert [n for n, _ in outputs(plain)] == names
    row = jax.core.ShapedArray((1, 2, 16, 128), jnp.float32)
    assert outputs(on)[0][1] == outputs(plain)[0][1] + [row, row]
    assert outputs(on)[1:] == outputs(plain)[1:]


# ============================================================================ hypothesis grids
@st.composite
def grid_cases(draw, large=False):
    kind = draw(st.sampled_from(["mha", "gqa", "mqa"]))
    hkv, hq = {
        "mha": (draw(st.sampled_from([1, 2])),) * 2,
        "gqa": (2, 4),
        "mqa": (1, draw(st.sampled_from([2, 4]))),
    }[kind]
    seg = draw(st.sampled_from([None, "shared", "separate"]))
    lengths = st.integers(24, 64) if large else st.integers(8, 40)
    t = draw(lengths)
    s = t if seg == "shared" else draw(lengths)
    d = draw(st.sampled_from([64, 128] if large else [32]))
    sizes = st.sampled_from([8, 16, 32])
    return dict(
        case=dict(
            b=draw(st.sampled_from([1, 2])),
            t=t,
            s=s,
            hq=hq,
            hkv=hkv,
            d=d,
            dv=d * draw(st.sampled_from([1, 2])),
            seg=seg,
            lam=draw(st.sampled_from(["scalar", "token"])),
            dtype=draw(st.sampled_from(["float32", "bfloat16"])),
        ),
        causal=draw(st.booleans()),
        blocks=tpu.BlockSizes(*(draw(sizes) for _ in range(6))),
        seed=draw(st.integers(0, 2**16)),
    )


_GRID = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@settings(max_examples=4, **_GRID)
@given(grid_cases())
def test_grid_differential(cfg):
    check_differential(
        make_inputs(cfg["seed"], **cfg["case"]), causal=cfg["causal"], block_sizes=cfg["blocks"]
    )


@settings(max_examples=2, **_GRID)
@given(grid_cases())
def test_grid_standard(cfg):
    check_standard(
        make_inputs(cfg["seed"], **cfg["case"]), causal=cfg["causal"], block_sizes=cfg["blocks"]
    )


@pytest.mark.exhaustive  # by default: test_grid_differential's cases
@settings(max_examples=5, **_GRID)
@given(grid_cases(large=True))
def test_grid_differential_large(cfg):
    check_differential(
        make_inputs(cfg["seed"] + 1, **cfg["case"]), causal=cfg["causal"], block_sizes=cfg["blocks"]
    )


# ============================================================================ errors and TPU lowering
@pytest.mark.parametrize(
    "kw",
    [
        dict(block_q=0),
        dict(block_k=-8),
        dict(block_q_dkv=16.0),
        dict(block_k_dq=True),
        dict(block_q_dq="128"),
    ],
)
def test_bad_block_sizes(kw):
    with pytest.raises(ValueError, match="BlockSizes"):
        tpu.BlockSizes(**kw)


def test_hardware_block_sizes_must_fill_lanes():
    case = make_inputs(8, t=300, s=300, hq=1, hkv=1)
    args = tuple(case[n] for n in ("q1", "k1", "q2", "k2", "v", "lam"))
    with pytest.raises(ValueError, match="multiple of 128"):
        tpu.differential_flash_attention(*args, block_sizes=blocks(64, 128), interpret=False)
    with pytest.raises(TypeError, match=r"block_sizes must be a diffjax\.kernels\.tpu\.BlockSizes"):
        tpu.differential_flash_attention(*args, block_sizes=(128, 128), interpret=True)


@pytest.mark.parametrize(
    "differential, shared_k, lam_kind, dtype, segments, causal",
    [
        (True, False, "token", jnp.bfloat16, True, True),
        (True, True, "scalar", jnp.float32, False, False),
        (False, False, None, jnp.bfloat16, True, True),
    ],
    ids=["diff-bf16-segments", "diff-shared-k-f32", "standard-bf16"],
)
def test_lowers_for_tpu(differential, shared_k, lam_kind, dtype, segments, causal):
    """Forward and backward lower to Mosaic for a TPU target with the default blocks
    (``jax.export`` runs the Pallas TPU lowering without a TPU)."""
    b, t, hq, hkv, d = 1, 300, 4, 2, 128
    sds = jax.ShapeDtypeStruct
    q, k = sds((b, t, hq, d), dtype), sds((b, t, hkv, d), dtype)
    v, ct = sds((b, t, hkv, 2 * d), dtype), sds((b, t, hq, 2 * d), dtype)
    lam = sds((b, t, hq), jnp.float32) if lam_kind == "token" else sds((), jnp.float32)
    seg = sds((b, t), jnp.int32) if segments else None

    def attn(q1, k1, q2, k2, v, lam, seg):
        if not differential:
            return tpu.flash_attention(q1, k1, v, causal=causal, segment_ids=seg)
        return tpu.differential_flash_attention(
            q1, k1, q2, None if shared_k else k2, v, lam, causal=causal, segment_ids=seg
        )

    def fwd_bwd(q1, k1, q2, k2, v, lam, seg, ct):
        out, vjp = jax.vjp(lambda *a: attn(*a, seg), q1, k1, q2, k2, v, lam)
        return out, vjp(ct)

    try:
        exported = jax.export.export(jax.jit(fwd_bwd), platforms=["tpu"])(
            q, k, q, k, v, lam, seg, ct
        )
    except ValueError as e:  # a lowering rule that needs the TPU generation cannot run here
        if "Unsupported TPU device kind" in str(e):
            pytest.skip(str(e))
        raise
    assert exported.mlir_module().count("tpu_custom_call") == 3  # fwd, dkv, dq


@pytest.mark.parametrize("kind", ["v1", "v2", "standard"])
def test_partials_over_key_blocks_merge_to_the_reference(kind):
    """The TPU kernels' ``flash_partials`` / ``flash_partial_grads`` (ring attention's blocks),
    interpreted: merged over two key blocks, the reference and its autodiff."""
    check_partials(tpu, kind, interpret=True)


def test_vmem_requests_name_each_kernel_call_and_collect_only_inside():
    """Each kernel call traced inside ``vmem_requests()`` reports its name, its VMEM estimate
    and the scoped limit it asks for (None: the default, for these small tiles); outside the
    block nothing is collected."""
    k = jax.random.split(jax.random.key(0), 3)
    q, kk, v = (jax.random.normal(x, (1, 32, 2, 16), jnp.float32) for x in k)

    def loss(q, kk, v):
        return tpu.flash_attention(q, kk, v, block_sizes=blocks(), interpret=True).sum()

    with tpu.vmem_requests() as calls:
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kk, v)
    assert len(calls) >= 3  # forward, dK/dV and dQ
    assert all(isinstance(c, tpu.VmemRequest) and c.estimate > 0 for c in calls)
    assert all(c.limit is None for c in calls) and len({c.kernel for c in calls}) >= 3
    jax.jit(loss).lower(q, kk, v)
    assert len(calls) >= 3 and tpu._REQUESTS is None
