"""Training with the sequence split over a ``context`` mesh axis (8 CPU devices): the same
losses as without it, resumable across context sizes, bad settings refused before compute."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from diffjax.ops import context
from diffjax.compare.cli import main
from diffjax.train.metrics import read_metrics
from tiny import tiny_run

# A tiny experiment (tests/test_train.py's), 20 steps; DIFF V1 beside its twin.
TINY = tiny_run(
    "model.num_layers=2",
    "model.num_heads=2",
    "train.eval_batches=2",
    "train.steps=20",
    "train.eval_every=10",
    "train.checkpoint_every=10",
)
RTOL = 1e-5  # float32 sums in another order across devices


def _losses(run, label="diff"):
    return np.array(
        [r["loss"] for r in read_metrics(str(run / label / "seed_0" / "metrics.jsonl"))]
    )


def _val(run, label="diff"):
    return [
        r["val_loss"]
        for r in read_metrics(str(run / label / "seed_0" / "metrics.jsonl"))
        if "val_loss" in r
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The run without a context axis (8 devices data-parallel)."""
    run = tmp_path_factory.mktemp("context_1") / "run"
    assert main([f"run.dir={run}", *TINY]) == 0
    return run


@pytest.mark.parametrize(
    "mesh",
    [
        ["mesh.context=4"],  # data takes the other 2 devices; ring, zigzag
        [
            "mesh.data=1",
            "mesh.fsdp=2",
            "mesh.context=2",
            "mesh.tensor=2",
            "mesh.context_order=striped",
            "model.context_attention=allgather",
        ],
        ["mesh.data=1", "mesh.context=8", "mesh.context_order=contiguous"],
    ],
    ids=[
        "data2-context4-ring-zigzag",
        "fsdp2-context2-tensor2-allgather-striped",
        "context8-ring-contiguous",
    ],
)
def test_training_with_a_context_axis_gives_the_same_losses(reference, tmp_path, mesh, monkeypatch):
    calls, real = {}, context.context_attention

    def counted(*a, **k):
        kind = "standard" if k.get("second") is None else "diff"
        calls[kind] = calls.get(kind, 0) + 1  # at trace time
        return real(*a, **k)

    monkeypatch.setattr(context, "context_attention", counted)
    run = tmp_path / "run"
    assert main([f"run.dir={run}", *TINY, *mesh]) == 0
    # both models attended through the sequence-parallel path (traced at least once each)
    assert calls.get("diff") and calls.get("standard")
    for label in ("diff", "standard"):
        np.testing.assert_allclose(
            _losses(run, label), _losses(reference, label), rtol=RTOL, err_msg=label
        )
        np.testing.assert_allclose(
            _val(run, label), _val(reference, label), rtol=RTOL, err_msg=label
        )


def test_the_kernel_ring_trains_the_same_losses(reference, tmp_path, monkeypatch):
    """``model.attention_impl=pallas mesh.context=4``: the ring's blocks run the fused kernels
    (interpreted on CPU) in the zigzag order, and the DIFF model trains the losses of the run
    without a context axis (the twin's kernel ring: tests/test_context.py)."""
    from diffjax.kernels import gpu

    calls = []
    real = gpu.flash_partials
    monkeypatch.setattr(gpu, "flash_partials", lambda *a, **k: calls.append(1) or real(*a, **k))
    run = tmp_path / "run"
    pallas = ["model.attention_impl=pallas", "mesh.context=4", "train.kernel_check=off"]
    assert main([f"run.dir={run}", *TINY, *pallas, "compare.twins="]) == 0
    assert calls  # the kernels' partials were traced
    np.testing.assert_allclose(_losses(run), _losses(reference), rtol=RTOL)
    np.testing.assert_allclose(_val(run), _val(reference), rtol=RTOL)


