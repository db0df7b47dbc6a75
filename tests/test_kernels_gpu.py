"""The Pallas (Triton-lowering) attention kernels: interpreted on CPU, compiled on a GPU.

Values and gradients (q1, k1, q2, k2, v, lam) against the plain-jnp references in
:mod:`diffjax.kernels.reference` and their autodiff, over a hypothesis grid of shapes, masks, GQA
layouts, lambda kinds and dtypes; plus the shared-key path, fully masked rows, float16, block-size
validation and a check that the kernels lower through the real Triton path (no GPU needed).
Inputs, the compiled value-and-gradients call and the tolerance check are
``tests/kernel_cases.py``'s, shared with ``test_kernels_tpu.py``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_cases import ON_GPU, assert_close, check_differential, check_standard, make_inputs
from kernel_cases import check_logit_max, check_partials, value_and_grads

from diffjax.kernels import gpu, reference

# Tolerances (atol, rtol): |kernel - reference| <= atol + rtol * max|reference|, per array.
# The reference is always float32 (16-bit inputs are upcast), so for 16-bit inputs these cover
# the kernels' rounding: probabilities and dS are rounded to 16 bits before the matmuls (as in
# flash attention) and outputs/grads are stored in 16 bits. Measured worst cases (relative to
# max|reference|): float32 ~1e-6, float16 ~1e-3, bfloat16 ~7e-3.
# d(lam) for a scalar lambda is a sum over every output element and can cancel to far below
# its terms, so its rtol multiplies the largest L1 norm of its terms, max sum |dO * O2|,
# instead (measured worst cases: float32 1e-7, float16 7e-5, bfloat16 6e-4).
F32_TOL = dict(value=(1e-5, 1e-5), grad=(1e-4, 1e-4), dlam=(1e-5, 1e-5))
F16_TOL = dict(value=(2e-3, 5e-3), grad=(5e-3, 1e-2), dlam=(1e-3, 1e-3))
BF16_TOL = dict(value=(1e-2, 2e-2), grad=(2e-2, 3e-2), dlam=(5e-3, 5e-3))
TOL = {"float32": F32_TOL, "float16": F16_TOL, "bfloat16": BF16_TOL}

# On a GPU the same tests run the compiled kernels (and the float32 reference at full matmul
# precision, not TF32); everywhere else the kernels are interpreted.
INTERPRET = not ON_GPU

SMALL = gpu.BlockSizes(16, 16, 16, 16, 16, 16)
MIXED = gpu.BlockSizes(
    block_q=32, block_k=16, block_q_dkv=16, block_k_dkv=32, block_q_dq=32, block_k_dq=16
)
BLOCKS = {"small": SMALL, "mixed": MIXED, "default": gpu.BlockSizes()}


@pytest.fixture(autouse=True)
def _fast_compiles():
    """XLA's optimisation passes dominate the cost of compiling interpret-mode kernels on CPU
    (about 3x); the numerics under test do not depend on them. On a GPU: full-precision float32
    matmuls for the reference instead."""
    if ON_GPU:
        with jax.default_matmul_precision("highest"):
            yield
        return
    name = "jax_disable_most_optimizations"
    try:
        old = getattr(jax.config, name)
    except AttributeError:  # option gone in this jax: run as is
        yield
        return
    jax.config.update(name, True)
    try:
        yield
    finally:
        jax.config.update(name, old)


# ---------------------------------------------------------------------------- helpers
def _check_diff(case, *, causal=True, block_sizes=SMALL, sm_scale=None, shared=False):
    kernel = functools.partial(
        gpu.differential_flash_attention, block_sizes=block_sizes, interpret=INTERPRET
    )
    return check_differential(
        kernel, case, TOL[case["q1"].dtype.name], causal=causal, sm_scale=sm_scale, shared=shared
    )


def _check_standard(case, *, causal, block_sizes=SMALL):
    kernel = functools.partial(gpu.flash_attention, block_sizes=block_sizes, interpret=INTERPRET)
    return check_standard(kernel, case, TOL[case["q1"].dtype.name], causal=causal)


# ---------------------------------------------------------------------------- grids
# Hypothesis tries the simplest example (the first value of every sampled_from) first, so each
# list starts with an interesting value: the first example is already a GQA, causal, segmented
# case with a non-block-multiple length and a 2x wide V.
HEADS = [(4, 2), (3, 1), (4, 1), (2, 2)]  # GQA, MQA with an odd group, MQA, MHA


@st.composite
def diff_cases(draw, lengths, heads, dims, dtypes=("float32", "bfloat16"), batches=(2, 1)):
    segmented = draw(st.sampled_from((True, False)))
    t = draw(st.sampled_from(lengths))
    s = draw(st.sampled_from(lengths))
    # segments with T != S need explicit key segment ids; test both spellings
    kv_explicit = segmented and (s != t or draw(st.booleans()))
    d = draw(st.sampled_from(dims))
    return dict(
        seed=draw(st.integers(0, 2**31 - 1)),
        b=draw(st.sampled_from(batches)),
        t=t,
        s=s,
        heads=draw(st.sampled_from(heads)),
        d=d,
        dv=d * draw(st.sampled_from((2, 1))),
        causal=draw(st.sampled_from((True, False))),
        segmented=segmented,
        kv_explicit=kv_explicit,
        lam_kind=draw(st.sampled_from(("token", "scalar"))),
        dtype=draw(st.sampled_from(dtypes)),
        blocks=draw(st.sampled_from(("mixed", "small", "default"))),
        scale=draw(st.sampled_from((None, 0.3))),
    )


def _run_case(c):
    hq, hkv = c["heads"]
    seg = ("separate" if c["kv_explicit"] else "shared") if c["segmented"] else None
    case = make_inputs(
        c["seed"],
        b=c["b"],
        t=c["t"],
        s=c["s"],
        hq=hq,
        hkv=hkv,
        d=c["d"],
        dv=c["dv"],
        dtype=c["dtype"],
        lam=c["lam_kind"],
        seg=seg,
    )
    _check_diff(case, causal=c["causal"], sm_scale=c["scale"], block_sizes=BLOCKS[c["blocks"]])


_FAST = settings(
    max_examples=4,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# One test per dtype, so that pytest-xdist can spread the examples over its workers.
@_FAST
@given(diff_cases(lengths=(40, 23, 48, 16), heads=HEADS, dims=(32,), dtypes=("float32",)))
def test_diff_grid_float32(case):
    _run_case(case)


@_FAST
@given(diff_cases(lengths=(40, 23, 48, 16), heads=HEADS, dims=(32,), dtypes=("bfloat16",)))
def test_diff_grid_bfloat16(case):
    _run_case(case)


@pytest.mark.exhaustive  # by default: the float32 and bfloat16 grids above
@settings(
    max_examples=4,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    diff_cases(
        lengths=(57, 80, 17, 32), heads=[(3, 1), (4, 4)] + HEADS[:1] + HEADS[2:], dims=(64, 32)
    )
)
def test_diff_grid_large(case):
    _run_case(case)


@_FAST
@given(
    st.integers(0, 2**31 - 1),
    st.sampled_from([(37, 37), (48, 24), (24, 48), (16, 16)]),
    st.sampled_from(HEADS),
    st.sampled_from((32, 64)),
    st.sampled_from((True, False)),
    st.sampled_from((True, False)),
    st.sampled_from(("bfloat16", "float32")),
)
def test_flash_attention_grid(seed, ts, heads, d, causal, segmented, dtype):
    t, s = ts
    seg = ("shared" if s == t else "separate") if segmented else None
    case = make_inputs(
        seed, b=2, t=t, s=s, hq=heads[0], hkv=heads[1], d=d, dtype=dtype, seg=seg, n_seg=2
    )
    _check_standard(case, causal=causal)


# ---------------------------------------------------------------------------- targeted cases
def test_shared_keys_match_a_copy():
    case = make_inputs(3, b=2, t=40, s=40, hq=4, hkv=2, d=32, dv=64, lam="token")
    q1, k1, q2, v, lam = (case[n] for n in ("q1", "k1", "q2", "v", "lam"))
    k_copy = k1 + 0.0  # a different array with the same values
    shared_out, shared_grads = _check_diff(case, shared=True)

    def copy(q1, k1, q2, k2, v, lam):
        return gpu.differential_flash_attention(
            q1, k1, q2, k2, v, lam, block_sizes=SMALL, interpret=INTERPRET
        )

    copy_out, copy_grads = value_and_grads(copy, (q1, k1, q2, k_copy, v, lam), case["ct"])
    np.testing.assert_allclose(shared_out, copy_out, atol=1e-6, rtol=1e-6)
    dq1, dk, dq2, dv, dlam = shared_grads
    cq1, ck1, cq2, ck2, cv, clam = copy_grads
    for got, want in ((dq1, cq1), (dk, ck1 + ck2), (dq2, cq2), (dv, cv), (dlam, clam)):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def _pallas_calls(jaxpr):
    """Every pallas_call equation in a (closed) jaxpr, searching sub-jaxprs too."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(eqn)
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    found += _pallas_calls(sub)
    return found


