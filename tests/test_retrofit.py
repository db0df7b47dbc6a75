"""Retrofitting a pretrained standard model into DIFF (diffjax.retrofit).

References: the source model's own logits (DIFF V2 at w = 0 must give them to 1e-5 of the
largest logit, float32, from a diffjax model folder and from a Hugging Face Llama, MHA and GQA,
unrolled and scanned); the source's per-head attention outputs (each DIFF V1 head's first map
over its value's first half is a source head: a hand-built GQA pairing); transformers'
DiffLlama (a retrofitted V1 after its ramp, exported); and a run resumed from its checkpoint
against the same run uninterrupted (the ramp w bit for bit)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import diffjax
from diffjax.nn.attention import Ramp, attend
from diffjax.config import ConfigError, ModelConfig
from diffjax.nn.model import TransformerLM
from diffjax.retrofit import (
    RampSchedule,
    RetrofitConfig,
    logit_gap,
    ramp_values,
    retrofit_config,
    retrofit_model,
    v1_source_heads,
)
from diffjax.retrofit.cli import main as retrofit_main
from diffjax.train.checkpoint import load_model
from tiny import MODEL_KEYS, tiny_run

VOCAB = 61


def source_model(heads=4, kv_heads=None, scan=False, d=32, layers=2, seed=1) -> TransformerLM:
    cfg = ModelConfig(
        vocab_size=VOCAB,
        d_model=d,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        attention="standard",
        max_seq_len=64,
        scan_layers=scan,
        init_std=0.2,  # far from uniform attention: a wrong head shows in the logits
    )
    return TransformerLM(cfg, rngs=nnx.Rngs(seed))


def tokens(b=2, t=24, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=(b, t))


def assert_same_logits(a: TransformerLM, b: TransformerLM, toks=None) -> None:
    toks = tokens() if toks is None else toks
    x, y = np.asarray(a(jnp.asarray(toks))), np.asarray(b(jnp.asarray(toks)))
    scale = float(np.abs(x).max())
    assert scale > 0.5
    assert float(np.abs(x - y).max()) <= 1e-5 * scale


# ---------------------------------------------------------------------------- DIFF V2: exact
@pytest.mark.parametrize("kv_heads", [None, 2])
@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("second", ["zero", "mirror", "random"])
def test_v2_starts_exactly_at_the_source(kv_heads, scan, second):
    src = source_model(kv_heads=kv_heads, scan=scan)
    model = retrofit_model(src, "diff_v2", RetrofitConfig(second=second))
    assert model.config.attention == "diff_v2" and model.config.ramp
    assert model.config.scan_layers == scan  # the source's layout
    assert model.config.kv_heads == src.config.kv_heads
    np.testing.assert_array_equal(ramp_values(model), 0.0)
    assert_same_logits(src, model)
    # the ramp is what makes it exact: at w = 1 the negative maps count
    nnx.update(model, jax.tree.map(lambda v: jnp.ones_like(v), nnx.state(model, Ramp)))
    far = logit_gap(src, model, tokens())
    assert far["max_rel"] > 1e-3


def test_v2_options_set_the_negative_queries_and_lambda_proj():
    src = source_model()
    d, h = src.config.resolved_head_dim, src.config.num_heads
    q_src = np.asarray(src.layers[0].attn.q_proj.kernel[...]).reshape(-1, h, d)

    def pairs(m):
        return np.asarray(m.layers[0].attn.q_proj.kernel[...]).reshape(-1, h, 2, d)

    zero = retrofit_model(src, "diff_v2", RetrofitConfig(second="zero", lambda_proj="zero"))
    np.testing.assert_array_equal(pairs(zero)[:, :, 0], q_src)
    np.testing.assert_array_equal(pairs(zero)[:, :, 1], 0.0)
    np.testing.assert_array_equal(np.asarray(zero.layers[0].attn.lambda_proj.kernel[...]), 0.0)
    mirror = retrofit_model(src, "diff_v2", RetrofitConfig(second="mirror"))
    np.testing.assert_array_equal(pairs(mirror)[:, :, 1], q_src)
    assert np.abs(np.asarray(mirror.layers[0].attn.lambda_proj.kernel[...])).max() > 0
    random = retrofit_model(src, "diff_v2", RetrofitConfig(second="random"), seed=3)
    second = pairs(random)[:, :, 1]
    assert np.abs(second).max() > 0 and not np.allclose(second, q_src)
    for name in ("k_proj", "v_proj", "out_proj"):
        np.testing.assert_array_equal(
            np.asarray(getattr(random.layers[1].attn, name).kernel[...]),
            np.asarray(getattr(src.layers[1].attn, name).kernel[...]),
        )


# ---------------------------------------------------------------------------- DIFF V1: paired
def test_v1_source_heads_pair_by_keys():
    # MHA: adjacent heads; GQA (8 heads over 4 kv heads, 2 per group): DIFF head i of kv
    # group g takes head 2g*2 + r (reads kv head 2g) and drops head (2g+1)*2 + r (kv 2g+1)
    j1, j2 = v1_source_heads(4, 4)
    assert j1.tolist() == [0, 2] and j2.tolist() == [1, 3]
    j1, j2 = v1_source_heads(8, 4)
    assert j1.tolist() == [0, 1, 4, 5] and j2.tolist() == [2, 3, 6, 7]
    n_rep = 2
    assert all(j // n_rep == 2 * (i // n_rep) for i, j in enumerate(j1))  # K1 = kv 2g
    assert all(j // n_rep == 2 * (i // n_rep) + 1 for i, j in enumerate(j2))  # K2 = kv 2g+1


@pytest.mark.parametrize("heads,kv_heads", [(4, None), (8, 4), (4, 2)])
def test_v1_first_maps_are_the_source_heads(heads, kv_heads):
    """With w = 0 each DIFF V1 head's output (before its norm) is ``A1 [v_2g, v_2g+1]``: its
    first half is exactly the source head j1's output, computed by the source layer."""
    src = source_model(heads=heads, kv_heads=kv_heads, d=64)
    model = retrofit_model(src, "diff_v1", RetrofitConfig())
    assert model.config.num_heads == heads // 2
    assert model.config.kv_heads == src.config.kv_heads // 2
    x = jax.random.normal(jax.random.key(0), (2, 12, 64))
    s_attn, d_attn = src.layers[0].attn, model.layers[0].attn
    o_src = attend(s_attn.project(x), scale=s_attn.scale, impl="xla", causal=True)
    o_diff = attend(d_attn.project(x), scale=d_attn.scale, impl="xla", causal=True)
    j1, _ = v1_source_heads(heads, src.config.kv_heads)
    d = src.config.resolved_head_dim
    np.testing.assert_allclose(
        np.asarray(o_diff)[..., :d], np.asarray(o_src)[:, :, j1], rtol=1e-5, atol=1e-6
    )


