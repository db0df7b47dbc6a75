"""Scan over layers and rematerialization: the same function as the unrolled model without
remat, for every attention kind (MHA and GQA), through the converters both ways."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from diffjax import ModelConfig
from diffjax.config import REMAT_POLICIES, ConfigError
from diffjax.nn.model import TransformerLM, sown_lambdas, stack_layers, unstack_layers
from diffjax.train.checkpoint import check_same_model
from tiny import tiny_run

KINDS = [  # V1, V2 and the twin; MHA and GQA
    ("diff_v1", 2, None),
    ("diff_v1", 2, 1),
    ("diff_v2", 2, 1),
    ("standard", 4, 2),
]


def _config(kind, heads, kv, **kw):
    return ModelConfig(
        attention=kind,
        num_layers=3,
        d_model=64,
        num_heads=heads,
        num_kv_heads=kv,
        vocab_size=61,
        max_seq_len=16,
        attention_impl="xla",
        **kw,
    )


def _batch():
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 61)
    targets = jnp.roll(tokens, -1, axis=1)
    weights = jnp.ones(tokens.shape).at[:, :5].set(0.0)  # answer-only style weights
    return tokens, targets, weights


def _loss_and_grads(model):
    tokens, targets, weights = _batch()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        logits = nnx.merge(graphdef, params, rest)(tokens)
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
        return jnp.sum(ce * weights) / jnp.sum(weights)

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return value, nnx.to_pure_dict(grads)


def _stacked(tree, n):
    """The unrolled layers' ``{0: ..., 1: ...}`` stacked like a scanned model's."""
    return jax.tree.map(lambda *a: np.stack(a), *[tree[i] for i in range(n)])


@pytest.mark.parametrize(
    "kind,heads,kv",
    # V1 MHA, V2 GQA, the twin GQA by default; V1 GQA with -m exhaustive
    [KINDS[0], pytest.param(*KINDS[1], marks=pytest.mark.exhaustive), *KINDS[2:]],
)
def test_scanned_model_is_the_unrolled_model(kind, heads, kv):
    unrolled = TransformerLM(_config(kind, heads, kv), rngs=nnx.Rngs(0))
    scanned = stack_layers(unrolled)
    assert scanned.config.scan_layers and scanned.config.replace(scan_layers=False) == (
        unrolled.config
    )
    tokens, _, _ = _batch()
    np.testing.assert_allclose(scanned(tokens), unrolled(tokens), rtol=1e-6, atol=1e-6)

    loss_u, grads_u = _loss_and_grads(unrolled)
    loss_s, grads_s = _loss_and_grads(scanned)
    np.testing.assert_allclose(loss_s, loss_u, rtol=1e-6)
    grads_u["layers"] = _stacked(grads_u["layers"], 3)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads_s, grads_u
    )

    # each layer's lambda, sown and (V1) from the parameters, in layer order
    _, sown_u = nnx.capture(lambda m, t: m(t), nnx.Intermediate)(unrolled, tokens)
    _, sown_s = nnx.capture(lambda m, t: m(t), nnx.Intermediate)(scanned, tokens)
    np.testing.assert_allclose(sown_lambdas(sown_s), sown_lambdas(sown_u), rtol=1e-6)
    assert len(sown_lambdas(sown_s)) == (0 if kind == "standard" else 3)
    if kind == "diff_v1":
        np.testing.assert_allclose(scanned.lambdas(), unrolled.lambdas(), rtol=1e-6)

    # back again: the same parameters, and blocks() gives layer i of either layout
    back = unstack_layers(scanned)
    jax.tree.map(
        np.testing.assert_array_equal,
        nnx.to_pure_dict(nnx.state(back)),
        nnx.to_pure_dict(nnx.state(unrolled)),
    )
    x = jax.random.normal(jax.random.key(2), (1, 8, 64))
    for a, b in zip(scanned.blocks(), unrolled.blocks(), strict=True):
        np.testing.assert_allclose(a(x), b(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["diff_v1", "diff_v2"])
def test_generate_with_scanned_layers(kind):
    """Decoding with a KV cache: the scanned model's one stacked cache gives the unrolled
    model's tokens (greedy)."""
    from diffjax import generate
    from diffjax.nn.decode import init_cache

    unrolled = TransformerLM(_config(kind, 2, None), rngs=nnx.Rngs(0))
    scanned = stack_layers(unrolled)
    prompt = jnp.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    np.testing.assert_array_equal(
        generate(scanned, prompt, max_new_tokens=6), generate(unrolled, prompt, max_new_tokens=6)
    )
    cache = init_cache(scanned, 2, 12)
    assert len(cache.layers) == 1 and cache.max_length == 12
    assert cache.nbytes == init_cache(unrolled, 2, 12).nbytes