def test_shared_keys_use_the_single_key_kernel():
    case = make_inputs(0, t=16, s=16, lam="token")
    args = tuple(case[n] for n in ("q1", "k1", "q2", "k2", "v", "lam"))
    ct = case["ct"]

    def kernel_inputs(shared):
        def loss(q1, k1, q2, k2, v, lam):
            o = gpu.differential_flash_attention(
                q1, k1, q2, None if shared else k2, v, lam, interpret=INTERPRET
            )
            return jnp.sum(o * ct)

        calls = _pallas_calls(jax.make_jaxpr(jax.grad(loss, (0, 1, 2, 3, 4, 5)))(*args))
        assert len(calls) == 3  # forward, dK/dV, dQ
        return [len(c.invars) for c in calls], [len(c.outvars) for c in calls]

    (in_copy, out_copy), (in_shared, out_shared) = kernel_inputs(False), kernel_inputs(True)
    assert [a - b for a, b in zip(in_copy, in_shared)] == [1, 1, 1]  # one K input fewer
    assert [a - b for a, b in zip(out_copy, out_shared)] == [0, 1, 0]  # dK1 + dK2 in one output


@pytest.mark.parametrize(
    "shared,key_major",
    [(False, False), (True, True)],
    ids=["v1_gqa_segments_query_major_dkv", "v2_shared_k_key_major_dkv"],
)
def test_split_forward_and_both_dkv_layouts_match_the_reference(shared, key_major):
    """``BlockSizes(split_forward=True)`` (one program per branch, the sm_90 default for V1 at
    Dv=256) with either dK/dV tile layout (``dkv_key_major``; on CPU the defaults are sm_90's,
    so the grids above run key-major at these widths): values and gradients as the
    reference's, with GQA, causal, packed segments and a ragged length; and for V2, shared
    keys with a per-token lambda."""
    case = make_inputs(
        5,
        b=2,
        t=23,
        s=23,
        hq=4,
        hkv=2,
        d=32,
        dv=64,
        lam="token" if shared else "scalar",
        seg=None if shared else "shared",
    )
    _check_diff(
        case,
        causal=True,
        block_sizes=dataclasses.replace(MIXED, split_forward=True, dkv_key_major=key_major),
        shared=shared,
    )