def test_v1_step0_gap_is_measured_and_options_apply():
    src = source_model(heads=4, kv_heads=2)
    gaps = {}
    for norm in (True, False):
        m = retrofit_model(src, "diff_v1", RetrofitConfig(), diff_norm=norm, lambda_init=0.3)
        assert (m.layers[0].attn.subln is None) == (not norm)
        np.testing.assert_allclose(np.asarray(m.layers[1].attn.lambda_init[...]), 0.3)
        gaps[norm] = logit_gap(src, m, tokens())
        assert gaps[norm]["finite"] and not gaps[norm]["exact"]  # V1 cannot start exactly
    assert gaps[True]["max_abs"] != gaps[False]["max_abs"]
    d = src.config.resolved_head_dim
    mirror = retrofit_model(src, "diff_v1", RetrofitConfig(second="mirror"))
    q = np.asarray(mirror.layers[0].attn.q_proj.kernel[...]).reshape(-1, 2, 2, d)
    k = np.asarray(mirror.layers[0].attn.k_proj.kernel[...]).reshape(-1, 1, 2, d)
    np.testing.assert_array_equal(q[:, :, 1], q[:, :, 0])  # Q2 = Q1
    np.testing.assert_array_equal(k[:, :, 1], k[:, :, 0])  # K2 = K1
    zero = retrofit_model(src, "diff_v1", RetrofitConfig(second="zero"))
    q = np.asarray(zero.layers[0].attn.q_proj.kernel[...]).reshape(-1, 2, 2, d)
    k = np.asarray(zero.layers[0].attn.k_proj.kernel[...]).reshape(-1, 1, 2, d)
    np.testing.assert_array_equal(q[:, :, 1], 0.0)  # only Q2: zeroing K2 too is a saddle
    assert np.abs(k[:, :, 1]).max() > 0