def test_scanned_v1_keeps_the_depth_schedule():
    """lambda_init(depth) is per-layer data: layer i of a scanned V1 model has layer i's."""
    scanned = TransformerLM(_config("diff_v1", 2, None, scan_layers=True), rngs=nnx.Rngs(0))
    values = scanned.layers.attn.lambda_init[...]
    np.testing.assert_allclose(values, [0.8 - 0.6 * np.exp(-0.3 * i) for i in range(3)], 1e-6)
    fixed = TransformerLM(
        _config("diff_v1", 2, None, scan_layers=True, lambda_init=0.5), rngs=nnx.Rngs(0)
    )
    np.testing.assert_array_equal(fixed.layers.attn.lambda_init[...], [0.5] * 3)
    # the stacked parameters carry the "layers" logical axis first
    kernel = scanned.layers.attn.q_proj.kernel
    assert kernel.shape[0] == 3 and kernel.get_metadata()["out_sharding"][0] == "layers"


@pytest.mark.parametrize(
    "kind,heads,kv,scan",
    [(*KINDS[1], True), (*KINDS[2], True), (*KINDS[3], True), (*KINDS[0], False)],
)
def test_remat_policies_do_not_change_loss_or_gradients(kind, heads, kv, scan):
    base = TransformerLM(_config(kind, heads, kv, scan_layers=scan), rngs=nnx.Rngs(0))
    loss0, grads0 = _loss_and_grads(base)
    for policy in REMAT_POLICIES[1:]:
        if policy == "minimal_offload" and jax.default_backend() == "cpu":
            continue  # host offload needs a device memory separate from the host's
        model = nnx.merge(*nnx.split(base))  # the same parameters
        model.config = base.config.replace(remat=policy)
        loss, grads = _loss_and_grads(model)
        np.testing.assert_allclose(loss, loss0, rtol=1e-7, err_msg=policy)
        jax.tree.map(
            lambda a, b, p=policy: np.testing.assert_allclose(
                a, b, rtol=1e-6, atol=1e-7, err_msg=p
            ),
            grads,
            grads0,
        )


