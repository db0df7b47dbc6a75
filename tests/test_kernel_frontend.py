"""One front end for both kernel backends (``diffjax/kernels/_frontend.py``): the same bad input
raises the same exception with the same ``what is wrong. Fix: ...`` message through
``kernels.gpu``, ``kernels.tpu`` and the public entry point, before any kernel runs; ``o2_dtype``
means the same on both backends. Interpret mode; every refusal here happens before a kernel is
launched (a launch fails the test)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from diffjax import kernels
from diffjax.kernels import gpu, tpu


def _inputs(b=1, t=24, s=24, hq=2, hkv=1, d=16, dv=32, dtype=jnp.float32):
    key = jax.random.split(jax.random.key(0), 5)
    q1, q2 = (jax.random.normal(k, (b, t, hq, d), dtype) for k in key[:2])
    k1, k2 = (jax.random.normal(k, (b, s, hkv, d), dtype) for k in key[2:4])
    v = jax.random.normal(key[4], (b, s, hkv, dv), dtype)
    return q1, k1, q2, k2, v


@pytest.fixture
def no_kernel(monkeypatch):
    """Any kernel launch fails: the refusals under test must come first."""

    def launch(*args, **kwargs):
        raise AssertionError("a Pallas kernel was launched before the input was refused")

    monkeypatch.setattr(pl, "pallas_call", launch)


# The four ways to reach a kernel: each backend module, and the public entry point for each.
ROUTES = {
    "gpu": (gpu, {}),
    "tpu": (tpu, {}),
    "entry-gpu": (kernels, {"backend": "gpu"}),
    "entry-tpu": (kernels, {"backend": "tpu"}),
}


def _diff(*args, **kw):
    return lambda m, route: m.differential_flash_attention(*args, interpret=True, **kw, **route)


def _std(*args, **kw):
    return lambda m, route: m.flash_attention(*args, interpret=True, **kw, **route)


q1, k1, q2, k2, v = _inputs()
q1_3h, k1_2h, q2_3h, k2_2h, v_2h = _inputs(hq=3, hkv=2)
e_q1, e_k1, e_q2, e_k2, e_v = _inputs(t=0)
seg = jnp.zeros((1, 24), jnp.int32)

# (call, exception, message): each a bad input of one kind.
BAD_CALLS = {
    "rank": (_diff(q1[0], k1, q2, k2, v, 0.5), ValueError, r"q1 must be \[batch, seq, heads"),
    "heads": (
        _diff(q1_3h, k1_2h, q2_3h, k2_2h, v_2h, 0.5),
        ValueError,
        r"2 kv heads do not divide 3 query heads",
    ),
    "heads-standard": (_std(q1_3h, k1_2h, v_2h), ValueError, r"2 kv heads do not divide 3"),
    "q2-shape": (_diff(q1, k1, q2[:, :, :1], k2, v, 0.5), ValueError, r"q1 and q2 must have"),
    "k2-shape": (_diff(q1, k1, q2, k2[:, :8], v, 0.5), ValueError, r"k1 and k2 must have"),
    "head-dims": (_std(q1[..., :8], k1, v), ValueError, r"q1?\b.*head dims differ"),
    "lam-shape": (_diff(q1, k1, q2, k2, v, jnp.ones((3,))), ValueError, r"lam must be a scalar"),
    "lam-heads": (
        _diff(q1, k1, q2, k2, v, jnp.ones((1, 24, 1))),
        ValueError,
        r"lam must be a scalar or \[batch, seq, heads\] = \[1, 24, 2\]",
    ),
    "segments": (
        _diff(q1, k1, q2, k2, v, 0.5, segment_ids=seg[:, :8]),
        ValueError,
        r"segment_ids must be \[batch, seq\] = \[1, 24\]",
    ),
    "kv-segments-alone": (
        _std(q1, k1, v, kv_segment_ids=seg),
        ValueError,
        r"kv_segment_ids given without segment_ids",
    ),
    "empty": (
        _diff(e_q1, k1, e_q2, k2, v, 0.5),
        ValueError,
        r"empty sequence \(q length 0, kv length 24\)",
    ),
    "q2-none": (_diff(q1, k1, None, k2, v, 0.5), ValueError, r"q2 is None"),
    "block-sizes-tuple": (
        _diff(q1, k1, q2, k2, v, 0.5, block_sizes=(64, 64)),
        TypeError,
        r"block_sizes must be a diffjax\.kernels\.<backend>\.BlockSizes or None, got builtins\.tuple",
    ),
    "block-sizes-standard": (
        _std(q1, k1, v, block_sizes={"block_q": 64}),
        TypeError,
        r"block_sizes must be a diffjax\.kernels\.<backend>\.BlockSizes or None, got builtins\.dict",
    ),
    "sm-scale-string": (
        _diff(q1, k1, q2, k2, v, 0.5, sm_scale="auto"),
        TypeError,
        r"sm_scale must be a static python number .* got 'auto'",
    ),
    "sm-scale-array": (
        _std(q1, k1, v, sm_scale=jnp.ones((2,))),
        TypeError,
        r"sm_scale must be a static python number .* got jax.*Array",
    ),
    "o2-dtype-int": (
        _diff(q1, k1, q2, k2, v, 0.5, o2_dtype=jnp.int8),
        ValueError,
        r"o2_dtype .* must be float32 or bfloat16, got int8\. Fix",
    ),
    "o2-dtype-name": (
        _diff(q1, k1, q2, k2, v, 0.5, o2_dtype="half-precision"),
        ValueError,
        r"o2_dtype .* must be float32 or bfloat16, got 'half-precision'",
    ),
    "logit-max-not-a-bool": (
        _diff(q1, k1, q2, k2, v, 0.5, return_logit_max="yes"),
        TypeError,
        r"return_logit_max must be True or False .* got 'yes'\. Fix: pass return_logit_max=True",
    ),
    "logit-max-traced-standard": (
        _std(q1, k1, v, return_logit_max=jnp.asarray(True)),
        TypeError,
        r"flash_attention: return_logit_max must be True or False .* got jax.*Array",
    ),
}


def _refusal(call, route):
    """``(type, message)`` of what ``call`` raises through ``route``, the backend's name in the
    message written ``<backend>`` (a message may name the backend whose type it expects)."""
    module, kw = ROUTES[route]
    backend = kw.get("backend", route)
    with pytest.raises(Exception) as info:
        call(module, kw)
    text = str(info.value).replace(f"kernels.{backend}.", "kernels.<backend>.")
    return info.type, text.replace(f"pass {backend}.", "pass <backend>.")


@pytest.mark.usefixtures("no_kernel")
@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_a_bad_input_is_refused_alike_on_every_route(case):
    call, exc, message = BAD_CALLS[case]
    seen = {route: _refusal(call, route) for route in ROUTES}
    assert len(set(seen.values())) == 1, seen  # one type, one message, on all four routes
    got_type, got_text = seen["gpu"]
    assert got_type is exc, seen
    assert re.search(message, got_text), got_text
    assert "Fix: " in got_text, got_text  # what is wrong, then what to do


BAD_PARTIALS = {
    "heads": (
        lambda m: m.flash_partials(q1_3h, k1_2h, q2_3h, k2_2h, v_2h, interpret=True),
        ValueError,
        r"flash_partials: 2 kv heads do not divide 3",
    ),
    "block-sizes": (
        lambda m: m.flash_partials(q1, k1, None, None, v, block_sizes=[16], interpret=True),
        TypeError,
        r"flash_partials: block_sizes must be a diffjax\.kernels\.<backend>\.BlockSizes",
    ),
    "row-max-not-a-bool": (
        lambda m: m.flash_partials(q1, k1, q2, k2, v, return_row_max=1, interpret=True),
        TypeError,
        r"flash_partials: return_row_max must be True or False .* got 1\. Fix",
    ),
    "grads-heads": (
        lambda m: m.flash_partial_grads(
            q1_3h, k1_2h, None, None, v_2h, None, *_stats(3, 32)[:3], interpret=True
        ),
        ValueError,
        r"flash_partial_grads: 2 kv heads do not divide 3",
    ),
    "grads-lam": (
        lambda m: m.flash_partial_grads(
            q1, k1, q2, k2, v, jnp.ones((2,)), *_stats(2, 32), interpret=True
        ),
        ValueError,
        r"flash_partial_grads: lam must be a scalar",
    ),
    "grads-lam-missing": (
        lambda m: m.flash_partial_grads(q1, k1, q2, k2, v, None, *_stats(2, 32), interpret=True),
        ValueError,
        r"flash_partial_grads: lam is None with q2 given",
    ),
    "grads-dout": (
        lambda m: m.flash_partial_grads(q1, k1, q2, k2, v, 0.5, *_stats(2, 16), interpret=True),
        ValueError,
        r"dout must be \[batch, seq, heads, v_dim\] = \[1, 24, 2, 32\]",
    ),
    "grads-lse2-missing": (
        lambda m: m.flash_partial_grads(q1, k1, q2, k2, v, 0.5, *_stats(2, 32)[:3], interpret=True),
        ValueError,
        r"lse2 must be \[batch, seq, heads\] = \[1, 24, 2\], got None",
    ),
    "grads-lse2-standard": (
        lambda m: m.flash_partial_grads(
            q1, k1, None, None, v, None, *_stats(2, 32), interpret=True
        ),
        ValueError,
        r"lse2 given for standard attention",
    ),
}


def _stats(hq, dv):
    """``(dout, lse1, delta1, lse2, delta2)`` for ``hq`` heads of width ``dv`` (24 queries)."""
    rows = jnp.zeros((1, 24, hq))
    return jnp.zeros((1, 24, hq, dv)), rows, rows, rows, rows


@pytest.mark.usefixtures("no_kernel")
@pytest.mark.parametrize("case", list(BAD_PARTIALS))
def test_the_ring_interface_refuses_alike_on_both_backends(case):
    call, exc, message = BAD_PARTIALS[case]
    seen = {}
    for name, module in (("gpu", gpu), ("tpu", tpu)):
        with pytest.raises(Exception) as info:
            call(module)
        text = str(info.value).replace(f"kernels.{name}.", "kernels.<backend>.")
        seen[name] = (info.type, text.replace(f"pass {name}.", "pass <backend>."))
    assert seen["gpu"] == seen["tpu"], seen
    assert seen["gpu"][0] is exc and re.search(message, seen["gpu"][1]), seen
    assert "Fix: " in seen["gpu"][1]


@pytest.mark.usefixtures("no_kernel")
def test_the_guard_catches_a_kernel_launch():
    """The fixture's own check: a good input reaches a kernel, which the guard refuses (so the
    tests above would fail if a backend launched its kernels before checking)."""
    for module in (gpu, tpu):
        with pytest.raises(AssertionError, match="kernel was launched"):
            module.differential_flash_attention(q1, k1, q2, k2, v, 0.5, interpret=True)


@pytest.mark.usefixtures("no_kernel")
def test_the_other_backends_block_sizes_are_refused_naming_the_right_type():
    with pytest.raises(TypeError, match=r"kernels\.tpu\.BlockSizes or None, got .*gpu\.BlockSizes"):
        tpu.differential_flash_attention(
            q1, k1, q2, k2, v, 0.5, block_sizes=gpu.BlockSizes(), interpret=True
        )
    with pytest.raises(TypeError, match=r"kernels\.gpu\.BlockSizes or None, got .*tpu\.BlockSizes"):
        kernels.flash_attention(
            q1, k1, v, block_sizes=tpu.BlockSizes(), interpret=True, backend="gpu"
        )


@pytest.mark.usefixtures("no_kernel")
def test_a_traced_scale_is_refused_alike():
    def run(module):
        def f(scale):
            return module.flash_attention(q1, k1, v, sm_scale=scale, interpret=True)

        with pytest.raises(TypeError) as info:
            jax.jit(f)(0.25)
        return str(info.value)

    assert run(gpu) == run(tpu)
    assert re.search(r"sm_scale must be a static python number .* got a traced", run(gpu))


@pytest.mark.usefixtures("no_kernel")
def test_compute_capability_is_the_gpu_kernels_own():
    with pytest.raises(ValueError, match=r"compute_capability=\(9, 0\) names a GPU.*TPU.*Fix"):
        tpu.differential_flash_attention(
            q1, k1, q2, k2, v, 0.5, compute_capability=(9, 0), interpret=True
        )
    with pytest.raises(ValueError, match=r"compute_capability must be a \(major, minor\)"):
        gpu.flash_attention(q1, k1, v, compute_capability=(9,), interpret=True)


# ---------------------------------------------------------------------------- o2_dtype
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_o2_dtype_means_the_same_on_both_backends(backend):
    """A bfloat16 O2 residual leaves the output bit for bit as it was and moves d(lam) by
    bfloat16 rounding only (through the public entry point, which passes it on)."""
    a = _inputs(t=32, s=32)
    ct = jax.random.normal(jax.random.key(7), a[0].shape[:3] + (a[4].shape[-1],))

    def out_and_dlam(o2_dtype):
        def f(lam):
            return kernels.differential_flash_attention(
                *a, lam, interpret=True, backend=backend, o2_dtype=o2_dtype
            )

        out, vjp = jax.vjp(f, jnp.float32(0.6))
        return out, vjp(ct)[0]

    out32, dlam32 = out_and_dlam(jnp.float32)
    out16, dlam16 = out_and_dlam(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(out16), np.asarray(out32))
    assert float(dlam16) != float(dlam32)  # the residual really was rounded
    np.testing.assert_allclose(float(dlam16), float(dlam32), rtol=2e-2, atol=2e-2)