def test_split_forward_runs_one_branch_per_program():
    case = make_inputs(0, t=16, s=16, lam="token")
    args = [case[k] for k in ("q1", "k1", "q2", "k2", "v", "lam")]

    def grid(split):
        f = functools.partial(
            gpu.differential_flash_attention,
            interpret=INTERPRET,
            block_sizes=dataclasses.replace(SMALL, split_forward=split),
        )
        (fwd,) = [c for c in _pallas_calls(jax.make_jaxpr(f)(*args))]
        return fwd.params["grid_mapping"].grid

    assert grid(True) == (1, 1, 4) and grid(False) == (1, 1, 2)  # (q blocks, batch, 2 * heads)
    assert gpu.default_block_sizes(128, 256, compute_capability=(9, 0)).split_forward
    assert not gpu.default_block_sizes(64, 128, compute_capability=(9, 0)).split_forward
    assert not gpu.default_block_sizes(128, 256, compute_capability=(8, 0)).split_forward
    assert gpu.default_block_sizes(
        128, 128, shared_keys=True, compute_capability=(9, 0)
    ).dkv_key_major
    assert not gpu.default_block_sizes(128, 256, compute_capability=(9, 0)).dkv_key_major


@pytest.mark.parametrize("causal", [False, True])
def test_fully_masked_rows_are_zero_with_zero_grads(causal):
    b, t, s = 1, 32, 24
    case = make_inputs(7, b=b, t=t, s=s, dv=64, lam="token")
    case["segment_ids"] = jnp.asarray(np.r_[np.zeros(20), np.full(12, 5)][None].astype(np.int32))
    case["kv_segment_ids"] = jnp.zeros((b, s), jnp.int32)  # no key in segment 5: 20.. see none
    out, grads = _check_diff(case, causal=causal)
    assert np.all(np.asarray(out)[:, 20:] == 0.0)
    dq1, _, dq2, _, _, dlam = grads
    for g in (dq1, dq2, dlam):
        assert np.all(np.asarray(g)[:, 20:] == 0.0)
    if causal:  # more queries than keys: the first T - S queries see no key either
        assert np.all(np.asarray(out)[:, : t - s] == 0.0)
        assert np.all(np.asarray(dq1)[:, : t - s] == 0.0)


