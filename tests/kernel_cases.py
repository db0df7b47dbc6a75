"""What the GPU and TPU kernel tests share: random inputs, one compiled call for a value and its
gradients, the float32 reference (``diffjax.kernels.reference`` and its autodiff) and the
tolerance check, so that ``test_kernels_gpu.py`` and ``test_kernels_tpu.py`` read as lists of
cases. Each file keeps its own tolerance table (the two kernels round differently).

A tolerance table maps ``"value"``, ``"grad"`` and optionally ``"dlam"`` to ``(atol, rtol)``:
``max |kernel - reference| <= atol + rtol * scale`` per array, where ``scale`` is the largest
magnitude of the reference (at least 1e-6). With a ``"dlam"`` entry, d(lambda) is instead
scaled by the L1 norm of its terms ``dO * O2`` (a scalar lambda's gradient is a sum over every
output element and can cancel to far below its terms); without one it is checked like the
other gradients.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from diffjax.ops import context
from diffjax.kernels import reference

ON_GPU = jax.default_backend() == "gpu"
_FAST_COMPILE = {"xla_backend_optimization_level": 0}


def segments(rng, b: int, n: int, n_seg: int):
    """Sorted (packed-sequence style) segment ids in ``[0, n_seg)``, ``[b, n]`` int32."""
    return jnp.asarray(np.sort(rng.integers(0, n_seg, size=(b, n)), axis=1).astype(np.int32))


def make_inputs(
    seed,
    *,
    b=1,
    t=24,
    s=24,
    hq=2,
    hkv=1,
    d=32,
    dv=None,
    dtype="float32",
    lam="scalar",
    seg=None,
    n_seg=3,
) -> dict:
    """Random ``q1, k1, q2, k2, v`` (in ``dtype``), ``lam`` (float32: a scalar in [0.1, 0.9) or
    ``[b, t, hq]`` in [0, 1) for ``lam="token"``), a float32 cotangent ``ct`` ``[b, t, hq, dv]``
    and segment ids: ``seg`` None, ``"shared"`` (``segment_ids`` only, needs t == s) or
    ``"separate"`` (``segment_ids`` and ``kv_segment_ids``: some queries may see no key)."""
    rng = np.random.default_rng(seed)
    dv = d if dv is None else dv

    def normal(*shape, dt=dtype):
        return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(jnp.dtype(dt))

    case = dict(
        q1=normal(b, t, hq, d),
        k1=normal(b, s, hkv, d),
        q2=normal(b, t, hq, d),
        k2=normal(b, s, hkv, d),
        v=normal(b, s, hkv, dv),
    )
    case["lam"] = (
        jnp.float32(rng.uniform(0.1, 0.9))
        if lam == "scalar"
        else jnp.asarray(rng.uniform(0.0, 1.0, (b, t, hq)), jnp.float32)
    )
    case["ct"] = normal(b, t, hq, dv, dt="float32")
    case["segment_ids"] = case["kv_segment_ids"] = None
    if seg == "shared":
        assert t == s, "shared segment ids need t == s"
        case["segment_ids"] = segments(rng, b, t, n_seg)
    elif seg == "separate":
        case["segment_ids"] = segments(rng, b, t, n_seg)
        case["kv_segment_ids"] = segments(rng, b, s, n_seg)
    return case


def masks(case) -> dict:
    return dict(segment_ids=case["segment_ids"], kv_segment_ids=case["kv_segment_ids"])


def value_and_grads(fn, args, ct, argnums=None):
    """``fn(*args)`` and the gradients of ``sum(fn(*args) * ct)`` with respect to
    ``args[argnums]`` (default: all), in one compiled program: interpret-mode kernels are costly
    to compile, so each case compiles once, at XLA's lowest backend optimisation level off GPU
    (the numerics under test do not depend on it)."""
    args = tuple(args)
    argnums = tuple(range(len(args)) if argnums is None else argnums)

    def run(args, ct):
        def f(*diff_args):
            full = list(args)
            for i, a in zip(argnums, diff_args):
                full[i] = a
            out = fn(*full)
            return out.astype(jnp.float32), out

        _, vjp, out = jax.vjp(f, *(args[i] for i in argnums), has_aux=True)
        return out, vjp(ct)

    return compile_fast(run, args, ct)(args, ct)


def compile_fast(fn, *args):
    """``jax.jit(fn)`` compiled for ``args``; off GPU at XLA's lowest backend optimisation level."""
    lowered = jax.jit(fn).lower(*args)
    if not ON_GPU:
        try:
            return lowered.compile(compiler_options=_FAST_COMPILE)
        except Exception:  # the option is an XLA debug flag; fall back if a version rejects it
            pass
    return lowered.compile()