def test_remat_saves_what_its_policy_names():
    """The policies really differ: XLA's temporaries for the train step's gradient shrink from
    none to full (a wrong policy, or remat not applied, keeps them equal)."""
    sizes = {}
    cfg = _config("diff_v1", 2, None, scan_layers=True).replace(num_layers=4, max_seq_len=128)
    tokens = jnp.zeros((8, 128), jnp.int32)
    for policy in ("none", "dots", "full"):
        model = TransformerLM(cfg.replace(remat=policy), rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(params, graphdef=graphdef, rest=rest):
            return jnp.mean(nnx.merge(graphdef, params, rest)(tokens))

        compiled = jax.jit(jax.grad(loss)).lower(params).compile()
        sizes[policy] = compiled.memory_analysis().temp_size_in_bytes
    assert sizes["full"] < sizes["dots"] < sizes["none"], sizes


def test_unknown_policy_and_layout_mismatch_are_refused():
    with pytest.raises(ConfigError, match=r"ModelConfig.remat: unknown .*'selective'.*'full'"):
        ModelConfig(remat="selective")
    saved = ModelConfig(scan_layers=False).to_dict()
    with pytest.raises(ConfigError, match="unstack_layers|stack_layers"):
        check_same_model(saved, ModelConfig(scan_layers=True).to_dict(), "runs/x")
    # how a model is run may change between a save and a resume
    check_same_model(saved, ModelConfig(remat="full", attention_impl="xla").to_dict(), "runs/x")
    with pytest.raises(ValueError, match="already stacked"):
        stack_layers(
            TransformerLM(_config("standard", 4, None, scan_layers=True), rngs=nnx.Rngs(0))
        )


def test_per_layer_analyses_read_a_scanned_model_by_layer_index():
    """Maps, outliers and lambdas of a scanned (and rematerialized) model equal the unrolled
    model's, layer by layer."""
    from diffjax.evaluate.outliers import activation_outliers
    from diffjax.evaluate.probe import layer_attention_maps

    unrolled = TransformerLM(_config("diff_v1", 2, None), rngs=nnx.Rngs(0))
    scanned = stack_layers(unrolled)
    scanned.config = scanned.config.replace(remat="full")
    tokens, _, _ = _batch()
    for layer in (0, 2):
        a, b = (
            layer_attention_maps(scanned, tokens, layer),
            layer_attention_maps(unrolled, tokens, layer),
        )
        np.testing.assert_allclose(a["diff"], b["diff"], rtol=1e-5, atol=1e-6)
    a, b = activation_outliers(scanned, tokens), activation_outliers(unrolled, tokens)
    for kind in ("attention logits", "hidden states"):
        np.testing.assert_allclose(a[kind]["top-1"], b[kind]["top-1"], rtol=1e-5)


def test_interop_and_hf_with_scanned_layers(tmp_path):
    """The official per-layer state dicts go into and out of a scanned model's stacked layer
    by index; a Hugging Face checkpoint saved from a scanned model loads into either layout."""
    from diffjax.interop import hf
    from diffjax.interop.unilm import load_unilm_state_dict, unilm_state_dict

    unrolled = TransformerLM(_config("diff_v1", 2, None), rngs=nnx.Rngs(0))
    scanned = TransformerLM(_config("diff_v1", 2, None, scan_layers=True), rngs=nnx.Rngs(7))
    for i in range(3):
        load_unilm_state_dict(
            scanned.layers.attn, unilm_state_dict(unrolled.layers[i].attn), layer=i
        )
        got = unilm_state_dict(scanned.layers.attn, layer=i)
        for name, value in unilm_state_dict(unrolled.layers[i].attn).items():
            np.testing.assert_array_equal(got[name], value)
    with pytest.raises(ValueError, match="pass layer=i"):
        load_unilm_state_dict(scanned.layers.attn, unilm_state_dict(unrolled.layers[0].attn))
    with pytest.raises(ValueError, match="leave layer out"):
        unilm_state_dict(unrolled.layers[0].attn, layer=0)

    tokens, _, _ = _batch()
    hf.save_pretrained(stack_layers(unrolled), str(tmp_path / "ckpt"))
    for scan in (False, True):
        loaded = hf.from_pretrained(str(tmp_path / "ckpt"), attention_impl="xla", scan_layers=scan)
        assert loaded.config.scan_layers is scan
        np.testing.assert_allclose(loaded(tokens), unrolled(tokens), rtol=1e-5, atol=1e-5)


def test_a_scanned_run_trains_resumes_restores_and_evaluates(tmp_path, capsys):
    """train.py with scanned, rematerialized layers: the resumed losses equal the first pass bit
    for bit; the checkpoint restores onto another mesh with the same logits; resuming it as
    unrolled is refused naming the converter; the quick evaluation reads it layer by layer."""
    import shutil

    from diffjax.compare.cli import main
    from diffjax.evaluate import EvalSettings, evaluate_run
    from diffjax.infra.sharding import MeshConfig, make_mesh
    from diffjax.train.checkpoint import load_model
    from diffjax.train.metrics import read_metrics

    args = [
        f"run.dir={tmp_path / 'run'}",
        *tiny_run(
            "model.num_layers=2",
            "model.num_heads=2",
            "model.scan_layers=true",
            "model.remat=minimal",
            "train.steps=4",
            "train.eval_every=2",
            "train.checkpoint_every=2",
            "mesh.fsdp=2",
            "compare.twins=",
            drop=("train.tensorboard",),
        ),
    ]
    run = tmp_path / "run" / "diff" / "seed_0"
    losses = lambda: [r["loss"] for r in read_metrics(str(run / "metrics.jsonl"))]  # noqa: E731
    assert main(args) == 0
    first = losses()
    shutil.rmtree(run / "checkpoints" / "4")
    assert main(args + ["model.remat=full"]) == 0  # another policy: the same numbers
    assert "resuming from the checkpoint at step 2" in capsys.readouterr().out
    assert losses() == first

    tokens = jnp.arange(32, dtype=jnp.int32).reshape(2, 16) % 259
    model = load_model(str(run), "latest")
    assert model.config.scan_layers
    on_mesh = load_model(str(run), "latest", mesh=make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)))
    np.testing.assert_allclose(on_mesh(tokens), model(tokens), rtol=1e-5, atol=1e-5)

    assert main(args + ["model.scan_layers=false"]) == 2
    err = capsys.readouterr().err
    assert "scan_layers" in err and "stack_layers" in err

    settings = dataclasses.replace(
        EvalSettings.for_run(True), bits=(8,), retrieval_examples=4, val_examples=4
    )
    text = evaluate_run(str(tmp_path / "run"), settings=settings, log=lambda *_: None)
    assert "Attention allocation" in text or "Activation outliers" in text