def test_flash_attention_fully_masked_rows():
    case = make_inputs(8, t=32, s=32, hkv=2)
    case["segment_ids"] = jnp.asarray(np.r_[np.zeros(16), np.ones(16)][None].astype(np.int32))
    case["kv_segment_ids"] = jnp.zeros((1, 32), jnp.int32)
    out, (dq, _, _) = _check_standard(case, causal=True)
    assert np.all(np.asarray(out)[:, 16:] == 0.0)
    assert np.all(np.asarray(dq)[:, 16:] == 0.0)


def test_float16_runs():
    _check_diff(make_inputs(5, dv=64, dtype="float16"))


def test_causal_skipping_many_blocks():
    """Five query blocks over three key blocks with T > S: the diagonal starts below the first
    query block (S - T = -32), so the first two query blocks visit no key block at all, and the
    dK/dV programs start at query block (16 j + 32) // 16."""
    out, _ = _check_diff(make_inputs(11, t=80, s=48))
    assert np.all(np.asarray(out)[:, :32] == 0.0)


def test_python_float_lambda_and_head_dim_128():
    case = make_inputs(2, t=16, s=16, hq=1, d=128)
    q1, k1, q2, k2, v = (case[n] for n in ("q1", "k1", "q2", "k2", "v"))
    out = gpu.differential_flash_attention(q1, k1, q2, k2, v, 0.5, interpret=INTERPRET)
    want = reference.differential_attention(q1, k1, q2, k2, v, 0.5, scale=128**-0.5)
    assert_close("out", out, want, F32_TOL["value"])


@pytest.mark.parametrize(
    "field,value",
    [
        ("block_q", 48),
        ("block_k", 8),
        ("block_q_dkv", 0),
        ("block_k_dq", 24),
        ("block_k_dkv", 64.0),
        ("num_warps", 3),
        ("num_stages", 0),
    ],
)
def test_bad_block_sizes(field, value):
    with pytest.raises(ValueError, match=field):
        gpu.BlockSizes(**{field: value})


def test_block_size_error_names_accepted_values():
    with pytest.raises(ValueError, match="power of two >= 16"):
        gpu.BlockSizes(block_q=100)


# Shared memory XLA reported for these kernels on sm_90 (benchmarks/compile_kernels.py, bf16):
# (kernel, block_q, block_k, d, dv, n_branch, n_keys) -> bytes.
MEASURED_SMEM = [
    ("fwd", 64, 64, 64, 128, 2, 2, 81920),
    ("fwd", 64, 64, 128, 256, 2, 2, 163840),
    ("fwd", 64, 64, 128, 128, 2, 1, 98304),
    ("fwd", 64, 64, 128, 128, 1, 1, 81920),
    ("fwd", 64, 32, 128, 256, 2, 2, 98304),
    ("dq", 64, 32, 64, 128, 2, 2, 65536),
    ("dq", 64, 32, 128, 256, 2, 2, 131072),
    ("dq", 64, 32, 128, 128, 2, 1, 81920),
    ("dq", 64, 32, 128, 128, 1, 1, 65536),
]