def test_a_checkpoint_saved_with_one_context_size_resumes_with_another(reference, tmp_path, capsys):
    run = tmp_path / "run"
    args = [f"run.dir={run}", *TINY, "compare.twins="]
    assert main([*args, "mesh.context=4"]) == 0
    shutil.rmtree(run / "diff" / "seed_0" / "checkpoints" / "20")
    capsys.readouterr()
    assert main([*args, "mesh.context=2"]) == 0
    assert "resuming from the checkpoint at step 10" in capsys.readouterr().out
    np.testing.assert_allclose(_losses(run), _losses(reference), rtol=RTOL)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["mesh.context=4", "data.seq_len=12"], "data.seq_len"),
        (["mesh.context=3"], "context=3"),
        (["mesh.context_order=spiral"], "mesh.context_order"),
        (["model.context_attention=tree"], "context_attention"),
        (
            ["mesh.context=2", "model.attention_impl=pallas", "mesh.context_order=striped"],
            "mesh.context_order=zigzag",
        ),
        (
            ["mesh.context=2", "model.attention_impl=pallas", "model.context_attention=allgather"],
            "model.context_attention=ring",
        ),
    ],
)
def test_bad_context_settings_are_refused_before_compute(tmp_path, capsys, extra, message):
    run = tmp_path / "run"
    assert main([f"run.dir={run}", *TINY, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Fix" in err
    assert not (run / "diff").exists()


# ---------------------------------------------------------------------------- evaluation
def test_predictions_on_a_context_mesh_equal_one_device():
    """diffjax.evaluate's forward (losses_and_predictions) with the sequence split over 8
    devices in each order: the losses and predictions of one device, in the data's order."""
    import jax
    from flax import nnx

    from diffjax import ModelConfig, TransformerLM
    from diffjax.infra import sharding
    from diffjax.evaluate.long_context import replicate
    from diffjax.infra.runtime import Runtime
    from diffjax.evaluate.probe import losses_and_predictions

    cfg = ModelConfig(
        vocab_size=64, d_model=32, num_layers=2, num_heads=2, max_seq_len=64, attention="diff_v2"
    )
    model = TransformerLM(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, (3, 65))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    ref_loss, ref_pred = losses_and_predictions(model, batch, batch_size=2)
    for order in ("zigzag", "striped", "contiguous"):
        mesh_cfg = sharding.MeshConfig(context=8, context_order=order)
        runtime = Runtime.of(cfg, mesh_cfg)
        loss, pred = losses_and_predictions(replicate(model, runtime.mesh), batch, 2, runtime)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6, err_msg=order)
        np.testing.assert_array_equal(pred, ref_pred, err_msg=order)
        assert model.context.order == "contiguous"  # the model given is never changed
    # under a mesh set by the caller, the model's own order (a model built by hand: natural)
    mesh = sharding.make_mesh(sharding.MeshConfig(context=8))
    with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.DEFAULT_RULES):
        loss, pred = losses_and_predictions(replicate(model, mesh), batch, 2)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(pred, ref_pred)


@pytest.fixture(scope="module")
def needle_run(tmp_path_factory):
    """A needle-task run (configs/needle.py, tiny and briefly trained): DIFF and its twin."""
    import os

    run = tmp_path_factory.mktemp("needle") / "run"
    config = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "needle.py")
    tiny = ["model.d_model=32", "model.num_layers=1", "train.batch_size=8", "train.steps=4"]
    tiny += ["train.eval_every=4", "train.checkpoint_every=4", "train.eval_batches=1"]
    tiny += ["train.warmup_steps=2", "train.progress=false", "compare.seeds=1"]
    tiny += ["compare.quick_eval=false", "compare.throughput_rounds=0", "train.tensorboard=false"]
    assert main(["--config", config, f"run.dir={run}", *tiny]) == 0
    return run


def test_evaluate_long_context_on_a_run(needle_run, capsys):
    """``python -m diffjax.evaluate RUN long_context.lengths=... mesh.context=8``: the grid of every model
    at each length, the accuracy of the single-device evaluation, long_context.md beside."""
    import json

    from diffjax.evaluate.__main__ import main as evaluate_main

    reference = needle_run
    args = [str(reference), "long_context.lengths=128,256", "mesh.context=8"]
    assert evaluate_main([*args, "long_context.examples=4"]) == 0
    out = json.loads((reference / "long_context.json").read_text())
    assert out["lengths"] == [128, 256] and out["mesh"]["context"] == 8
    assert {(m["label"], m["seed"]) for m in out["models"]} == {("diff", 0), ("standard", 0)}
    md = (reference / "long_context.md").read_text()
    assert "| 256 |" in md and "DIFF − twin" in md
    # every query of every example counted (a tiny model's near-tied logits make the accuracy
    # itself no test of the split: the forward's equality is tested above on untied logits)
    for m in out["models"]:
        assert np.asarray(m["grid"]["total"]).sum(1).tolist() == [4 * 16, 4 * 16]
        assert all(0.0 <= a <= 1.0 for a in m["accuracy"])
    # the noise floor at each length, from the answer rows' maps under the ring: the numbers
    # one device gives on the same examples
    from diffjax.evaluate import allocation, retrieval
    from diffjax.evaluate.inputs import run_needle_task
    from diffjax.evaluate.run import data_config, read_run_config
    from diffjax.train.checkpoint import load_model

    assert "## The noise floor at each length" in md
    data = data_config(read_run_config(str(reference)))
    for m in out["models"]:
        assert [x["length"] for x in m["noise_measured"]] == [128, 256]
        model = load_model(str(reference / m["label"] / "seed_0"), "best")
        batch = retrieval.task_examples(
            run_needle_task(
                data, 256, data.needle.num_needles, data.needle.num_queries, num_examples=4, seed=1
            )
        )
        want = allocation.measured_noise_floor(model, batch, batch_size=1)
        got = m["noise_measured"][1]
        for key in ("signal_share", "distractor_share", "signal", "num_distractors"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-4, err_msg=key)
        assert got["num_distractors"] > m["noise_measured"][0]["num_distractors"]
    # a length the ring cannot split, or one the models cannot take: refused before compute
    assert evaluate_main([str(reference), "long_context.lengths=136", "mesh.context=8"]) == 2
    assert "does not split into 16 equal chunks" in capsys.readouterr().err
    assert evaluate_main([str(reference), "long_context.lengths=512", "mesh.context=8"]) == 2
    assert "model.max_seq_len=256" in capsys.readouterr().err
    assert evaluate_main([str(reference), "long_context.lengths=128", "model.d_model=8"]) == 2
    assert "unknown setting 'model.d_model'" in capsys.readouterr().err
    assert evaluate_main([str(reference), "mesh.context=8"]) == 2
    assert "add long_context.lengths=L1,L2" in capsys.readouterr().err


