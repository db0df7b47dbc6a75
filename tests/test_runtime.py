"""How a run executes: :class:`diffjax.infra.runtime.Runtime` and the one :class:`ContextSpec` that
carries sequence parallelism (implementation, token order, axis) from the run to the batches
and the model; each allowed value list and each default defined once."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import jax
import numpy as np
import pytest
from flax import nnx

from diffjax import ModelConfig, TransformerLM
from diffjax.infra import sharding
from diffjax.config import (
    KERNEL_ORDERS,
    NATURAL_ORDER,
    RUN_TOKEN_ORDER,
    TOKEN_ORDERS,
    ConfigError,
    ContextSpec,
)
from diffjax.nn.model import with_context
from diffjax.infra.runtime import Runtime
from diffjax.kernels import reference
from diffjax.train.step import model_inputs

SRC = pathlib.Path(__file__).parent.parent / "diffjax"
TINY = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=1, max_seq_len=32)


def test_a_context_spec_refuses_unknown_values_with_the_fix():
    assert ContextSpec() == ContextSpec("ring", NATURAL_ORDER, "context")
    with pytest.raises(ConfigError, match=r"ContextSpec.impl: unknown .* 'tree'.*Fix: use one"):
        ContextSpec(impl="tree")
    with pytest.raises(ConfigError, match=r"ContextSpec.order: unknown .* 'spiral'.*Fix: use one"):
        ContextSpec(order="spiral")
    assert set(KERNEL_ORDERS) < set(TOKEN_ORDERS) and RUN_TOKEN_ORDER in KERNEL_ORDERS


def test_each_context_value_list_and_default_is_defined_once():
    """The lists of orders and implementations, and the order defaults, are written in
    diffjax/config.py alone; everything else imports them."""
    lists = {
        "token orders": r"\(\s*\"zigzag\",\s*\"striped\",\s*\"contiguous\"\s*\)",
        "kernel orders": r"\(\s*\"zigzag\",\s*\"contiguous\"\s*\)",
        "implementations": r"\(\s*\"ring\",\s*\"allgather\"\s*\)",
        "an order default": r"order: str = \"(zigzag|contiguous|striped)\"",
    }
    for what, pattern in lists.items():
        where = [
            str(p.relative_to(SRC))
            for p in sorted(SRC.rglob("*.py"))
            for _ in re.finditer(pattern, p.read_text())
        ]
        allowed = [] if what == "an order default" else ["config.py"]
        assert where == allowed, f"{what}: {where}"


def test_nothing_is_set_on_a_built_model():
    """No module sets attributes on a model after it is built (a model built otherwise is built
    again: ``with_context``, ``rebuilt``): neither ``set_attributes`` nor an assignment to a
    layer's ``attention_impl``, ``context`` or ``target`` outside its own constructor."""
    assigned = re.compile(r"\b(?!self\b)\w+\.(attention_impl|context|target) = ")  # code, not text
    hits = [
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if "set_attributes(" in p.read_text() or assigned.search(p.read_text())
    ]
    assert hits == []


def test_the_model_is_built_with_its_spec_and_refuses_another_implementation():
    model = TransformerLM(TINY, rngs=nnx.Rngs(0))
    assert model.context == ContextSpec(impl=TINY.context_attention)
    assert all(b.attn.context == model.context for b in model.blocks())
    spec = ContextSpec(order="zigzag")
    built = TransformerLM(TINY, rngs=nnx.Rngs(0), context=spec)
    assert all(b.attn.context == spec for b in built.blocks())
    with pytest.raises(ConfigError, match=r"ContextSpec.impl: 'allgather' differs .*Fix"):
        TransformerLM(TINY, rngs=nnx.Rngs(0), context=ContextSpec(impl="allgather"))
    scanned = TransformerLM(TINY.replace(scan_layers=True), rngs=nnx.Rngs(0), context=spec)
    assert scanned.layers.attn.context == spec and scanned.blocks()[1].attn.context == spec


