"""The kernels' public entry point and their place in the model: dispatch, errors, and the whole
LM with ``attention_impl="pallas"`` (interpreted on CPU) against ``"xla"``, loss and gradients.
The kernels' own value/gradient grids are in test_kernels_gpu.py and test_kernels_tpu.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import diffjax
from diffjax import kernels, ops


def _inputs(b=1, t=24, hq=2, hkv=1, d=16, dv=32, dtype=jnp.float32):
    key = jax.random.split(jax.random.key(0), 5)
    q1, q2 = (jax.random.normal(k, (b, t, hq, d), dtype) for k in key[:2])
    k1, k2 = (jax.random.normal(k, (b, t, hkv, d), dtype) for k in key[2:4])
    v = jax.random.normal(key[4], (b, t, hkv, dv), dtype)
    return q1, k1, q2, k2, v


def test_auto_stays_xla_on_cpu_and_is_pallas_on_accelerators():
    if jax.default_backend() == "cpu":
        assert ops.check_impl("auto") == "xla"
    else:
        assert ops.check_impl("auto") == "pallas"


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU-only behaviour")
def test_cpu_without_interpret_says_how_to_run():
    q1, k1, q2, k2, v = _inputs()
    with pytest.raises(ValueError, match="compile only for GPU and TPU.*interpret=True"):
        kernels.differential_flash_attention(q1, k1, q2, k2, v, 0.5)
    with pytest.raises(ValueError, match="no Pallas kernel for backend 'metal'"):
        kernels.differential_flash_attention(
            q1, k1, q2, k2, v, 0.5, interpret=True, backend="metal"
        )


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: (*a[:4], a[4][..., :24]), r"v's head dim must equal q/k's \(16\) or be twice"),
        (lambda a: (a[0], a[1], a[2][:, :, :1], *a[3:]), r"q1 and q2 must have the same shape"),
        (lambda a: (a[0][..., :8], *a[1:]), r"head dims differ"),
    ],
)
def test_bad_shapes_are_named_before_any_kernel_runs(change, message):
    args = change(_inputs())
    with pytest.raises(ValueError, match=message):
        kernels.differential_flash_attention(*args, 0.5, interpret=True)


def test_bad_lambda_shape():
    with pytest.raises(ValueError, match=r"lam must be a scalar or \[batch, seq, heads\]"):
        kernels.differential_flash_attention(*_inputs(), jnp.ones((3,)), interpret=True)


# On a GPU, XLA and the kernels run float32 dots as TF32 unless asked for more; the tight
# comparisons below are of the math, so they ask for full float32 (a no-op on CPU).
full_float32 = pytest.mark.usefixtures("highest_matmul_precision")


@pytest.fixture
def highest_matmul_precision():
    with jax.default_matmul_precision("highest"):
        yield


@full_float32
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_entry_point_matches_reference(backend):
    q1, k1, q2, k2, v = _inputs()
    got = kernels.differential_flash_attention(
        q1, k1, q2, k2, v, 0.7, interpret=True, backend=backend
    )
    want = kernels.reference.differential_attention(q1, k1, q2, k2, v, 0.7)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    got = kernels.flash_attention(q1, k1, v, interpret=True, backend=backend)
    want = kernels.reference.dot_product_attention(q1, k1, v)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


LM_CASES = {
    "diff_v1": dict(attention="diff_v1", num_heads=2, num_kv_heads=1),
    "diff_v2": dict(attention="diff_v2", num_heads=2, num_kv_heads=1),
    "standard": dict(attention="standard", num_heads=4, num_kv_heads=2),
}


@full_float32
@pytest.mark.parametrize("kind", list(LM_CASES))
def test_lm_with_pallas_equals_xla_loss_and_gradients(kind):
    """The whole LM: the same loss and parameter gradients through the kernels (interpreted on
    CPU) as through the XLA path, segments included."""
    common = dict(vocab_size=64, d_model=64, num_layers=2, max_seq_len=40, **LM_CASES[kind])
    tokens = jax.random.randint(jax.random.key(1), (2, 40), 0, 64)
    segments = jnp.concatenate([jnp.zeros((2, 25), jnp.int32), jnp.ones((2, 15), jnp.int32)], 1)

    def loss_and_grads(impl):
        model = diffjax.TransformerLM(
            diffjax.ModelConfig(attention_impl=impl, **common), rngs=nnx.Rngs(0)
        )
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(p):
            m = nnx.merge(graphdef, p, rest)
            logits = m(tokens[:, :-1], segment_ids=segments[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        return jax.jit(jax.value_and_grad(loss))(params)

    (l_x, g_x), (l_p, g_p) = loss_and_grads("xla"), loss_and_grads("pallas")
    np.testing.assert_allclose(float(l_p), float(l_x), rtol=1e-6)
    flat_x = jax.tree_util.tree_leaves_with_path(g_x)
    flat_p = dict(jax.tree_util.tree_leaves_with_path(g_p))
    for path, gx in flat_x:
        gp = flat_p[path]
        scale = float(jnp.max(jnp.abs(gx))) + 1e-12
        np.testing.assert_allclose(
            np.asarray(gp),
            np.asarray(gx),
            atol=2e-5 * scale + 1e-7,
            err_msg=jax.tree_util.keystr(path),
        )
