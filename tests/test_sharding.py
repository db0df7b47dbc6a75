"""Meshes and partitioning (diffjax.infra.sharding) on 8 CPU devices (tests/conftest.py).

- every parameter carries the logical axes it should, and lands on the devices the rules say;
- the Adam moments are sharded like the parameters;
- DIFF pairs are never split by tensor parallelism;
- one training step on a mesh equals the step on one device (loss, gradients' norm, updated
  parameters) for pure data, pure fsdp, fsdp x tensor and data x fsdp x tensor;
- the Pallas kernel runs per shard (``shard_map``) and matches the XLA path;
- bad meshes are refused before any compute, with the fix.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from diffjax import ModelConfig, TransformerLM, ops
from diffjax.infra import sharding
from diffjax.config import ConfigError
from diffjax.infra.sharding import DEFAULT_RULES, MeshConfig, make_mesh
from diffjax.train import TrainConfig
from diffjax.train.setup import make_state_init
from diffjax.train.step import train_step
from diffjax.train.optimizer import learning_rate_schedule, make_optimizer

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs JAX_NUM_CPU_DEVICES=8")

MESHES = {
    "data": MeshConfig(data=8),
    "fsdp": MeshConfig(data=1, fsdp=8),
    "fsdp_x_tensor": MeshConfig(data=1, fsdp=4, tensor=2),
    "data_x_fsdp_x_tensor": MeshConfig(data=2, fsdp=2, tensor=2),
}

# What each parameter must carry (independent of the code: the layout the issue asks for).
EXPECTED_AXES = {
    "embed/embedding": ("vocab", "embed"),
    "lm_head/kernel": ("embed", "vocab"),
    "attn/q_proj/kernel": ("embed", "heads"),
    "attn/k_proj/kernel": ("embed", "kv_heads"),
    "attn/v_proj/kernel": ("embed", "kv_heads"),
    "attn/out_proj/kernel": ("heads", "embed"),
    "attn/lambda_proj/kernel": ("embed", "heads"),
    "ffn/w1/kernel": ("embed", "mlp"),
    "ffn/w3/kernel": ("embed", "mlp"),
    "ffn/w2/kernel": ("mlp", "embed"),
    "scale": ("norm",),
    "lambda_q1": ("head_dim",),
    "lambda_k1": ("head_dim",),
    "lambda_q2": ("head_dim",),
    "lambda_k2": ("head_dim",),
}
# The mesh axes each logical name may use (the layout), in order.
EXPECTED_MESH_AXES = {
    "embed": ("fsdp",),
    "vocab": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "norm": (),
    "head_dim": (),
}


def tiny(attention="diff_v1", **kw) -> ModelConfig:
    base = dict(
        vocab_size=256,
        d_model=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        attention=attention,
        max_seq_len=32,
        ffn_multiple_of=32,
    )
    base.update(kw)
    return ModelConfig(**base)


def path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def expected_axes(path: str):
    for suffix, axes in EXPECTED_AXES.items():
        if path.endswith(suffix):
            return axes
    raise AssertionError(f"no expected annotation for {path}")


def expected_spec(axes, shape, mesh) -> P:
    """Independent of sharding.logical_to_spec: each name's mesh axes, kept while they divide."""
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    out = []
    for name, dim in zip(axes, shape):
        taken, prod = [], 1
        for ax in EXPECTED_MESH_AXES[name]:
            if dim % (prod * sizes[ax]) == 0:
                taken.append(ax)
                prod *= sizes[ax]
        out.append(None if not taken else taken[0] if len(taken) == 1 else tuple(taken))
    return P(*out)


def shards_equal(a: NamedSharding, spec: P, ndim: int) -> bool:
    return a.is_equivalent_to(NamedSharding(a.mesh, spec), ndim)


def var_leaves(tree):
    return [
        (path_str(p), v)
        for p, v in jax.tree_util.tree_flatten_with_path(
            tree, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )[0]
    ]


# ---------------------------------------------------------------------------- the mesh config
@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(data=0), "mesh.data"),
        (dict(fsdp=-2), "mesh.fsdp"),
        (dict(data=-1, fsdp=-1), "at most one axis"),
        (dict(tensor=True), "mesh.tensor"),
    ],
)
def test_mesh_config_rejects_bad_sizes(kw, message):
    with pytest.raises(ConfigError, match=message):
        MeshConfig(**kw)