def test_ramp_shapes():
    lin, cos = RampSchedule(4, "linear"), RampSchedule(4, "cosine")
    assert [float(lin(s)) for s in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    np.testing.assert_allclose([float(cos(s)) for s in (0, 2, 4, 9)], [0, 0.5, 1, 1], atol=1e-7)
    assert float(RampSchedule(0)(0)) == 1.0
    with pytest.raises(ConfigError, match="retrofit.ramp|RetrofitConfig.ramp"):
        RetrofitConfig(ramp="exp")
    with pytest.raises(ConfigError, match="warmup_steps"):
        RetrofitConfig(warmup_steps=-1)


@pytest.mark.parametrize(
    "source,attention,kw,match",
    [
        (dict(heads=4), "diff_v2", dict(lambda_init=0.5), "DIFF V1 settings"),
        (dict(heads=2, kv_heads=1), "diff_v1", {}, "must be even"),
        (dict(heads=4), "standard", {}, "not a DIFF kind"),
    ],
)
def test_retrofit_config_refusals(source, attention, kw, match):
    cfg = source_model(**source).config
    with pytest.raises(ConfigError, match=match):
        retrofit_config(cfg, attention, **kw)


def test_refuses_a_diff_source_and_a_head_width_v1_cannot_take():
    with pytest.raises(ConfigError, match="standard-attention model"):
        retrofit_config(ModelConfig(attention="diff_v1"), "diff_v2")
    wide = ModelConfig(attention="standard", d_model=64, num_heads=4, head_dim=32)
    with pytest.raises(ConfigError, match="heads are 32 wide"):
        retrofit_config(wide, "diff_v1")
    assert retrofit_config(wide, "diff_v2").resolved_head_dim == 32


# ---------------------------------------------------------------------------- the command line
TRAIN = tiny_run(  # the model: the retrofitted checkpoint's
    "train.eval_every=3",
    "train.checkpoint_every=3",
    "train.schedule=constant",
    "train.warmup_steps=0",
    "train.lr=3e-3",
    "compare.twins=",
    drop=MODEL_KEYS,
)
SOURCE = [
    "model.attention=standard",
    "model.d_model=32",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.vocab_size=259",
    "train.steps=3",
]


@pytest.fixture(scope="module")
def trained_source(tmp_path_factory):
    """A standard model trained 3 steps by train.py (its folder)."""
    from diffjax.compare.cli import main

    run = tmp_path_factory.mktemp("source") / "run"
    assert main([f"run.dir={run}", *TRAIN, *SOURCE]) == 0
    return run / "standard" / "seed_0"


def test_command_writes_a_model_folder_that_starts_at_the_source(trained_source, tmp_path, capsys):
    out = tmp_path / "v2"
    assert retrofit_main([str(trained_source), str(out), "retrofit.warmup_steps=4"]) == 0
    assert "largest logit difference" in capsys.readouterr().out
    src, model = load_model(str(trained_source)), load_model(str(out))
    assert model.config.attention == "diff_v2" and model.config.ramp
    np.testing.assert_array_equal(ramp_values(model), 0.0)  # load_model honours w
    assert_same_logits(src, model)
    # nothing saved is overwritten; bad input refused before compute, exit 2
    assert retrofit_main([str(trained_source), str(out)]) == 2
    assert "already holds checkpoints" in capsys.readouterr().err
    assert retrofit_main([str(tmp_path / "nothing"), str(tmp_path / "o1")]) == 2
    assert retrofit_main([str(out), str(tmp_path / "o2")]) == 2  # a DIFF source
    assert "standard-attention model" in capsys.readouterr().err
    bad = [str(trained_source), str(tmp_path / "o3"), "model.attention=diff_v1"]
    assert retrofit_main([*bad, "retrofit.lambda_proj=zero"]) == 2
    assert retrofit_main([str(trained_source), str(tmp_path / "o4"), "model.lambda_init=0.5"]) == 2
    assert not (tmp_path / "o3").exists() or not any((tmp_path / "o3").iterdir())


def _records(folder) -> list[dict]:
    return [json.loads(line) for line in open(folder / "metrics.jsonl")]


def test_ramp_moves_in_training_and_resumes_exactly(trained_source, tmp_path):
    """train.retrofit=true from the source's folder: w = 0, .25, .5, .75, 1, 1 over the steps
    (recorded), saved with the parameters, and a run resumed from step 3 equals the
    uninterrupted run bit for bit."""
    from diffjax.compare.cli import main

    common = [
        *TRAIN,
        f"train.init_from={trained_source}",
        "train.retrofit=true",
        "model.attention=diff_v2",
        "retrofit.warmup_steps=4",
        "retrofit.ramp=linear",
    ]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert main([f"run.dir={whole}", *common, "train.steps=6"]) == 0
    assert main([f"run.dir={part}", *common, "train.steps=3"]) == 0
    assert main([f"run.dir={part}", *common, "train.steps=6"]) == 0  # resumes at 3
    a, b = _records(whole / "diff" / "seed_0"), _records(part / "diff" / "seed_0")
    assert [r["ramp"] for r in a] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["ramp"] for r in a] == [r["ramp"] for r in b]
    mid = load_model(str(whole / "diff" / "seed_0"), 3)
    np.testing.assert_array_equal(ramp_values(mid), 0.75)  # the state after step 3: w(3)
    end_a = load_model(str(whole / "diff" / "seed_0"), "latest")
    end_b = load_model(str(part / "diff" / "seed_0"), "latest")
    np.testing.assert_array_equal(ramp_values(end_a), 1.0)
    for x, y in zip(jax.tree.leaves(nnx.state(end_a)), jax.tree.leaves(nnx.state(end_b))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # the first step ran the source's function: its loss is the unconverted model's
    plain = tmp_path / "plain"
    assert (
        main([f"run.dir={plain}", *TRAIN, f"train.init_from={trained_source}", "train.steps=1"])
        == 0
    )
    first = _records(plain / "standard" / "seed_0")[0]["loss"]
    assert abs(first - a[0]["loss"]) <= 1e-5 * abs(first)


def test_train_py_refusals(trained_source, tmp_path):
    from diffjax.compare.cli import main

    run = [f"run.dir={tmp_path / 'r'}", *TRAIN, "train.steps=1"]
    # train.retrofit needs a source, and DIFF as the target
    assert main([*run, "train.retrofit=true", "model.attention=diff_v2"]) == 2
    assert main([*run, f"train.init_from={trained_source}", "train.retrofit=true",
                 "model.attention=standard"]) == 2  # fmt: skip
    assert main([*run, f"train.init_from={trained_source}", "train.retrofit=true",
                 "model.attention=diff_v1", "retrofit.lambda_proj=zero"]) == 2  # fmt: skip
    assert not (tmp_path / "r").exists() or not list((tmp_path / "r").rglob("checkpoints"))


def test_sharded_run_with_a_scanned_source(trained_source, tmp_path):
    """A retrofit trained on a data x fsdp x tensor mesh of 8 devices from a scanned source's
    weights: the first step's loss is the source's on the same batch."""
    from diffjax.compare.cli import main

    scanned = tmp_path / "scanned"
    from diffjax.train.convert import convert_run

    convert_run(str(trained_source), str(scanned))
    args = [
        *TRAIN,
        f"train.init_from={scanned}",
        "train.retrofit=true",
        "model.attention=diff_v2",
        "retrofit.warmup_steps=2",
        "train.steps=2",
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
    ]
    assert main([f"run.dir={tmp_path / 'sharded'}", *args]) == 0
    records = _records(tmp_path / "sharded" / "diff" / "seed_0")
    assert [r["ramp"] for r in records] == [0.0, 0.5]
    plain = [*TRAIN, f"train.init_from={trained_source}", "train.steps=1"]
    assert main([f"run.dir={tmp_path / 'plain'}", *plain]) == 0
    first = _records(tmp_path / "plain" / "standard" / "seed_0")[0]["loss"]
    assert abs(records[0]["loss"] - first) <= 1e-5 * abs(first)
    model = load_model(str(tmp_path / "sharded" / "diff" / "seed_0"), "latest")
    assert model.config.scan_layers and model.config.ramp


# ---------------------------------------------------------------------------- export
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("kv_heads", [4, 2])  # MHA, GQA
def test_hf_llama_source_and_diffllama_export(tmp_path, kv_heads):
    """A Hugging Face Llama retrofitted: V2 gives its logits exactly; V1 mid-ramp is refused by
    export, and after its ramp exports to DiffLlama with transformers' logits."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    llama = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in llama.parameters():
            p.normal_(0, 0.2)
    llama.save_pretrained(tmp_path / "llama")
    toks = tokens()
    with torch.no_grad():
        ref = llama(torch.from_numpy(toks)).logits.float().numpy()
    out = tmp_path / "v2"
    assert retrofit_main([str(tmp_path / "llama"), str(out)]) == 0
    v2 = load_model(str(out))
    got = np.asarray(v2(jnp.asarray(toks)))
    assert float(np.abs(got - ref).max()) <= 2e-5 * float(np.abs(ref).max())

    v1 = retrofit_model(diffjax.from_pretrained(str(tmp_path / "llama")), "diff_v1")
    with pytest.raises(diffjax.interop.hf.PretrainedError, match="mid-ramp"):
        diffjax.save_pretrained(v1, str(tmp_path / "mid"))
    nnx.update(v1, jax.tree.map(lambda v: jnp.ones_like(v), nnx.state(v1, Ramp)))
    diffjax.save_pretrained(v1, str(tmp_path / "diffllama"))
    saved = json.loads((tmp_path / "diffllama" / "config.json").read_text())
    assert saved["model_type"] == "diffllama"
    back = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "diffllama"), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        theirs = back(torch.from_numpy(toks)).logits.float().numpy()
    mine = np.asarray(v1(jnp.asarray(toks)))
    assert float(np.abs(theirs - mine).max()) <= 2e-5 * float(np.abs(mine).max())


def test_generation_honours_the_ramp():
    """Decoding with the KV cache runs the same w: at w = 0 a DIFF V2 retrofit continues a
    prompt exactly as its source does, token for token."""
    src = source_model(kv_heads=2)
    model = retrofit_model(src, "diff_v2")
    prompt = jnp.asarray(tokens(b=2, t=5))
    a = diffjax.generate(src, prompt, 8)
    b = diffjax.generate(model, prompt, 8)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