def assert_close(name, got, want, tol, scale=None):
    """``max |got - want| <= atol + rtol * scale`` with ``tol = (atol, rtol)`` and ``scale``
    defaulting to ``max |want|`` (at least 1e-6); also same shapes and finite values."""
    atol, rtol = tol
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert np.all(np.isfinite(got)), f"{name}: non-finite values"
    err = float(np.max(np.abs(got - want), initial=0.0))
    if scale is None:
        scale = max(float(np.max(np.abs(want), initial=0.0)), 1e-6)
    bound = atol + rtol * scale
    assert err <= bound, (
        f"{name}: max abs error {err:.3g} > {bound:.3g} = {atol} + {rtol} * {scale:.3g}"
    )


def _f32(x):
    return x.astype(jnp.float32)


def check_differential(kernel, case, tol, *, causal=True, sm_scale=None, shared=False):
    """``kernel(q1, k1, q2, k2, v, lam, causal=, sm_scale=, segment_ids=, kv_segment_ids=)``
    (a kernel module's ``differential_flash_attention`` with its block sizes and interpret mode
    bound) against ``reference.differential_attention`` in float32: the output, its dtype and
    shape, and the gradients of q1, k1, q2, k2, v and lam (``k2=None`` when ``shared``:
    both maps read k1). Returns ``(out, grads)``."""
    kw = dict(causal=causal, **masks(case))
    d = case["q1"].shape[-1]
    names = ("q1", "k1", "q2", "k2", "v", "lam")
    args = tuple(case[n] for n in names)
    argnums = (0, 1, 2, 4, 5) if shared else tuple(range(6))

    def run(impl):
        def fn(q1, k1, q2, k2, v, lam):
            return impl(q1, k1, q2, None if shared else k2, v, lam)

        return fn

    out, grads = value_and_grads(
        run(functools.partial(kernel, sm_scale=sm_scale, **kw)), args, case["ct"], argnums
    )
    scale = d**-0.5 if sm_scale is None else sm_scale
    ref_out, ref_grads = value_and_grads(
        run(functools.partial(reference.differential_attention, scale=scale, **kw)),
        tuple(map(_f32, args)),
        case["ct"],
        argnums,
    )
    assert out.dtype == args[0].dtype and out.shape == ref_out.shape
    assert_close("out", out, ref_out, tol["value"])
    for i, g, rg in zip(argnums, grads, ref_grads):
        assert g.shape == args[i].shape and g.dtype == args[i].dtype, names[i]
        if i < 5 or "dlam" not in tol:
            assert_close(f"d{names[i]}", g, rg, tol["grad"])
    if "dlam" in tol:  # d(lam) = -sum_d dO * O2: scaled by the L1 norm of those terms
        o2 = jax.jit(functools.partial(reference.dot_product_attention, scale=scale, **kw))(
            _f32(case["q2"]), _f32(case["k1" if shared else "k2"]), _f32(case["v"])
        )
        l1 = np.sum(np.abs(np.asarray(case["ct"]) * np.asarray(o2)), axis=-1)
        assert_close(
            "dlam",
            grads[-1],
            ref_grads[-1],
            tol["dlam"],
            scale=float(np.max(l1) if np.ndim(case["lam"]) else np.sum(l1)),
        )
    return out, grads


def check_standard(kernel, case, tol, *, causal=True):
    """``kernel(q, k, v, causal=, segment_ids=, kv_segment_ids=)`` on ``q1, k1, v`` against
    ``reference.dot_product_attention`` in float32: the output and dq, dk, dv."""
    kw = dict(causal=causal, **masks(case))
    args = (case["q1"], case["k1"], case["v"])
    out, grads = value_and_grads(functools.partial(kernel, **kw), args, case["ct"])
    ref_out, ref_grads = value_and_grads(
        functools.partial(reference.dot_product_attention, scale=args[0].shape[-1] ** -0.5, **kw),
        tuple(map(_f32, args)),
        case["ct"],
    )
    assert out.dtype == args[0].dtype
    assert_close("out", out, ref_out, tol["value"])
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(name, g, rg, tol["grad"])
    return out, grads