def test_mesh_shapes_resolve_and_mismatches_name_the_fix():
    assert MeshConfig().shape(8) == (8, 1, 1, 1)
    assert MeshConfig(fsdp=-1).shape(8) == (1, 8, 1, 1)  # data's default steps aside
    assert MeshConfig(data=-1, tensor=2).shape(8) == (4, 1, 1, 2)
    assert MeshConfig(data=1, fsdp=-1, tensor=4).shape(8) == (1, 2, 1, 4)
    assert MeshConfig(context=4).shape(8) == (2, 1, 4, 1)  # data takes the rest
    assert MeshConfig(data=1, context=-1).shape(8) == (1, 1, 8, 1)
    with pytest.raises(ConfigError, match="does not divide the 8 devices"):
        MeshConfig(data=-1, tensor=3).shape(8)
    with pytest.raises(ConfigError, match="make the product 8"):
        MeshConfig(data=2, fsdp=2, tensor=1).shape(8)
    with pytest.raises(
        ConfigError, match="mesh.context_order to one of zigzag, striped, contiguous"
    ):
        MeshConfig(context=2, context_order="spiral")
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    assert mesh.axis_names == ("data", "fsdp", "context", "tensor")
    assert mesh.devices.shape == (2, 2, 1, 2)
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_logical_to_spec_uses_each_mesh_axis_once_and_only_when_it_divides():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    to = sharding.logical_to_spec
    assert to(("batch", None), (8, 3), mesh) == P(("data", "fsdp"))
    assert to(("batch", None), (2, 3), mesh) == P("data")  # fsdp would not divide 2 rows / 2
    assert to(("vocab", "embed"), (259, 64), mesh) == P(None, "fsdp")  # 259: replicated
    assert to(("embed", "embed"), (64, 64), mesh) == P("fsdp")  # an axis at most once
    with pytest.raises(ValueError, match="no rule"):
        to(("nonsense",), (4,), mesh)


def test_check_model_mesh_refuses_splitting_a_diff_pair_and_uneven_batches():
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=4))
    with pytest.raises(ConfigError, match="never splits a DIFF pair"):
        sharding.check_model_mesh(tiny(num_heads=2, num_kv_heads=None), mesh)
    with pytest.raises(ConfigError, match="kv heads"):
        sharding.check_model_mesh(tiny(num_heads=4, num_kv_heads=2), mesh)
    sharding.check_model_mesh(tiny(num_heads=4, num_kv_heads=4), mesh, 8)
    with pytest.raises(ConfigError, match="batch_size=3 is not divisible by data x fsdp = 2"):
        sharding.check_model_mesh(tiny(num_heads=4, num_kv_heads=4), mesh, 3)


def test_train_cli_refuses_a_bad_mesh_before_compute(tmp_path, capsys):
    from diffjax.compare.cli import EXIT_BAD_INPUT, main

    code = main(
        [f"run.dir={tmp_path / 'run'}", "mesh.tensor=4", "mesh.data=-1", "train.progress=false"]
    )  # the default DIFF model has 2 heads
    assert code == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "mesh.tensor=4" in err and "Fix:" in err
    assert not (tmp_path / "run" / "diff").exists()


# ---------------------------------------------------------------------------- placement
def sharded_state(model_cfg, mesh, tcfg=None):
    tcfg = tcfg or TrainConfig(lr=1e-2, warmup_steps=0, weight_decay=0.1)
    init = make_state_init(model_cfg, tcfg)
    with jax.set_mesh(mesh):
        abstract, _ = jax.eval_shape(init)
        shardings = sharding.tree_shardings(abstract, mesh)
        state, rest = jax.jit(init, out_shardings=(shardings, None))()
    return state, rest, shardings


