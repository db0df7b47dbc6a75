"""The one dispatch point: ``impl`` names "xla" or "pallas" ("auto" picks by backend) or is an
object with the two attention functions; every layer routes through it, V2 passing its shared key
explicitly; the reference math imports nothing from diffjax."""

import dataclasses
import types

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from kernel_cases import assert_logit_max, check_logit_max, logit_max_oracle, make_inputs

import diffjax
from diffjax.ops import context
from diffjax import kernels, ops
from diffjax.ops import dispatch
from diffjax.config import ContextSpec
from diffjax.kernels import reference
from diffjax.infra.sharding import MeshConfig, make_mesh


def test_auto_is_xla_on_cpu_and_pallas_on_accelerators():
    want = "pallas" if jax.default_backend() in ("gpu", "tpu") else "xla"
    assert ops.check_impl("auto") == want
    assert ops.check_impl("xla") == "xla" and ops.check_impl("pallas") == "pallas"
    assert ops.check_impl(reference) is reference  # an object with the function attention


def test_unknown_impl_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown attention impl 'nope'.*'auto'"):
        ops.check_impl("nope")
    with pytest.raises(ValueError, match="unknown attention impl"):
        diffjax.MultiheadAttention(32, 0, 2, attention_impl="nope", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"has no function attention. Fix: .*second=\(q2.*'auto'"):
        ops.check_impl(dataclasses.make_dataclass("Half", [])())
    two = types.SimpleNamespace(dot_product_attention=print, differential_attention=print)
    with pytest.raises(ValueError, match="replaces dot_product_attention and differential_"):
        ops.check_impl(two)  # the earlier protocol: the fix names the one function
    with pytest.raises(ValueError, match="bits must be an integer"):
        reference.check_logit_bits(1)


def test_modules_route_through_the_dispatch(monkeypatch):
    calls, shared = [], []
    real = reference.attention

    def attention(q, k, v, *, second=None, **kw):
        calls.append("standard" if second is None else "differential")
        if second is not None:
            shared.append(second[1] is None)  # k2
        return real(q, k, v, second=second, **kw)

    monkeypatch.setattr(reference, "attention", attention)
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

    def attention(self, q, k, v, **kw):
        return 2 * reference.attention(q, k, v, **kw)


@pytest.mark.parametrize("kind", ["standard", "v1", "v2"])
def test_an_implementation_object_runs_in_the_layers(kind):
    """``attention_impl`` may be an object with the one function ``attention(q, k, v, *,
    second, ...)``: the layer's output is then
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


# ---------------------------------------------------------------------------- logit maxes
def _ops_attention(impl, standard, **fixed):
    """``ops``'s function for the kind, in ``check_logit_max``'s calling convention."""

    def attention(*args, return_logit_max, **kw):
        fn = ops.dot_product_attention if standard else ops.differential_attention
        return fn(*args, impl=impl, logit_max=return_logit_max, **kw, **fixed)

    return attention


def _logit_max_case(kind, **kw):
    """GQA 4/2, T > S (under the causal mask the first rows see no key), separate key
    segments, query row 5 in a segment no key has."""
    case = make_inputs(
        3,
        b=2,
        t=16,
        s=12,
        hq=4,
        hkv=2,
        d=8,
        dv=16 if kind == "v1" else 8,
        lam="token" if kind == "v2" else "scalar",
        seg="separate",
        **kw,
    )
    case["segment_ids"] = case["segment_ids"].at[:, 5].set(99)
    return case


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("kind", ["v1", "v2", "standard"])
def test_logit_max_through_the_dispatch(kind, impl):
    """``logit_max=True`` returns ``(out, maxes)``: each map's largest visible logit per row,
    from the XLA path's own logits or the kernels' running max (interpreted here), as numpy
    computes it (-inf for a row that sees no key); ``out`` and every gradient are the call's
    without it, bit for bit. DIFF V1 (k2), V2 (k2 None: map 2 reads k1), standard."""
    standard = kind == "standard"
    maxes = check_logit_max(
        _ops_attention(impl, standard),
        _logit_max_case(kind),
        causal=not standard,
        shared=kind == "v2",
        standard=standard,
    )
    assert maxes.shape == ((1,) if standard else (2,)) + (2, 16, 4)
    assert np.all(np.isneginf(maxes[:, :, 5]))
    if not standard:
        assert np.all(np.isneginf(maxes[:, :, :4]))  # T - S = 4 rows before the first key


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_logit_max_carries_no_gradient(impl):
    """The maxes are diagnostics: a loss on them has zero gradient (their gradient is
    stopped; the kernels' backward ignores their cotangent)."""
    case = _logit_max_case("standard")
    q, k, v = (case[n] for n in ("q1", "k1", "v"))

    def on_maxes(q, k):
        _, maxes = ops.dot_product_attention(q, k, v, impl=impl, logit_max=True)
        return jnp.sum(jnp.where(jnp.isfinite(maxes), maxes, 0.0))

    for g in jax.jit(jax.grad(on_maxes, (0, 1)))(q, k):
        np.testing.assert_array_equal(np.asarray(g), 0.0)


def test_logit_max_refuses_a_custom_implementation():
    """An implementation object keeps its two functions' signature (no maxes): asking it for
    them is a ValueError naming the fix; without the option it runs as before."""
    case = _logit_max_case("v1")
    q1, k1, q2, k2, v = (case[n] for n in ("q1", "k1", "q2", "k2", "v"))
    fix = r"logit_max=True needs a built-in implementation.*Fix: use impl='xla' or impl='pallas'"
    with pytest.raises(ValueError, match=fix + r".*logit_max=False"):
        ops.differential_attention(q1, k1, q2, k2, v, 0.3, impl=_Scaled(), logit_max=True)
    with pytest.raises(ValueError, match=fix):
        ops.dot_product_attention(q1, k1, v, impl=_Scaled(), logit_max=True)
    out = ops.dot_product_attention(q1, k1, v, impl=_Scaled())
    np.testing.assert_array_equal(out, 2 * reference.dot_product_attention(q1, k1, v))
    with pytest.raises(TypeError, match="logit_max must be True or False.*Fix"):
        ops.dot_product_attention(q1, k1, v, impl="xla", logit_max="yes")


def test_without_logit_max_the_dispatch_runs_exactly_the_implementation():
    """The default call is the implementation's own program: the reference math, or the one
    kernel call (its forward with no extra output)."""
    case = _logit_max_case("v1")
    args = tuple(case[n] for n in ("q1", "k1", "q2", "k2", "v", "lam"))
    scale = 8**-0.5
    kw = dict(segment_ids=case["segment_ids"], kv_segment_ids=case["kv_segment_ids"])
    target = ops.current_target()

    def jaxpr(fn):
        return str(
            jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), (0, 1, 2, 3, 4)))(*args)
        )

    assert jaxpr(lambda *a: ops.differential_attention(*a, impl="xla", **kw)) == jaxpr(
        lambda *a: reference.differential_attention(*a, scale=scale, **kw)
    )
    assert jaxpr(lambda *a: ops.differential_attention(*a, impl="pallas", **kw)) == jaxpr(
        lambda *a: kernels.differential_flash_attention(
            *a, sm_scale=scale, **kw, **dispatch._kernel_options(target)
        )
    )