@pytest.mark.parametrize("kernel,bq,bk,d,dv,n_branch,n_keys,want", MEASURED_SMEM)
def test_shared_memory_model_matches_the_compiler(kernel, bq, bk, d, dv, n_branch, n_keys, want):
    assert gpu.shared_memory_bytes(kernel, bq, bk, d, dv, n_branch=n_branch, n_keys=n_keys) == want


def test_blocks_too_big_for_shared_memory_are_refused_with_a_size_that_fits():
    big = gpu.BlockSizes(block_q=128, block_k=128)
    with pytest.raises(ValueError, match=r"327680 bytes.*232448.*Fix: use block_k=64"):
        gpu._check_fits(big, 128, 256, 2, 2, 2, (9, 0))
    gpu._check_fits(dataclasses.replace(big, block_k=64), 128, 256, 2, 2, 2, (9, 0))  # fits


def test_default_blocks_fit_hopper_shared_memory():
    """sm_90 defaults fit its shared memory by the exact model (the compile check verifies
    every target, where the model is an over-estimate before sm_90)."""
    for cc in [(9, 0)]:
        for d, dv, diff in [(64, 128, True), (128, 256, True), (128, 128, True), (128, 128, False)]:
            bs = gpu.default_block_sizes(d, dv, differential=diff, compute_capability=cc)
            n = 2 if diff else 1
            for kernel, bq, bk in [
                ("fwd", bs.block_q, bs.block_k),
                ("dq", bs.block_q_dq, bs.block_k_dq),
            ]:
                assert (
                    gpu.shared_memory_bytes(kernel, bq, bk, d, dv, n_branch=n, n_keys=n)
                    <= gpu.SHARED_MEMORY_BYTES[cc]
                )


def test_bad_shapes():
    x = jnp.zeros((1, 16, 2, 32))
    with pytest.raises(ValueError, match="lam"):
        gpu.differential_flash_attention(x, x, x, x, x, jnp.zeros((3,)), interpret=INTERPRET)
    with pytest.raises(ValueError, match="kv heads"):
        gpu.flash_attention(jnp.zeros((1, 16, 3, 32)), x, x, interpret=INTERPRET)