def test_with_context_copies_the_parameters_and_leaves_the_model_alone():
    model = TransformerLM(TINY, rngs=nnx.Rngs(1))
    spec = ContextSpec(order="zigzag")
    other = with_context(model, spec)
    assert other is not model and model.context.order == NATURAL_ORDER
    assert other.context == spec
    x = np.arange(16, dtype=np.int32).reshape(1, 16) % 64
    np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(other(x)))
    assert with_context(other, spec) is other


def test_a_runtime_takes_the_platform_from_its_devices_and_the_spec_from_the_configs():
    mesh = sharding.make_mesh(sharding.MeshConfig(data=1), jax.devices()[:1])
    runtime = Runtime(mesh)
    assert runtime.platform == "cpu" and runtime.context == ContextSpec()
    assert runtime.context_size == 1
    cfg = sharding.MeshConfig(data=1, context=2, context_order="striped")
    two = sharding.make_mesh(cfg, jax.devices()[:2])
    run = Runtime.of(TINY.replace(context_attention="allgather"), cfg, two)
    assert run.context == ContextSpec("allgather", "striped", "context") and run.context_size == 2
    with pytest.raises(ValueError, match=r"Runtime.platform: unknown platform 'metal'"):
        Runtime(mesh, platform="metal")


def test_for_runtime_builds_for_the_runtimes_target_and_spec_and_nothing_else():
    from diffjax.config import KernelTarget
    from diffjax.nn.model import for_runtime

    model = TransformerLM(TINY, rngs=nnx.Rngs(1))
    one = Runtime(sharding.make_mesh(sharding.MeshConfig(data=1), jax.devices()[:1]))
    assert for_runtime(model, one) is model  # this CPU, no sequence split: nothing to rebuild
    cfg = sharding.MeshConfig(data=1, context=2, context_order="zigzag")
    two = Runtime.of(TINY, cfg, sharding.make_mesh(cfg, jax.devices()[:2]))
    split = for_runtime(model, two)
    assert split.context == two.context and model.context.order == NATURAL_ORDER
    tpu = for_runtime(model, Runtime(one.mesh, platform="tpu"))
    assert tpu.target == KernelTarget("tpu") and model.target == KernelTarget("cpu")
    assert nnx.to_pure_dict(nnx.state(tpu)).keys() == nnx.to_pure_dict(nnx.state(model)).keys()


def test_generation_takes_a_runtime_and_gives_the_tokens_of_one_device(monkeypatch):
    """On a data mesh, and on a context mesh whose runs lay batches out in zigzag order: the
    prompt's prefill runs over the context axis, taking the prompt in its natural order."""
    from diffjax.ops import context
    from diffjax import generate

    real, rings = context.context_attention, []
    monkeypatch.setattr(
        context, "context_attention", lambda *a, **k: rings.append(1) or real(*a, **k)
    )
    model = TransformerLM(TINY, rngs=nnx.Rngs(2))
    prompt = np.arange(16, dtype=np.int32).reshape(2, 8) * 3 % 64
    want = np.asarray(generate(model, prompt, 6, length_bucket=8))
    data = Runtime(sharding.make_mesh(sharding.MeshConfig(data=2), jax.devices()[:2]))
    cfg = sharding.MeshConfig(data=1, context=2, context_order="zigzag")
    split = Runtime.of(TINY, cfg, sharding.make_mesh(cfg, jax.devices()[:2]))
    for runtime in (data, split):
        got = generate(model, prompt, 6, length_bucket=8, runtime=runtime)
        np.testing.assert_array_equal(np.asarray(got), want)
        assert bool(rings) == (runtime is split)


