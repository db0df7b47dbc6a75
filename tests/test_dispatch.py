"""The one dispatch point: ``impl`` names "xla" or "pallas" ("auto" picks by backend) or is an
object with the two attention functions; every layer routes through it, V2 passing its shared key
explicitly; the reference math imports nothing from diffjax."""

import dataclasses

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import diffjax
from diffjax import ops
from diffjax.kernels import reference


def test_auto_is_xla_on_cpu_and_pallas_on_accelerators():
    want = "pallas" if jax.default_backend() in ("gpu", "tpu") else "xla"
    assert ops.check_impl("auto") == want
    assert ops.check_impl("xla") == "xla" and ops.check_impl("pallas") == "pallas"
    assert ops.check_impl(reference) is reference  # an object with the two functions


def test_unknown_impl_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown attention impl 'nope'.*'auto'"):
        ops.check_impl("nope")
    with pytest.raises(ValueError, match="unknown attention impl"):
        diffjax.MultiheadAttention(32, 0, 2, attention_impl="nope", rngs=nnx.Rngs(0))
    with pytest.raises(
        ValueError, match="has no dot_product_attention or differential_attention.*'auto'"
    ):
        ops.check_impl(dataclasses.make_dataclass("Half", [])())
    with pytest.raises(ValueError, match="bits must be an integer"):
        reference.check_logit_bits(1)


def test_modules_route_through_the_dispatch(monkeypatch):
    calls, shared = [], []
    real = {
        "xla_std": reference.dot_product_attention,
        "xla_diff": reference.differential_attention,
    }

    def standard(*a, **kw):
        calls.append("standard")
        return real["xla_std"](*a, **kw)

    def differential(*a, **kw):
        calls.append("differential")
        shared.append(a[3] is None)  # k2
        return real["xla_diff"](*a, **kw)

    monkeypatch.setattr(reference, "dot_product_attention", standard)
    monkeypatch.setattr(reference, "differential_attention", differential)
    x = jax.random.normal(jax.random.key(0), (1, 8, 64))
    for module in (
        diffjax.MultiheadAttention(64, 0, 4, attention_impl="xla", rngs=nnx.Rngs(0)),
        diffjax.MultiheadDiffAttn(64, 0, 2, attention_impl="xla", rngs=nnx.Rngs(0)),
        diffjax.MultiheadDiffAttnV2(
            64, 0, 2, 1, head_dim=16, attention_impl="xla", rngs=nnx.Rngs(0)
        ),
    ):
        module(x)
    assert calls == ["standard", "differential", "differential"]
    assert shared == [False, True]  # V1 has K2; V2's maps share one key, passed as k2=None


@dataclasses.dataclass(frozen=True)
class _Scaled:
    """An implementation object: the reference math with every output doubled."""

    def dot_product_attention(self, q, k, v, **kw):
        return 2 * reference.dot_product_attention(q, k, v, **kw)

    def differential_attention(self, q1, k1, q2, k2, v, lam, **kw):
        return 2 * reference.differential_attention(q1, k1, q2, k2, v, lam, **kw)


@pytest.mark.parametrize("kind", ["standard", "v1", "v2"])
def test_an_implementation_object_runs_in_the_layers(kind):
    """``attention_impl`` may be an object with the two functions: the layer's output is then
    its out_proj of what the object returns (here the reference doubled: V1 without its
    per-head norm, which would undo the factor)."""
    x = jax.random.normal(jax.random.key(0), (1, 8, 64))
    build = {
        "standard": lambda impl: diffjax.MultiheadAttention(
            64, 0, 4, attention_impl=impl, rngs=nnx.Rngs(0)
        ),
        "v1": lambda impl: diffjax.MultiheadDiffAttn(
            64, 0, 2, attention_impl=impl, norm=False, rngs=nnx.Rngs(0)
        ),
        "v2": lambda impl: diffjax.MultiheadDiffAttnV2(
            64, 0, 2, 1, head_dim=16, attention_impl=impl, rngs=nnx.Rngs(0)
        ),
    }[kind]
    plain, scaled = build("xla")(x), build(_Scaled())(x)
    np.testing.assert_allclose(np.asarray(scaled), 2 * np.asarray(plain), rtol=1e-5, atol=1e-6)


def test_xla_and_auto_agree_on_cpu():
    key = jax.random.split(jax.random.key(1), 5)
    q1, q2 = (jax.random.normal(k, (2, 6, 4, 8)) for k in key[:2])
    k1, k2 = (jax.random.normal(k, (2, 6, 2, 8)) for k in key[2:4])
    v = jax.random.normal(key[4], (2, 6, 2, 16))
    a = ops.differential_attention(q1, k1, q2, k2, v, 0.3, impl="xla")
    b = ops.differential_attention(q1, k1, q2, k2, v, 0.3, impl="auto")
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    out = ops.dot_product_attention(q1, k1, v, impl="xla")
    assert out.shape == (2, 6, 4, 16) and out.dtype == jnp.float32


def test_the_kernels_import_only_the_reference_math():
    """Data flows one way: ops -> kernels -> reference; reference imports only jax/numpy and
    the kernel files import nothing from diffjax outside the kernels package (relative imports:
    the reference math and helpers beside them)."""
    root = pathlib.Path(diffjax.__file__).parent / "kernels"
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                assert node.level == 1 or not mod.startswith("diffjax"), (path.name, mod)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith("diffjax"), (path.name, alias.name)
        if path.name == "reference.py":
            mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
            mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            assert mods <= {"__future__", "jax", "jax.numpy", "numpy"}, mods