@pytest.mark.parametrize("attention", ["diff_v1", "diff_v2", "standard"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_every_parameter_is_placed_as_annotated(attention, mesh_name):
    cfg = tiny(
        attention,
        num_heads=8 if attention == "standard" else 4,
        num_kv_heads=4 if attention == "standard" else 2,
        tie_embeddings=False,
    )
    mesh = make_mesh(MESHES[mesh_name])
    state, _, _ = sharded_state(cfg, mesh)
    params = var_leaves(state["params"])
    assert params
    for path, var in params:
        axes = sharding.logical_axes(var)
        assert axes == expected_axes(path), path
        arr = var.get_value()
        spec = expected_spec(axes, arr.shape, mesh)
        assert shards_equal(arr.sharding, spec, arr.ndim), (path, arr.sharding.spec, spec)
        sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
        want = tuple(
            d // math.prod(sizes[a] for a in ((s,) if isinstance(s, str) else s or ()))
            for d, s in zip(arr.shape, tuple(spec) + (None,) * arr.ndim)
        )
        assert arr.addressable_shards[0].data.shape == want, path
    # the Adam moments (mu, nu) are sharded exactly like the parameters
    by_path = {p: v.get_value().sharding for p, v in params}
    moments = [(p, v) for p, v in var_leaves(state["opt_state"]) if isinstance(v, nnx.Variable)]
    assert len(moments) >= 2 * len(params)
    for path, var in moments:
        param_path = next(p for p in by_path if path.endswith(p))
        assert var.get_value().sharding.is_equivalent_to(
            by_path[param_path], var.get_value().ndim
        ), path


@pytest.mark.parametrize("attention", ["diff_v1", "diff_v2"])
def test_tensor_parallelism_keeps_diff_pairs_and_kv_groups_whole(attention):
    """Each device's columns of q_proj are whole pairs (2 raw heads for V1, 2 query heads for
    V2), and the kv heads they attend to are on the same device."""
    cfg = tiny(attention, num_heads=4, num_kv_heads=2)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    state, _, _ = sharded_state(cfg, mesh)
    attn = state["params"]["layers"][0]["attn"]
    q, k = attn["q_proj"]["kernel"].get_value(), attn["k_proj"]["kernel"].get_value()
    h, hkv = cfg.num_heads, cfg.kv_heads
    pair = q.shape[1] // h  # columns per DIFF head (2 x head width)
    group = k.shape[1] // hkv  # columns per kv group (V1: K1 and K2; V2: one key)
    for shard_q in q.addressable_shards:
        cols = shard_q.index[1]
        start, stop = cols.start or 0, cols.stop or q.shape[1]
        assert start % pair == 0 and (stop - start) % pair == 0
        heads = range(start // pair, stop // pair)
        groups = {i // (h // hkv) for i in heads}
        shard_k = next(s for s in k.addressable_shards if s.device == shard_q.device)
        kstart = shard_k.index[1].start or 0
        kstop = shard_k.index[1].stop or k.shape[1]
        assert groups == set(range(kstart // group, kstop // group))


# ---------------------------------------------------------------------------- one step
_INITIAL: dict = {}


def initial_state(model_cfg, tcfg, tx):
    """The initial state on the host, made once per (config, optimizer kind)."""
    key = (model_cfg, tcfg, type(tx).__name__, id(tx) if tx is not None else None)
    if key not in _INITIAL:
        init = make_state_init(model_cfg, tcfg, tx)
        with jax.default_device(jax.devices()[0]):
            state, rest = jax.jit(init)()
        _INITIAL[key] = (jax.device_get(state), rest, jax.eval_shape(init)[0])
    return _INITIAL[key]


def one_step(model_cfg, mesh, batch, tcfg, tx=None):
    """(loss, grad norm, updated params as host arrays) after one step on ``mesh``, from the
    same initial state placed by the annotations."""
    host, rest, abstract = initial_state(model_cfg, tcfg, tx)
    tx = make_optimizer(tcfg) if tx is None else tx
    schedule = learning_rate_schedule(tcfg)
    shardings = sharding.tree_shardings(abstract, mesh)
    state = jax.device_put(host, shardings)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(model_cfg, rngs=nnx.Rngs(0))))
    with jax.set_mesh(mesh), nnx.logical_axis_rules(DEFAULT_RULES):
        gb = sharding.global_batch(batch, mesh, batch["inputs"].shape[0])
        step = jax.jit(
            functools.partial(train_step, graphdef=graphdef, rest=rest, tx=tx, schedule=schedule),
            in_shardings=(shardings, {k: v.sharding for k, v in gb.items()}),
            out_shardings=(shardings, NamedSharding(mesh, P())),
        )
        new, metrics = step(state, gb)
    params = {p: np.asarray(v.get_value()) for p, v in var_leaves(new["params"])}
    return float(metrics["loss"]), float(metrics["grad_norm"]), params


def random_batch(cfg, b=8, t=32, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (b, t + 1)).astype(np.int32)
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "weights": np.ones((b, t), np.float32),
    }


# Tolerances. A mesh only reorders float32 sums (across devices), so:
# - loss and gradient norm: relative 1e-6 (seen: <= 2e-7);
# - a plain gradient step (SGD, lr 1): every parameter within 1e-6 (seen: ~1e-8);
# - the real AdamW step: the mean parameter difference within 1e-5 lr (seen: ~1e-6 lr), no
#   element off by more than 0.25 lr (seen: 0.1 lr). Adam's first step is lr g / (|g| + eps),
#   so a parameter whose gradient is nearly 0 turns reduction-order noise into a visible step
#   difference; a wrong sharding would move whole tensors by ~lr.
LOSS_RTOL, SGD_ATOL, ADAM_MEAN, ADAM_MAX = 1e-6, 1e-6, 1e-5, 0.25
SGD = optax.sgd(1.0)


# DIFF V1 on all four meshes (and a plain gradient step on the 3-axis one); V2 and the twin on
# the two tensor-parallel meshes; the Pallas kernels per shard on the 3-axis mesh.
TENSOR_MESHES = ("fsdp_x_tensor", "data_x_fsdp_x_tensor")
STEP_CASES = [
    ("diff_v1", "xla", tuple(MESHES), True),
    ("diff_v2", "xla", TENSOR_MESHES, False),
    ("standard", "xla", TENSOR_MESHES, False),
    ("diff_v1", "pallas", ("data_x_fsdp_x_tensor",), False),
    ("diff_v2", "pallas", ("data_x_fsdp_x_tensor",), False),
]


@pytest.mark.parametrize(
    "attention, impl, meshes, check_sgd", STEP_CASES, ids=[f"{a}-{i}" for a, i, *_ in STEP_CASES]
)
def test_one_step_on_each_mesh_equals_one_device(attention, impl, meshes, check_sgd):
    cfg = tiny(
        attention,
        attention_impl=impl,
        num_heads=8 if attention == "standard" else 4,
        num_kv_heads=4 if attention == "standard" else 2,
    )
    tcfg = TrainConfig(lr=1e-2, warmup_steps=0, weight_decay=0.1, seed=3)
    batch = random_batch(cfg)
    one = make_mesh(MeshConfig(data=1), devices=jax.devices()[:1])
    sgd = SGD
    ref_loss, ref_norm, ref_params = one_step(cfg, one, batch, tcfg)
    ref_sgd = one_step(cfg, one, batch, tcfg, sgd)[2] if check_sgd else None
    for name in meshes:
        mesh = make_mesh(MESHES[name])
        loss, norm, params = one_step(cfg, mesh, batch, tcfg)
        np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL, err_msg=name)
        np.testing.assert_allclose(norm, ref_norm, rtol=LOSS_RTOL, err_msg=name)
        assert params.keys() == ref_params.keys()
        diffs = np.concatenate([np.abs(params[p] - ref_params[p]).ravel() for p in params])
        assert diffs.mean() <= ADAM_MEAN * tcfg.lr, (name, diffs.mean())
        assert diffs.max() <= ADAM_MAX * tcfg.lr, (name, diffs.max())
        if check_sgd and name == "data_x_fsdp_x_tensor":
            _, _, stepped = one_step(cfg, mesh, batch, tcfg, sgd)
            for p in stepped:
                np.testing.assert_allclose(
                    stepped[p], ref_sgd[p], atol=SGD_ATOL, rtol=0, err_msg=f"{name}: {p}"
                )


# ---------------------------------------------------------------------------- Pallas per shard
@pytest.mark.parametrize("shared_key", [False, True])
def test_pallas_runs_per_shard_and_matches_xla(shared_key):
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=4))
    rng = np.random.default_rng(1)
    b, t, h, hkv, d = 4, 32, 8, 4, 16
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    q1, q2, k1, v = f(b, t, h, d), f(b, t, h, d), f(b, t, hkv, d), f(b, t, hkv, 2 * d)
    k2 = k1 if shared_key else f(b, t, hkv, d)
    lam = jax.nn.sigmoid(f(b, t, h))

    def loss(q1, k1, q2, k2, v, lam, impl):
        k2 = None if shared_key else k2  # DIFF V2: both maps read k1
        o = ops.differential_attention(q1, k1, q2, k2, v, lam, causal=True, impl=impl)
        return jnp.sum(o * jnp.cos(o)), o

    grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True)
    with jax.set_mesh(mesh):
        args = [
            jax.device_put(x, NamedSharding(mesh, s))
            for x, s in zip(
                (q1, k1, q2, k2, v, lam),
                (P("data", None, "tensor"),) * 5 + (P("data", None, "tensor"),),
            )
        ]
        jaxpr = str(jax.make_jaxpr(lambda *a: loss(*a, "pallas"))(*args))
        assert "shard_map" in jaxpr and "pallas_call" in jaxpr
        gp, op = jax.jit(lambda *a: grad(*a, "pallas"))(*args)
        gx, ox = jax.jit(lambda *a: grad(*a, "xla"))(*args)
    np.testing.assert_allclose(op, ox, rtol=1e-5, atol=1e-5)
    for a, b_ in zip(gp, gx):
        np.testing.assert_allclose(a, b_, rtol=1e-4, atol=1e-4)


def test_without_a_mesh_nothing_changes():
    x = jnp.ones((3, 5, 7))
    assert sharding.constrain(x, "act_batch", "act_seq", "act_embed") is x
