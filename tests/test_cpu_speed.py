"""The CPU speed work (issue 16): the compiler-options helper, the 2-D Linear, and the reference
attention's [B, Hkv, R*T, S] layout and one value product, each against an independent
reference (numpy, or the unchanged library op)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import diffjax
from diffjax.infra import compile_options
from diffjax.kernels import reference
from diffjax.nn.layers import Linear


# ---------------------------------------------------------------------------- compiler options
def test_cpu_compile_options_only_on_cpu():
    assert jax.default_backend() == "cpu"
    assert diffjax.cpu_compile_options() == {compile_options.YNN_FUSION_OPTION: ""}
    assert diffjax.cpu_compile_options("gpu") == {}
    assert diffjax.cpu_compile_options("tpu") == {}


def test_an_option_this_jax_does_not_know_is_detected(monkeypatch):
    assert not compile_options._cpu_knows("xla_cpu_no_such_option_in_any_jax", "")
    monkeypatch.setattr(compile_options, "YNN_FUSION_OPTION", "xla_cpu_no_such_option_in_any_jax")
    assert diffjax.cpu_compile_options("cpu") == {}  # an older/newer jax: no options, no error


def test_options_keep_the_training_gradients():
    """A tiny LM's loss and gradients compiled with and without the options agree."""
    cfg = diffjax.ModelConfig(
        vocab_size=32, d_model=32, num_layers=1, num_heads=2, max_seq_len=16, attention_impl="xla"
    )
    graphdef, params = nnx.split(diffjax.TransformerLM(cfg, rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 32)

    def loss(p):
        logits = nnx.merge(graphdef, p)(tokens)
        return jnp.mean(
            jax.nn.logsumexp(logits, -1)
            - jnp.take_along_axis(logits, tokens[..., None], -1)[..., 0]
        )

    grad = jax.value_and_grad(loss)
    want = jax.jit(grad)(params)
    got = jax.jit(grad, compiler_options=diffjax.cpu_compile_options())(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), got, want)


def test_lazy_jit_builds_with_the_options_at_first_use():
    calls = []

    @compile_options.lazy_jit
    def f(x):
        calls.append(1)
        return x * 2

    assert f._jitted is None  # nothing compiled (nor the backend asked) at definition
    np.testing.assert_array_equal(f(jnp.arange(3.0)), [0.0, 2.0, 4.0])
    assert f.lower(jnp.arange(3.0)).compile() is not None  # jax.jit's methods pass through
    assert f.__name__ == "f" and len(calls) == 1


# ---------------------------------------------------------------------------- Linear
@pytest.mark.parametrize("shape", [(5, 8), (2, 3, 8), (2, 3, 4, 8), (8,)])
def test_linear_on_a_2d_view_equals_nnx_linear(shape):
    kw = dict(use_bias=True, rngs=nnx.Rngs(0))
    ours, theirs = Linear(8, 6, **kw), nnx.Linear(8, 6, **dict(kw, rngs=nnx.Rngs(0)))
    ours.bias[...] = jnp.arange(6.0)
    theirs.bias[...] = jnp.arange(6.0)
    assert jax.tree.structure(nnx.state(ours)) == jax.tree.structure(nnx.state(theirs))
    x = jax.random.normal(jax.random.key(2), shape)
    want = np.asarray(x) @ np.asarray(theirs.kernel[...]) + np.arange(6.0)
    got = ours(x)
    assert got.shape == shape[:-1] + (6,)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, theirs(x), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------- reference layout
def _np_probs(q, k, mask, scale):
    """numpy softmax maps [B, Hq, T, S]; query head i reads kv head i // R; zero rows where a
    query sees no key."""
    r = q.shape[2] // k.shape[2]
    logits = np.einsum("bthd,bshd->bhts", q, np.repeat(k, r, axis=2)) * scale
    z = np.where(mask[:, None], logits, -np.inf)
    zmax = np.max(z, -1, keepdims=True)
    p = np.exp(z - np.where(np.isfinite(zmax), zmax, 0.0))
    den = p.sum(-1, keepdims=True)
    return np.where(den > 0, p / np.where(den > 0, den, 1.0), 0.0)