def test_model_inputs_lay_the_tokens_out_in_the_runtimes_order():
    """On a context axis of 2 the inputs come out in the runtime's order, with their positions;
    the same batch under the natural order keeps the data's order."""
    from diffjax.ops import context

    mesh = sharding.make_mesh(sharding.MeshConfig(data=1, context=2), jax.devices()[:2])
    batch = {"inputs": np.arange(16, dtype=np.int32).reshape(2, 8)}
    for order in TOKEN_ORDERS:
        runtime = Runtime(mesh, ContextSpec(order=order))
        got = np.asarray(model_inputs(batch, runtime, 2)["inputs"])
        perm = context.token_order(8, 2, order)
        np.testing.assert_array_equal(got, batch["inputs"][:, perm])


def test_the_kernel_target_is_data_resolved_at_construction():
    """Where attention is traced for travels as data: "auto" resolves for the target, a layer
    built by hand takes this process's backend when it is built, a run its devices'."""
    from diffjax import ops
    from diffjax.config import KernelTarget

    assert KernelTarget("cpu").resolve("auto") == "xla"
    assert ops.check_impl("auto", KernelTarget("tpu")) == "pallas"
    assert KernelTarget("gpu", (8, 0)).kernel == "gpu" and not KernelTarget("gpu").interpret
    assert KernelTarget("tpu").kernel == "tpu" and KernelTarget("cpu").interpret
    with pytest.raises(ConfigError, match=r"KernelTarget.platform: unknown platform 'npu'"):
        KernelTarget("npu")
    model = TransformerLM(TINY, rngs=nnx.Rngs(0))
    assert model.blocks()[0].attn.target == ops.current_target() == KernelTarget("cpu")
    mesh = sharding.make_mesh(sharding.MeshConfig(data=1), jax.devices()[:1])
    assert Runtime(mesh).kernel_target == KernelTarget("cpu")
    h100 = Runtime(mesh, platform="gpu", compute_capability=(9, 0))
    assert h100.kernel_target == KernelTarget("gpu", (9, 0))


def test_the_planner_and_the_benchmarks_patch_nothing():
    """The planner passes its target as data, and no benchmark replaces a function of jax or
    diffjax to observe or slow it: no assignment to an attribute of an imported module (the old
    ways: patching jax.default_backend and the GPU capability while tracing, the storage reads
    and the loop's batch stream in the data benchmark)."""
    import ast

    source = (SRC / "plan.py").read_text()
    assert not re.search(r"jax\.default_backend\s*=", source)
    assert "_device_capability" not in source and "gpu_kernels" not in source
    for path in [SRC / "plan.py", *sorted((SRC.parent / "benchmarks").glob("*.py"))]:
        tree = ast.parse(path.read_text())
        imported = {
            (a.asname or a.name).split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for a in node.names
        }
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name):
                    assert t.value.id not in imported, (path.name, ast.unparse(t))
        assert "setattr(" not in path.read_text().replace("__setattr__(", ""), path.name


@dataclasses.dataclass(frozen=True)
class _Counted:
    """An implementation object: the reference math, noting the query length of each traced
    call."""

    seen: list = dataclasses.field(default_factory=list, hash=False, compare=False)

    def attention(self, q, k, v, **kw):
        self.seen.append(q.shape[1])
        return reference.attention(q, k, v, **kw)