def _spec(sharding, n):
    """A NamedSharding's spec padded to ``n`` dims."""
    spec = tuple(sharding.spec)
    return spec + (None,) * (n - len(spec))


@pytest.mark.parametrize(
    "mesh_shape, impl, spec",
    [
        (dict(data=2, tensor=2), "pallas", None),  # the kernels per shard (shard_map)
        (dict(context=4, tensor=2), "xla", ContextSpec(order="zigzag")),  # the XLA ring
        (dict(data=2, context=2, tensor=2), "pallas", ContextSpec(order="zigzag")),  # kernels
        (dict(context=2, tensor=2), "xla", ContextSpec("allgather", "zigzag")),
    ],
    ids=["pallas-per-shard", "xla-ring", "kernel-ring", "xla-allgather"],
)
def test_logit_max_under_a_mesh_comes_back_like_the_rows(mesh_shape, impl, spec):
    """Under a mesh the maxes are the numpy ones, split like ``out``'s rows: per batch and
    head shard around the kernels, and under a ``context`` axis in the inputs' token order
    (here the zigzag order, with its positions) and sharded over the context axis."""
    size = int(np.prod(list(mesh_shape.values())))
    mesh = make_mesh(MeshConfig(**{"data": 1, **mesh_shape}), devices=jax.devices()[:size])
    case = make_inputs(5, b=2, t=16, s=16, hq=4, hkv=2, d=8, dv=16, seg="shared", n_seg=2)
    seg = np.asarray(case["segment_ids"]).copy()
    seg[:, 6] = 99  # row 6: in no key's segment
    n = mesh_shape.get("context", 1)
    perm = context.zigzag_order(16, n) if n > 1 else np.arange(16)
    names = ("q1", "k1", "q2", "k2", "v")
    args = [case[k][:, perm] for k in names]
    kw = dict(segment_ids=jnp.asarray(seg[:, perm]), kv_segment_ids=case["segment_ids"][:, perm])
    if n > 1:
        kw.update(context=spec, positions=jnp.asarray(perm))

    def run(*a, **opt):
        return ops.differential_attention(*a, 0.3, impl=impl, **kw, **opt)

    with jax.set_mesh(mesh):
        out, maxes = jax.jit(lambda *a: run(*a, logit_max=True))(*args)
        plain = jax.jit(run)(*args)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(plain))
    assert _spec(maxes.sharding, 4)[1:] == _spec(out.sharding, 4)[:3]
    assert _spec(maxes.sharding, 4)[3] == "tensor"  # heads split over the tensor axis
    if n > 1:
        assert _spec(maxes.sharding, 4)[2] == "context"
    inv = context.inverse_order(perm)
    want = np.stack(
        [
            logit_max_oracle(
                case[q], case[k], scale=8**-0.5, segment_ids=seg, kv_segment_ids=case["segment_ids"]
            )
            for q, k in (("q1", "k1"), ("q2", "k2"))
        ]
    )
    assert_logit_max(np.asarray(maxes)[:, :, inv], want)
    assert np.all(np.isneginf(want[:, :, 6]))