def _case(seed=0, b=2, t=6, hq=4, hkv=2, d=8, dv=16):
    rng = np.random.default_rng(seed)
    q1, q2 = (rng.normal(size=(b, t, hq, d)).astype(np.float32) for _ in range(2))
    k1, k2 = (rng.normal(size=(b, t, hkv, d)).astype(np.float32) for _ in range(2))
    v = rng.normal(size=(b, t, hkv, dv)).astype(np.float32)
    seg = np.array([[1, 1, 2, 2, 2, 3], [1, 1, 1, 1, 1, 1]], np.int32)
    kv_seg = np.array([[1, 1, 2, 2, 2, 2], [1, 1, 1, 1, 1, 1]], np.int32)  # query 5 sees no key
    causal = np.tril(np.ones((t, t), bool))[None]
    mask = causal & (seg[:, :, None] == kv_seg[:, None, :])
    return (q1, k1, q2, k2, v), seg, kv_seg, mask


@pytest.mark.parametrize("v2", [False, True], ids=["scalar-lambda", "per-row-lambda"])
def test_differential_gqa_one_value_product_against_numpy(v2):
    """``(A1 - lam A2) v`` in the grouped layout (R = 2 query heads per kv head), segment ids
    with a query that sees no key (zero output), a scalar and a [B, T, Hq] lambda."""
    (q1, k1, q2, k2, v), seg, kv_seg, mask = _case()
    lam = (
        np.random.default_rng(1).uniform(size=(2, 6, 4)).astype(np.float32)
        if v2
        else np.float32(0.7)
    )
    got = reference.differential_attention(
        *map(jnp.asarray, (q1, k1, q2, k2, v)), lam, segment_ids=seg, kv_segment_ids=kv_seg
    )
    s = 8**-0.5
    vr = np.repeat(v, 2, axis=2)
    o1 = np.einsum("bhts,bshd->bthd", _np_probs(q1, k1, mask, s), vr)
    o2 = np.einsum("bhts,bshd->bthd", _np_probs(q2, k2, mask, s), vr)
    want = o1 - (lam[..., None] if v2 else lam) * o2
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(got)[0, 5] == 0.0)


def test_standard_gqa_maps_and_output_against_numpy():
    (q, k, _, _, v), seg, kv_seg, mask = _case(seed=3)
    kw = dict(segment_ids=jnp.asarray(seg), kv_segment_ids=jnp.asarray(kv_seg))
    p = _np_probs(q, k, mask, 8**-0.5)
    np.testing.assert_allclose(reference.attention_weights(q, k, **kw), p, rtol=1e-5, atol=1e-7)
    logits, _ = reference.attention_logits(q, k, **kw)
    np.testing.assert_allclose(
        logits,
        np.einsum("bthd,bshd->bhts", q, np.repeat(k, 2, axis=2)) * 8**-0.5,
        rtol=1e-5,
        atol=1e-6,
    )
    np.testing.assert_allclose(
        reference.dot_product_attention(q, k, v, **kw),
        np.einsum("bhts,bshd->bthd", p, np.repeat(v, 2, axis=2)),
        rtol=1e-5,
        atol=1e-6,
    )


def test_bfloat16_one_value_product_stays_near_the_two_product_form():
    """bfloat16: the differential map is rounded once (A1 - lam A2) instead of each map; the
    result stays within bfloat16 rounding of the float32 two-product form."""
    (q1, k1, q2, k2, v), *_ = _case(seed=4, t=6)
    bf = [jnp.asarray(a, jnp.bfloat16) for a in (q1, k1, q2, k2, v)]
    got = reference.differential_attention(*bf, 0.6).astype(jnp.float32)
    up = [np.asarray(a.astype(jnp.float32)) for a in bf]
    mask = np.tril(np.ones((6, 6), bool))[None]
    vr = np.repeat(up[4], 2, axis=2)
    want = np.einsum(
        "bhts,bshd->bthd", _np_probs(up[0], up[1], mask, 8**-0.5), vr
    ) - 0.6 * np.einsum("bhts,bshd->bthd", _np_probs(up[2], up[3], mask, 8**-0.5), vr)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------- the benchmark
def test_step_time_benchmark_runs_on_cpu(capsys, tmp_path):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "step_time.py"
    spec = importlib.util.spec_from_file_location("step_time", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    md = tmp_path / "table.md"
    assert (
        bench.main(
            [
                "--batch",
                "1",
                "--seq",
                "8",
                "--d-model",
                "16",
                "--layers",
                "1",
                "--heads",
                "1",
                "--rounds",
                "1",
                "--steps",
                "1",
                "--components",
                "step",
                "norm",
                "--models",
                "DIFF V1",
                "twin V1",
                "torch DIFF V1",
                "--markdown",
                str(md),
            ]
        )
        == 0
    )
    table = md.read_text()
    assert "| step |" in table and "| norm |" in table
    assert "step DIFF V1 / twin V1:" in table
    try:
        import torch  # noqa: F401
    except ImportError:
        return
    assert "step DIFF V1 / torch DIFF V1:" in table