def test_a_run_converted_to_the_other_layout_resumes_with_the_same_losses(tmp_path, capsys):
    """python -m diffjax.train.convert: an unrolled run's step-2 checkpoint copied into the
    scanned layout (Adam moments and data position included) resumes to the losses of the
    unrolled run, and back again; the source is untouched and a taken destination refused."""
    from diffjax.compare.cli import main
    from diffjax.train.convert import main as convert_main
    from diffjax.train.metrics import read_metrics

    def args(name, *extra):
        return [
            f"run.dir={tmp_path / name}",
            *tiny_run(
                "model.num_layers=2",
                "model.num_heads=2",
                "train.eval_every=2",
                "train.checkpoint_every=2",
                "compare.twins=",
                *extra,
                drop=("train.tensorboard",),
            ),
        ]

    def losses(name):
        path = tmp_path / name / "diff" / "seed_0" / "metrics.jsonl"
        return [r["loss"] for r in read_metrics(str(path))]

    assert main(args("full", "train.steps=4")) == 0
    assert main(args("half", "train.steps=2")) == 0
    src, dst = (tmp_path / n / "diff" / "seed_0" for n in ("half", "scanned"))
    assert convert_main([str(src), str(dst)]) == 0
    assert main(args("scanned", "train.steps=4", "model.scan_layers=true")) == 0
    np.testing.assert_allclose(losses("scanned"), losses("full"), rtol=1e-6)
    assert losses("half") == losses("full")[:2]  # the source run is unchanged

    back = tmp_path / "back" / "diff" / "seed_0"
    assert convert_main([str(dst), str(back)]) == 0
    assert main(args("back", "train.steps=6")) == 0
    assert len(losses("back")) == 6
    assert convert_main([str(src), str(dst)]) == 2
    assert "nothing is overwritten" in capsys.readouterr().err