# ---------------------------------------------------------------------------- logit maxes
def logit_max_oracle(q, k, *, scale, causal=True, segment_ids=None, kv_segment_ids=None):
    """Each query row's largest logit ``(q . k) * scale`` over the keys it may see, in numpy
    float64 (independent of diffjax): q ``[B, T, Hq, D]``, k ``[B, S, Hkv, D]`` (query head
    ``h`` reads kv head ``h // (Hq // Hkv)``), bottom-right aligned causal mask, segment ids
    ``[B, T]`` / ``[B, S]``. Returns ``[B, T, Hq]``, -inf for a row that sees no key."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    (b, t, hq, _), (s, hkv) = q.shape, k.shape[1:3]
    logits = np.einsum("bthd,bshd->bths", q, np.repeat(k, hq // hkv, axis=2)) * scale
    visible = np.ones((b, t, s), bool)
    if causal:
        visible &= np.arange(s)[None, None, :] <= np.arange(t)[None, :, None] + (s - t)
    if segment_ids is not None:
        kv = segment_ids if kv_segment_ids is None else kv_segment_ids
        visible &= np.asarray(segment_ids)[:, :, None] == np.asarray(kv)[:, None, :]
    return np.where(visible[:, :, None, :], logits, -np.inf).max(axis=-1)


def assert_logit_max(got, want, tol=(1e-5, 1e-5)):
    """``got`` (float32) against the oracle's ``want`` (same shape): -inf exactly where
    ``want`` is, elsewhere ``|got - want| <= atol + rtol * |want|``."""
    atol, rtol = tol
    got = np.asarray(got)
    assert got.dtype == np.float32 and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    seen = np.isfinite(want)
    assert np.all(np.isfinite(got[seen]))
    err = np.abs(got[seen] - want[seen]) - rtol * np.abs(want[seen])
    assert np.all(err <= atol), f"logit max off by {float(np.max(err)) + atol:.3g}"


def _outputs_and_grads(fn, args, ct, argnums):
    """``(out, maxes, grads)`` of ``fn(*args)`` (``maxes`` None when it returns ``out``
    alone), the gradients those of ``sum(out * ct)`` in ``args[argnums]``; one compiled call."""

    def run(args, ct):
        def f(*diff_args):
            full = list(args)
            for i, a in zip(argnums, diff_args):
                full[i] = a
            res = fn(*full)
            out, maxes = res if isinstance(res, tuple) else (res, None)
            return out.astype(jnp.float32), (out, maxes)

        _, vjp, (out, maxes) = jax.vjp(f, *(args[i] for i in argnums), has_aux=True)
        return out, maxes, vjp(ct)

    return compile_fast(run, args, ct)(args, ct)


def check_logit_max(attention, case, *, causal=True, shared=False, standard=False, tol=None):
    """``attention(*args, causal=, segment_ids=, kv_segment_ids=, return_logit_max=)`` (a
    ``differential_flash_attention`` on ``q1, k1, q2, k2, v, lam``, or with ``standard`` a
    ``flash_attention`` on ``q1, k1, v``, other options bound; ``shared``: k2 None): with the
    option its maxes are :func:`logit_max_oracle`'s of each map, and its output and the
    gradients of every input are those of the call without it, bit for bit. Returns the
    maxes ``[n_maps, B, T, Hq]``."""
    masked = masks(case)
    names = ("q1", "k1", "v") if standard else ("q1", "k1", "q2", "k2", "v", "lam")
    maps = [("q1", "k1")] + ([] if standard else [("q2", "k1" if shared else "k2")])
    args = tuple(case[n] for n in names)
    argnums = tuple(i for i, n in enumerate(names) if not (shared and n == "k2"))

    def call(on):
        def fn(*a):
            a = a[:3] + (None,) + a[4:] if shared else a
            return attention(*a, causal=causal, return_logit_max=on, **masked)

        return fn

    out, maxes, grads = _outputs_and_grads(call(True), args, case["ct"], argnums)
    out0, none, grads0 = _outputs_and_grads(call(False), args, case["ct"], argnums)
    assert none is None  # without the option: the output alone
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out0))
    for i, g, g0 in zip(argnums, grads, grads0):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(g0), err_msg=f"d{names[i]}")
    scale = case["q1"].shape[-1] ** -0.5
    want = np.stack(
        [logit_max_oracle(case[q], case[k], scale=scale, causal=causal, **masked) for q, k in maps]
    )
    assert_logit_max(maxes, want, *(() if tol is None else (tol,)))
    return np.asarray(maxes)


def check_partials(module, kind, interpret):
    """``module.flash_partials`` on two key blocks, merged by log-sum-exp, give the reference's
    output, and their row maxes (``return_row_max``) merged by max each map's largest visible
    logit; ``module.flash_partial_grads`` of each block from the merged statistics sum to
    autodiff of the reference. GQA 4/2, packed segments, length 24 cut 12/12 (one segment spans
    the cut)."""
    rng = np.random.default_rng(0)
    b, t, h, hkv, d = 2, 24, 4, 2, 16
    q1, q2 = (jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32) for _ in range(2))
    k1, k2 = (jnp.asarray(rng.standard_normal((b, t, hkv, d)), jnp.float32) for _ in range(2))
    dv = 2 * d if kind == "v1" else d
    v = jnp.asarray(rng.standard_normal((b, t, hkv, dv)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((b, t, h, dv)), jnp.float32)
    lam = (
        jnp.asarray(rng.uniform(0.1, 0.9, (b, t, h)), jnp.float32)
        if kind == "v2"
        else jnp.float32(0.3)
    )
    seg = jnp.asarray(np.repeat([[0] * 10 + [1] * 14], b, 0))
    diff = kind != "standard"
    k2 = k2 if kind == "v1" else None
    halves = (slice(0, 12), slice(12, None))
    kw = dict(causal=False, segment_ids=seg, interpret=interpret)

    def block(s):
        return dict(
            k1=k1[:, s], k2=None if k2 is None else k2[:, s], v=v[:, s], kv_segment_ids=seg[:, s]
        )

    def partials(x, **opt):
        return module.flash_partials(
            q1,
            x["k1"],
            q2 if diff else None,
            x["k2"],
            x["v"],
            kv_segment_ids=x["kv_segment_ids"],
            **kw,
            **opt,
        )

    plain = jax.eval_shape(lambda: partials(block(halves[0])))  # (o, lse) per map
    assert [len(p) for p in plain] == [2] * (1 + diff)
    parts = [partials(x, return_row_max=True) for x in map(block, halves)]  # (o, lse, row max)
    merged = [context.merge_partials(*a[:2], *b_[:2]) for a, b_ in zip(*parts)]
    maps = [(q1, k1)] + ([(q2, k1 if k2 is None else k2)] if diff else [])
    for (qm, km), a, b_ in zip(maps, *parts):  # the blocks' row maxes, merged by max
        want = logit_max_oracle(qm, km, scale=d**-0.5, causal=False, segment_ids=seg)
        assert_logit_max(jnp.maximum(a[2], b_[2]), want)
        assert np.all(np.isneginf(np.asarray(b_[2])[:, :10]))  # segment 0: no key in half 2

    def ref(q1, k1, q2, k2, v):
        if diff:
            return reference.differential_attention(
                q1, k1, q2, k2, v, lam, causal=False, segment_ids=seg
            )
        return reference.dot_product_attention(q1, k1, v, causal=False, segment_ids=seg)

    lam_o = lam[..., None] if lam.ndim else lam  # per token and head (V2), or a scalar
    out = merged[0][0] - lam_o * merged[1][0] if diff else merged[0][0]
    np.testing.assert_allclose(out, ref(q1, k1, q2, k2, v), atol=1e-5, rtol=1e-5)

    lses = [lse for _, lse in merged]
    deltas = [jnp.sum(g * o, -1) for o, _ in merged]
    grads = [
        module.flash_partial_grads(
            q1,
            x["k1"],
            q2 if diff else None,
            x["k2"],
            x["v"],
            lam if diff else None,
            g,
            lses[0],
            deltas[0],
            lses[1] if diff else None,
            deltas[1] if diff else None,
            kv_segment_ids=x["kv_segment_ids"],
            **kw,
        )
        for x in map(block, halves)
    ]
    names = ("q1", "k1", "q2", "k2", "v")
    args = dict(q1=q1, k1=k1, q2=q2, k2=k2, v=v)
    live = [n for n in names if args[n] is not None and (diff or n not in ("q2", "k2"))]
    want = jax.grad(
        lambda *xs: jnp.sum(g * ref(**{**args, **dict(zip(live, xs))})),
        argnums=tuple(range(len(live))),
    )(*(args[n] for n in live))
    for n, w in zip(live, want):
        i = names.index(n)
        a, b_ = grads[0][i], grads[1][i]
        got = a + b_ if n.startswith("q") else jnp.concatenate([a, b_], axis=1)
        np.testing.assert_allclose(got, w, atol=2e-5, rtol=1e-5, err_msg=n)
    # unused operands stay None
    assert (grads[0][2] is None) == (not diff) and (grads[0][3] is None) == (k2 is None)