def test_lowers_through_triton():
    """The forward and both backward kernels lower through the real Pallas Triton path (Triton
    IR is built; compiling it to PTX needs a GPU). Catches non-power-of-two shapes and
    unsupported ops that interpret mode accepts."""
    q = jax.ShapeDtypeStruct((2, 100, 6, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 130, 2, 64), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((2, 130, 2, 128), jnp.bfloat16)
    lam = jax.ShapeDtypeStruct((2, 100, 6), jnp.float32)
    seg = jax.ShapeDtypeStruct((2, 100), jnp.int32)
    kv_seg = jax.ShapeDtypeStruct((2, 130), jnp.int32)

    def loss(q1, k1, q2, k2, v, lam, seg, kv_seg, shared):
        o = gpu.differential_flash_attention(
            q1, k1, q2, None if shared else k2, v, lam, segment_ids=seg, kv_segment_ids=kv_seg
        )
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(
            gpu.flash_attention(q1, k1, v[..., :64], causal=False).astype(jnp.float32)
        )

    for shared in (False, True):
        f = jax.jit(jax.grad(functools.partial(loss, shared=shared), (0, 1, 2, 3, 4, 5)))
        try:
            lowered = f.trace(q, k, q, k, v, lam, seg, kv_seg).lower(lowering_platforms=("cuda",))
        except (AttributeError, TypeError, NotImplementedError) as e:  # API moved / no Triton
            pytest.skip(f"cannot lower for cuda on this jax: {e}")
        assert lowered.as_text().count("triton") >= 6


def _block_config(causal, t, s, bq, bk):
    """A kernel config with the same (bq, bk) blocks in all three kernels, for the block maths."""
    return gpu._Config(
        differential=True,
        shared_k=False,
        causal=causal,
        segmented=False,
        q_len=t,
        kv_len=s,
        kv_padded=s % bk != 0,
        scale=1.0,
        block_q=bq,
        block_k=bk,
        block_q_dkv=bq,
        block_k_dkv=bk,
        block_q_dq=bq,
        block_k_dq=bk,
        num_warps=4,
        num_stages=2,
        interpret=INTERPRET,
    )


@pytest.mark.parametrize("causal", [True, False])
def test_unmasked_key_blocks_are_exactly_the_fully_visible_ones(causal):
    """The forward and dQ loops run their leading key blocks without a mask: that count must be
    the number of leading blocks every row of the query block sees in full (brute force)."""
    for t, s, bq, bk in [
        (80, 80, 16, 16),
        (48, 80, 16, 32),
        (80, 48, 32, 16),
        (40, 37, 16, 16),
        (64, 64, 32, 16),
        (20, 100, 16, 32),
    ]:
        cfg = _block_config(causal, t, s, bq, bk)
        for qi in range(-(-t // bq)):
            rows = np.arange(qi * bq, (qi + 1) * bq)[:, None]
            hi = int(gpu._kv_block_bound(cfg, qi, bq, bk))
            want = 0
            for j in range(hi):
                keys = np.arange(j * bk, (j + 1) * bk)[None, :]
                visible = keys < s
                if causal:
                    visible = visible & (keys <= rows + (s - t))
                if not visible.all():
                    break
                want += 1
            got = int(gpu._unmasked_kv_blocks(cfg, qi, bq, bk, hi))
            assert got == want, (t, s, bq, bk, qi, got, want)


@pytest.mark.parametrize("causal", [True, False])
def test_dkv_unmasked_query_blocks_are_exactly_the_fully_visible_ones(causal):
    """The dK/dV loop drops the causal mask from the first query block whose every row sees the
    whole key block (brute force over block layouts, T != S included)."""
    for t, s, bq, bk in [
        (80, 80, 16, 16),
        (48, 80, 16, 32),
        (80, 48, 32, 16),
        (40, 37, 16, 16),
        (64, 64, 16, 32),
        (100, 20, 32, 16),
    ]:
        cfg = _block_config(causal, t, s, bq, bk)
        hi = -(-t // bq)
        for kj in range(-(-s // bk)):
            lo = int(gpu._q_block_start(cfg, kj, bk, bq))
            got = int(gpu._q_block_unmasked_start(cfg, kj, bk, bq, lo, hi))
            keys = np.arange(kj * bk, (kj + 1) * bk)[None, :]
            want = hi
            for qi in range(lo, hi):
                rows = np.arange(qi * bq, (qi + 1) * bq)[:, None]
                if not causal or (keys <= rows + (s - t)).all():
                    # causally fully visible from here on (monotonic in qi)
                    want = qi
                    break
            assert got == want, (t, s, bq, bk, kj, got, want)


def test_bfloat16_o2_residual_costs_little_in_dlam():
    """The O2 residual saved in bfloat16 (half its memory): d(lam) stays within the bfloat16
    tolerance of the float32 reference (docs/kernels.md gives the measured cost)."""
    case = make_inputs(3, t=48, s=48, hkv=2, d=16, dv=32, dtype="bfloat16")
    args = tuple(case[n] for n in ("q1", "k1", "q2", "k2", "v", "lam"))
    ct = case["ct"]
    up = [x.astype(jnp.float32) for x in args[:5]]

    def dlam(f):
        return jax.grad(lambda lam: jnp.sum(f(lam).astype(jnp.float32) * ct))(args[5])

    got = dlam(
        lambda lam: gpu.differential_flash_attention(
            *args[:5], lam, block_sizes=SMALL, interpret=INTERPRET, o2_dtype=jnp.bfloat16
        )
    )
    want = dlam(lambda lam: reference.differential_attention(*up, lam, causal=True))
    o2 = reference.dot_product_attention(up[2], up[3], up[4], causal=True)
    atol, rtol = BF16_TOL["dlam"]  # rtol times the L1 norm of d(lam)'s terms, as in _check_diff
    assert abs(float(got) - float(want)) <= atol + rtol * float(jnp.sum(jnp.abs(ct * o2)))


# ---------------------------------------------------------------------------- partials
@pytest.mark.parametrize("kind", ["v1", "v2", "standard"])
def test_partials_over_key_blocks_merge_to_the_reference(kind):
    """``flash_partials`` on two key blocks, merged by log-sum-exp, give the reference's output;
    ``flash_partial_grads`` of each block from the merged statistics sum to autodiff of the
    reference (ring attention's building blocks)."""
    check_partials(gpu, kind, interpret=True)


# ---------------------------------------------------------------------------- logit maxes
@pytest.mark.parametrize(
    "kind", ["v1_fused", "v2_split_shared_k", "standard"], ids=lambda k: k.replace("_", "-")
)
def test_logit_max_is_the_forward_running_row_max(kind):
    """``return_logit_max=True``: each map's largest visible logit per row (the forward's
    running max, base 2 converted back) equals numpy's, -inf for a row that sees no key, on
    the fused forward (V1: GQA, T > S under the causal mask so the first rows see no key,
    separate key segments), the forward split per branch (V2: shared key, per-token lambda)
    and the standard kernel (MQA, not causal); the output and every gradient are those of
    the call without it, bit for bit."""
    shared, standard = kind.startswith("v2"), kind == "standard"
    shape = dict(b=2, t=24, s=20) if kind == "v1_fused" else dict(t=24, s=24)
    case = make_inputs(
        9,
        **shape,
        hq=4 if not standard else 2,
        hkv=2 if not standard else 1,
        d=16,
        dv=16 if shared or standard else 32,
        lam="token" if shared else "scalar",
        seg="separate" if kind == "v1_fused" else "shared",
    )
    if case["kv_segment_ids"] is None:
        case["kv_segment_ids"] = case["segment_ids"]
    case["segment_ids"] = case["segment_ids"].at[:, 5].set(99)  # row 5: in no key's segment
    blocks = dataclasses.replace(SMALL, split_forward=shared)
    if standard:
        attention = functools.partial(gpu.flash_attention, block_sizes=blocks, interpret=INTERPRET)
    else:
        attention = functools.partial(
            gpu.differential_flash_attention, block_sizes=blocks, interpret=INTERPRET
        )
    maxes = check_logit_max(attention, case, causal=not standard, shared=shared, standard=standard)
    assert np.all(np.isneginf(maxes[:, :, 5]))
    if kind == "v1_fused":
        assert np.all(np.isneginf(maxes[:, :, :4]))  # T - S = 4 rows before the first key


def test_logit_max_adds_one_forward_output_per_map_and_nothing_else():
    """The option is one more float32 ``[B, Hq, T]`` output per map of the forward kernel
    (fused, standard; the forward split per branch, whose programs stack the maps as heads:
    one ``[B, 2 Hq, T]``); the backward kernels are unchanged, and without it the call is
    exactly the call without the option (same outputs, same jaxpr)."""
    case = make_inputs(0, t=16, s=16, hq=2, hkv=1, d=16, lam="token")
    args = [case[k] for k in ("q1", "k1", "q2", "k2", "v", "lam")]

    def calls(on, split=False, standard=False):
        blocks = dataclasses.replace(SMALL, split_forward=split)
        opts = dict(block_sizes=blocks, interpret=INTERPRET)
        if on is not None:
            opts["return_logit_max"] = on

        def loss(q1, k1, q2, k2, v, lam):
            if standard:
                res = gpu.flash_attention(q1, k1, v, **opts)
            else:
                res = gpu.differential_flash_attention(q1, k1, q2, k2, v, lam, **opts)
            out = res[0] if on else res
            return jnp.sum(out * case["ct"][..., : out.shape[-1]])

        jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1, 2, 3, 4, 5)))(*args)
        return str(jaxpr), [[v.aval for v in c.outvars] for c in _pallas_calls(jaxpr)]

    def rows(heads):
        return jax.core.ShapedArray((1, heads, 16), jnp.float32)

    for split, standard, extra in (
        (False, False, [rows(2), rows(2)]),
        (True, False, [rows(4)]),
        (False, True, [rows(2)]),
    ):
        text, plain = calls(None, split, standard)
        assert calls(False, split, standard) == (text, plain)  # the default, spelled out
        _, with_max = calls(True, split, standard)
        assert len(plain) == len(with_max) == 3  # forward, dK/dV, dQ
        assert with_max[0] == plain[0] + extra, (split, standard)
        assert with_max[1:] == plain[1:]