def test_the_traced_steps_run_what_the_runtime_decided(monkeypatch):
    """The run's Runtime decides the attention once, for the calls the run makes (training with
    the diagnostics, evaluation, a decoded token); the compiled train and eval steps run what
    it holds and choose nothing while tracing."""
    from diffjax import ops
    from diffjax.data import DataConfig
    from diffjax.data.documents import mark_documents
    from diffjax.ops import dispatch
    from diffjax.train import TrainConfig
    from diffjax.train.config import ExperimentConfig
    from diffjax.train.setup import compile_steps, model_setup, run_runtime

    mesh = sharding.make_mesh(sharding.MeshConfig(data=1), jax.devices()[:1])
    tcfg = TrainConfig(batch_size=2, diagnostics=True)
    exp = ExperimentConfig(model=TINY, data=DataConfig(seq_len=16), train=tcfg)
    runtime = run_runtime(exp, TINY, mesh)
    calls = ops.model_calls(TINY, 16, segments=True, logit_max=True)  # text: documents apart
    assert [c for c, _, _ in runtime.attention.calls] == list(calls)
    assert [c.logit_max for c in calls] == [True, False, False] and calls[2].decoding
    assert runtime.attention.describe() == ("xla", "the XLA math on a CPU")
    counted = _Counted()
    planted = tuple((c, counted, "planted") for c in calls)
    runtime = dataclasses.replace(
        runtime, attention=dataclasses.replace(runtime.attention, calls=planted)
    )
    decoded = dataclasses.replace(calls[2], kv_len=40)  # any cache length
    assert runtime.attention.implementation(decoded) is counted
    monkeypatch.setattr(dispatch, "choose", lambda *a: pytest.fail(f"chose again: {a}"))
    tokens = np.arange(34, dtype=np.int32).reshape(2, 17) % 64
    rows = [mark_documents(16, np.array([5, 12])) for _ in range(2)]
    host = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    host.update({k: np.stack([r[k] for r in rows]) for k in rows[0]})
    with runtime.activate():
        setup = model_setup(TINY, tcfg, runtime)
        state, rest = setup.fresh_state()
        batch = model_inputs(host, runtime, 2)
        train_fn, eval_fn = compile_steps(setup, state, rest, batch)
        eval_fn(jax.device_put(state["params"], setup.state_sh["params"]), batch)
    assert counted.seen and set(counted.seen) == {16}


def test_the_runtime_not_the_ambient_mesh_splits_the_sequence(monkeypatch):
    """A model built by hand runs whole sequences under any mesh; built for a Runtime whose
    mesh has a context axis, the ring: the same logits."""
    from diffjax.nn.model import for_runtime
    from diffjax.ops import context

    calls, real = [], context.context_attention
    monkeypatch.setattr(
        context, "context_attention", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    cfg = sharding.MeshConfig(data=1, context=2, context_order="contiguous")
    mesh = sharding.make_mesh(cfg, jax.devices()[:2])
    model = TransformerLM(TINY, rngs=nnx.Rngs(0))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    nnx.update(model, jax.device_put(nnx.state(model), replicated))
    tokens = np.arange(32, dtype=np.int32).reshape(2, 16) % 64
    with jax.set_mesh(mesh):
        whole = model(tokens)
    assert calls == []
    runtime = Runtime.of(TINY, cfg, mesh)
    with runtime.activate():
        split = for_runtime(model, runtime)(tokens)
    assert calls
    np.testing.assert_allclose(np.asarray(split), np.asarray(whole), atol=1e-5, rtol=1e-5)


def test_what_serves_the_ring_is_decided_once_and_a_fallback_is_said():
    """ "auto" on a GPU runs the ring's blocks on the kernels where they can serve the order,
    else on the XLA math, and says so; a vendor's attention cannot be the blocks: refused with
    the fix; an implementation object runs whole sequences, and that is said too."""
    from diffjax import ops
    from diffjax.config import KernelTarget

    gpu = KernelTarget("gpu", (9, 0))
    assert ops.resolve("auto", gpu, context=ContextSpec(order="zigzag")).blocks == "pallas"
    striped = ops.resolve("auto", gpu, context=ContextSpec(order="striped"))
    assert striped.blocks == "xla" and "order striped" in striped.describe()[1]
    with pytest.raises(
        ValueError, match=r"cannot be the blocks .*Fix: model.attention_impl=pallas"
    ):
        ops.resolve("cudnn", gpu, context=ContextSpec())
    whole = ops.resolve(_Counted(), gpu, context=ContextSpec())
    assert whole.context is None and "runs whole sequences" in whole.describe()[1]
