"""The one dispatch point: ``impl`` names "xla" or "pallas" ("auto" picks by backend); every
layer routes through it; the reference math imports nothing from diffjax."""

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
    assert ops.check_impl("auto", logit_bits=8) == "xla"  # quantization lives in the reference


def test_unknown_impl_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown attention impl 'nope'.*'auto'"):
        ops.check_impl("nope")
    with pytest.raises(ValueError, match="unknown attention impl"):
        diffjax.MultiheadAttention(32, 0, 2, attention_impl="nope", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="XLA path only.*impl='xla'"):
        ops.check_impl("pallas", logit_bits=8)
    with pytest.raises(ValueError, match="bits must be an integer"):
        ops.check_impl("xla", logit_bits=1)


def test_modules_route_through_the_dispatch(monkeypatch):
    calls = []
    real = {
        "xla_std": reference.dot_product_attention,
        "xla_diff": reference.differential_attention,
    }

    def standard(*a, **kw):
        calls.append("standard")
        return real["xla_std"](*a, **kw)

    def differential(*a, **kw):
        calls.append("differential")
        return real["xla_diff"](*a, **kw)

    monkeypatch.setattr(reference, "dot_product_attention", standard)
    monkeypatch.setattr(reference, "differential_attention", differential)
    x = jax.random.normal(jax.random.key(0), (1, 8, 64))
    for module in (
        diffjax.MultiheadAttention(64, 0, 4, attention_impl="xla", rngs=nnx.Rngs(0)),
        diffjax.MultiheadDiffAttn(64, 0, 2, attention_impl="xla", rngs=nnx.Rngs(0)),
        diffjax.MultiheadDiffAttnV2(64, 2, 1, 16, attention_impl="xla", rngs=nnx.Rngs(0)),
    ):
        module(x)
    assert calls == ["standard", "differential", "differential"]


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