@pytest.mark.parametrize("impl", ["auto", "pallas"])
def test_generate_prefills_through_the_ring_and_gives_the_same_tokens(monkeypatch, impl):
    """diffjax.generate under a context mesh: the prompt's prefill runs as a ring (a padded,
    uneven batch of prompts; with ``pallas`` its blocks on the kernels, in the natural order),
    and the greedy tokens are those of one device."""
    import jax
    from flax import nnx

    from diffjax import ModelConfig, TransformerLM, generate, ops
    from diffjax.infra import sharding
    from diffjax.nn.decode import pad_prompts
    from diffjax.kernels import gpu
    from diffjax.evaluate.long_context import replicate
    from diffjax.infra.runtime import Runtime

    cfg = ModelConfig(
        vocab_size=64,
        d_model=32,
        num_layers=2,
        num_heads=2,
        max_seq_len=128,
        attention_impl=impl,
    )
    model = TransformerLM(cfg, rngs=nnx.Rngs(1))
    # the kernels' own check before decoding (interpreted on CPU) is tests/test_kernel_check.py's
    monkeypatch.setattr(ops, "check_kernels", lambda *a, **k: None)
    rng = np.random.default_rng(1)
    prompt, lengths = pad_prompts([rng.integers(1, 64, n).tolist() for n in (40, 57)])
    ref = np.asarray(generate(model, prompt, 8, prompt_lengths=lengths))
    calls = []
    real = context.context_attention
    monkeypatch.setattr(
        context, "context_attention", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    real_partials, blocks = gpu.flash_partials, []
    monkeypatch.setattr(
        gpu, "flash_partials", lambda *a, **k: blocks.append(1) or real_partials(*a, **k)
    )
    mesh = sharding.make_mesh(sharding.MeshConfig(context=8))
    with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.DEFAULT_RULES):
        whole = np.asarray(generate(replicate(model, mesh), prompt, 8, prompt_lengths=lengths))
    assert not calls, "a model built by hand runs whole sequences under any mesh"
    np.testing.assert_array_equal(whole, ref)
    runtime = Runtime(mesh)  # the ring, as a run's would be
    with nnx.logical_axis_rules(sharding.DEFAULT_RULES):
        got = generate(replicate(model, mesh), prompt, 8, prompt_lengths=lengths, runtime=runtime)
    got = np.asarray(got)
    assert calls, "the prefill did not run as a ring"
    np.testing.assert_array_equal(got, ref)
    assert bool(blocks) == (impl == "pallas")  # the ring's blocks ran the kernels' partials


def test_long_context_md_gives_diff_minus_each_twin_paired_by_seed():
    """render() with DIFF, the twin and the gated twin: a column per twin whose cell is the
    seed-paired mean difference with its t-interval, a sentence per twin and length, and the
    distractor-share difference per twin; numbers checked by hand (numpy)."""
    from scipy import stats as st

    from diffjax.evaluate.long_context import render

    acc = {"diff": [0.9, 0.7, 0.8], "standard": [0.5, 0.6, 0.4], "gated": [0.8, 0.8, 0.6]}
    share = {"diff": [0.1, 0.2, 0.3], "standard": [0.4, 0.4, 0.5], "gated": [0.2, 0.3, 0.3]}
    models = [
        dict(
            label=lab,
            seed=s,
            attention="diff_v1" if lab == "diff" else "standard",
            accuracy=[acc[lab][s]],
            noise_measured=[
                dict(
                    length=64, num_distractors=10, signal_share=0.5, distractor_share=share[lab][s]
                )
            ],
        )
        for s in (2, 0, 1)  # out of seed order: pairing goes by seed
        for lab in acc
    ]
    out = dict(lengths=[64], num_needles=2, num_queries=1, examples=3, mesh={"context": 2})
    md = "\n".join(render({**out, "context_order": "zigzag", "models": models}))

    def cell(a, b):
        d = np.subtract(a, b)
        half = st.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d))
        return f"{d.mean():+.3f} [{d.mean() - half:+.3f}, {d.mean() + half:+.3f}]"

    assert "DIFF − twin [95% t-interval] | DIFF − gated [95% t-interval] |" in md
    row = next(line for line in md.splitlines() if line.startswith("| 64 |"))
    assert row.endswith(
        f"| {cell(acc['diff'], acc['standard'])} | {cell(acc['diff'], acc['gated'])} |"
    )
    assert "the gated twin" in md and md.count("accuracy at 64 tokens") == 2
    noise = md.split("## The noise floor")[1]
    assert "distractors DIFF − gated" in noise
    assert f"| {cell(share['diff'], share['gated'])} |" in noise
    assert f"| {cell(share['diff'], share['standard'])} |" in noise
