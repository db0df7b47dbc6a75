"""The one dispatch point: implementations plug in by name; 'auto' picks by backend."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import diffjax
from diffjax import ops


@pytest.fixture
def fake_impl():
    """A registered implementation that records its calls and defers to the XLA path."""
    calls = []

    def standard(q, k, v, **kw):
        calls.append("standard")
        return ops.dot_product_attention_xla(q, k, v, **kw)

    def differential(q1, k1, q2, k2, v, lam, **kw):
        calls.append("differential")
        return ops.differential_attention_xla(q1, k1, q2, k2, v, lam, **kw)

    impl = ops.AttentionImpl("fake", standard, differential,
                             backends=(jax.default_backend(),), priority=100)
    ops.register_attention_impl(impl)
    yield calls
    ops._IMPLS.pop("fake")


def test_xla_is_registered_and_auto_is_xla_on_cpu():
    assert "xla" in ops.available_impls()
    if jax.default_backend() == "cpu":
        assert ops.resolve_impl("auto").name == "xla"


def test_unknown_impl_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown attention impl 'nope'.*'auto'"):
        ops.resolve_impl("nope")
    with pytest.raises(ValueError, match="unknown attention impl"):
        diffjax.MultiheadAttention(32, 0, 2, attention_impl="nope", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="'auto' is reserved"):
        ops.register_attention_impl(ops.AttentionImpl("auto", None, None))


def test_modules_route_through_the_registered_impl(fake_impl):
    x = jax.random.normal(jax.random.key(0), (1, 8, 64))
    for module in (diffjax.MultiheadAttention(64, 0, 4, attention_impl="fake", rngs=nnx.Rngs(0)),
                   diffjax.MultiheadDiffAttn(64, 0, 2, attention_impl="fake", rngs=nnx.Rngs(0)),
                   diffjax.MultiheadDiffAttnV2(64, 2, 1, 16, attention_impl="fake",
                                               rngs=nnx.Rngs(0))):
        module(x)
    assert fake_impl == ["standard", "differential", "differential"]


def test_auto_picks_the_highest_priority_impl_for_the_backend(fake_impl):
    assert ops.resolve_impl("auto").name == "fake"
    q = jnp.ones((1, 4, 2, 8))
    ops.dot_product_attention(q, q, q, impl="auto")
    assert fake_impl == ["standard"]


def test_same_result_through_any_registered_name(fake_impl):
    key = jax.random.split(jax.random.key(1), 5)
    q1, q2 = (jax.random.normal(k, (2, 6, 4, 8)) for k in key[:2])
    k1, k2 = (jax.random.normal(k, (2, 6, 2, 8)) for k in key[2:4])
    v = jax.random.normal(key[4], (2, 6, 2, 16))
    a = ops.differential_attention(q1, k1, q2, k2, v, 0.3, impl="xla")
    b = ops.differential_attention(q1, k1, q2, k2, v, 0.3, impl="fake")
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
