"""diffjax as an lm-evaluation-harness model (diffjax.lm_eval), offline.

One tiny DIFF V1 model exported with ``diffjax.save_pretrained`` (with a byte-level BPE
tokenizer.json built here) serves every test, so each compiled batch is compiled once. The tasks
are lm-eval YAML over local jsonl files (the ``json`` dataset builder; nothing downloaded). The
peer check runs lm-eval's own ``hf`` model (transformers' DiffLlama, torch on CPU) on the same
export and task."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import types

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

lm_eval = pytest.importorskip("lm_eval")

import diffjax  # noqa: E402
from diffjax.config import ConfigError  # noqa: E402
from diffjax.data.tokenizer import ByteTokenizer, HFTokenizer  # noqa: E402
from diffjax.lm_eval import DiffJaxLM, scoring  # noqa: E402
from diffjax.evaluate import report  # noqa: E402
from diffjax.evaluate.lm_eval_run import evaluate_run_tasks  # noqa: E402
from diffjax.evaluate.lm_tasks import HEADING, render_section  # noqa: E402
from diffjax.train.checkpoint import Checkpointer  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

MAX_LEN = 64
TOL = 1e-4
DOCS = [
    "the cat sat on the mat. the dog sat on the log.\n",
    "a bird in the hand is worth two in the bush.\n",
    "one two three four five six seven eight nine ten.\n",
]
MC = [
    {"question": "The cat sat on the", "choices": [" mat", " dog", " moon"], "answer": 0},
    {"question": "A bird in the", "choices": [" bush", " hand", " sky"], "answer": 1},
    {"question": "one two three", "choices": [" four", " ten", " nine"], "answer": 0},
    {"question": "the dog sat on the", "choices": [" log", " mat"], "answer": 0},
]
ROLLING = [{"text": (DOCS[0] + DOCS[1]) * 4}, {"text": DOCS[2]}]
GEN = [{"prompt": "the cat", "target": " sat"}, {"prompt": "one two", "target": " three"}]


# ---------------------------------------------------------------------------- fixtures
def _tokenizer(path) -> None:
    """A byte-level BPE tokenizer.json with <s>, </s>, <pad> (no template: nothing is added)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(DOCS * 20, trainer)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            f,
        )


def _write_tasks(root) -> None:
    """Three lm-eval tasks over jsonl files in ``root``: multiple choice, rolling
    log-likelihood, generation."""
    data = {"mc": MC, "rolling": ROLLING, "gen": GEN}
    for name, rows in data.items():
        with open(os.path.join(root, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    common = (
        "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {file}\n"
        "  cache_dir: {cache}\ntest_split: test\n"
    )
    specs = {
        "mc": """
            output_type: multiple_choice
            doc_to_text: "{{question}}"
            doc_to_choice: choices
            doc_to_target: answer
            metric_list:
              - {metric: acc, aggregation: mean, higher_is_better: true}
            """,
        "rolling": """
            output_type: loglikelihood_rolling
            doc_to_text: ""
            doc_to_target: "{{text}}"
            metric_list:
              - {metric: word_perplexity, aggregation: weighted_perplexity, higher_is_better: false}
              - {metric: bits_per_byte, aggregation: bits_per_byte, higher_is_better: false}
            """,
        "gen": """
            output_type: generate_until
            doc_to_text: "{{prompt}}"
            doc_to_target: "{{target}}"
            generation_kwargs:
              until: ["."]
              max_gen_toks: 6
              do_sample: false
            metric_list:
              - {metric: exact_match, aggregation: mean, higher_is_better: true}
            """,
    }
    for name, spec in specs.items():
        head = f"task: djx_{name}\n" + common.format(
            file=os.path.join(root, f"{name}.jsonl"), cache=os.path.join(root, "hf_cache")
        )
        with open(os.path.join(root, f"{name}.yaml"), "w") as f:
            f.write(head + textwrap.dedent(spec))


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A tiny DIFF V1 model written with diffjax.save_pretrained, its tokenizer beside it."""
    root = tmp_path_factory.mktemp("lm_eval")
    _tokenizer(str(root / "tok"))
    vocab = HFTokenizer(str(root / "tok")).vocab_size
    cfg = diffjax.ModelConfig(
        vocab_size=vocab,
        d_model=32,
        num_layers=2,
        num_heads=2,
        ffn_dim=64,
        max_seq_len=MAX_LEN,
        init_std=0.2,
    )
    model = diffjax.TransformerLM(cfg, rngs=nnx.Rngs(0))
    diffjax.save_pretrained(model, str(root / "hf"), tokenizer_from=str(root / "tok"))
    _write_tasks(str(root))
    return root


@pytest.fixture(scope="module")
def lm(export):
    return DiffJaxLM(path=str(export / "hf"), batch_size=8)


@pytest.fixture(scope="module")
def tasks(export):
    return TaskManager(include_path=str(export), include_defaults=False)


@pytest.fixture(scope="module")
def run(lm, tasks):
    """The three tasks through lm_eval.simple_evaluate with the diffjax model."""
    return lm_eval.simple_evaluate(
        model=lm,
        tasks=["djx_mc", "djx_rolling", "djx_gen"],
        task_manager=tasks,
        log_samples=True,
    )


@nnx.jit
def _forward(model, tokens):
    return model(tokens)


def direct_scores(model, tokens) -> tuple[np.ndarray, np.ndarray]:
    """Per position of one forward pass of ``tokens[:-1]``: log p(tokens[i + 1] | tokens[: i +
    1]) (jax.nn.log_softmax of the logits) and whether tokens[i + 1] is the argmax."""
    logits = _forward(model, jnp.asarray([tokens[:-1]], jnp.int32)).astype(jnp.float32)[0]
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    targets = np.asarray(tokens[1:])
    return logp[np.arange(len(targets)), targets], np.argmax(logp, -1) == targets


# ---------------------------------------------------------------------------- pure pieces
def test_rolling_windows_score_every_token_once():
    tokens = list(range(100, 100 + 3 * MAX_LEN + 17))
    windows = scoring.rolling_windows(tokens, prefix_token=1, max_len=MAX_LEN)
    scored = []
    for ctx, cont in windows:
        inputs, targets, n = scoring.loglikelihood_row(ctx, cont, MAX_LEN)
        assert len(inputs) <= MAX_LEN and targets[-n:] == cont
        assert inputs[1:] == targets[:-1]  # targets are the inputs shifted by one
        scored += targets[-n:]
    assert scored == tokens
    assert windows[0][0] == [1] and len(windows) == 4


def test_rows_truncate_the_context_from_the_left():
    inputs, targets, n = scoring.loglikelihood_row(list(range(100)), [7, 8], 10)
    assert inputs == [91, 92, 93, 94, 95, 96, 97, 98, 99, 7]
    assert targets[-n:] == [7, 8] and n == 2
    assert scoring.length_buckets(64) == (32, 64) and scoring.length_buckets(200) == (
        32,
        64,
        128,
        200,
    )
    batches = scoring.plan_batches([5, 40, 33, 64, 2], (32, 64), rows=2)
    assert batches == [(64, [3, 1]), (64, [2]), (32, [0, 4])]
    assert scoring.cut_at_stops("abc.def\nx", [".", "\n"]) == "abc"


# ---------------------------------------------------------------------------- against the logits
def test_loglikelihoods_equal_a_direct_computation(lm):
    enc = lm.tok_encode
    long_ctx = DOCS[0] * 8 + "the"  # far more than MAX_LEN tokens: truncated from the left
    reqs = [("The cat sat on the", " mat"), (long_ctx, " the dog"), ("", "one two three")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, r, i) for i, r in enumerate(reqs)])
    for (ctx, cont), (logp, greedy) in zip(reqs, got):
        if ctx:
            whole = enc(ctx + cont)
            n = len(whole) - len(enc(ctx))
        else:
            whole = [lm.prefix_token_id] + enc(cont)
            n = len(whole) - 1
        whole = whole[-(MAX_LEN + 1) :]
        ref, ref_greedy = direct_scores(lm.model, whole)
        assert abs(logp - float(ref[-n:].sum())) <= TOL, (ctx[:20], cont)
        assert greedy == bool(ref_greedy[-n:].all())
    assert len(enc(long_ctx)) > MAX_LEN


def test_rolling_loglikelihood_scores_every_token_of_a_long_document(lm):
    text = ROLLING[0]["text"]
    tokens = lm.tok_encode(text)
    assert len(tokens) > 2 * MAX_LEN
    (total,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    # each window by hand: the context that fits before the next MAX_LEN tokens
    ref, done = 0.0, 0
    while done < len(tokens):
        end = min(done + MAX_LEN, len(tokens))
        window = ([lm.prefix_token_id] + tokens)[max(0, end - MAX_LEN) : end + 1]
        ref += float(direct_scores(lm.model, window)[0][-(end - done) :].sum())
        done = end
    assert abs(total - ref) <= TOL * 10


# ---------------------------------------------------------------------------- simple_evaluate
def test_simple_evaluate_runs_the_three_request_types(run, lm):
    res = run["results"]
    assert 0.0 <= res["djx_mc"]["acc,none"] <= 1.0
    assert np.isfinite(res["djx_rolling"]["word_perplexity,none"])
    assert res["djx_rolling"]["bits_per_byte,none"] > 0
    assert "exact_match,none" in res["djx_gen"]
    # the generations are greedy diffjax.generate, cut at the stop sequence
    for sample in run["samples"]["djx_gen"]:
        prompt = sample["arguments"][0][0]
        ids = lm.tok_encode(prompt)
        out = np.asarray(diffjax.generate(lm.model, np.asarray([ids]), 6, eos_id=lm.eot_token_id))
        new = scoring.until_token(out[0, len(ids) :], lm.eot_token_id)
        assert sample["resps"][0][0] == lm.tok_decode(new).split(".")[0]


# ---------------------------------------------------------------------------- the peer
@pytest.fixture(scope="module")
def byte_v2(export):
    """A tiny DIFF V2 model (GQA) exported with the byte tokenizer: transformers loads it
    through the modeling code written beside it, AutoTokenizer through its tokenizer.json."""
    cfg = diffjax.ModelConfig(
        d_model=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        ffn_dim=64,
        max_seq_len=MAX_LEN,
        init_std=0.2,
        attention="diff_v2",
    )
    model = diffjax.TransformerLM(cfg, rngs=nnx.Rngs(1))
    diffjax.save_pretrained(model, str(export / "v2"), tokenizer="byte")
    return export / "v2"


@pytest.mark.parametrize("which", ["bpe_v1", "byte_v2"])
def test_same_loglikelihoods_and_accuracy_as_lm_evals_hf_model(export, run, tasks, request, which):
    """lm-eval's own hf model (transformers, torch on CPU) on an export gives diffjax.lm_eval's
    scores on it: DIFF V1 (DiffLlama) with a BPE tokenizer, and DIFF V2 (its remote code) with
    the byte tokenizer's tokenizer.json."""
    pytest.importorskip("accelerate")
    torch = pytest.importorskip("torch")
    from lm_eval.models.huggingface import HFLM

    names = ["djx_mc", "djx_rolling"]
    if which == "bpe_v1":
        path, ours_run = export / "hf", run
    else:
        path = request.getfixturevalue("byte_v2")
        ours_lm = DiffJaxLM(path=str(path), batch_size=8)
        assert isinstance(ours_lm._tok, HFTokenizer)  # the export's tokenizer.json
        ours_run = lm_eval.simple_evaluate(
            model=ours_lm, tasks=names, task_manager=tasks, log_samples=True
        )
    torch.manual_seed(0)
    peer = HFLM(
        pretrained=str(path), dtype="float32", device="cpu", batch_size=8, trust_remote_code=True
    )
    assert peer.max_length == MAX_LEN
    ref = lm_eval.simple_evaluate(model=peer, tasks=names, task_manager=tasks, log_samples=True)
    for task in names:
        ours = {s["doc_id"]: s["resps"] for s in ours_run["samples"][task]}
        theirs = {s["doc_id"]: s["resps"] for s in ref["samples"][task]}
        assert ours.keys() == theirs.keys()
        for doc in ours:
            a = np.asarray([r[0][0] if task == "djx_mc" else r[0] for r in ours[doc]], float)
            b = np.asarray([r[0][0] if task == "djx_mc" else r[0] for r in theirs[doc]], float)
            np.testing.assert_allclose(a, b, atol=TOL, rtol=0)
            if task == "djx_mc":  # and the same is_greedy
                assert [r[0][1] for r in ours[doc]] == [r[0][1] for r in theirs[doc]]
    assert ours_run["results"]["djx_mc"]["acc,none"] == ref["results"]["djx_mc"]["acc,none"]
    np.testing.assert_allclose(
        ours_run["results"]["djx_rolling"]["word_perplexity,none"],
        ref["results"]["djx_rolling"]["word_perplexity,none"],
        rtol=1e-4,
    )


# ---------------------------------------------------------------------------- run directories
def test_a_run_directory_gives_the_model_of_its_label_and_seed(tmp_path):
    """``RUN/<label>/seed_<n>/checkpoints`` as train.py writes them; the run's tokenizer."""
    run = tmp_path / "run"
    saved = {}
    for label, attention, seed in (("diff", "diff_v1", 0), ("standard", "standard", 1)):
        cfg = diffjax.ModelConfig(
            vocab_size=259,
            d_model=16,
            num_layers=1,
            num_heads=1,
            max_seq_len=32,
            attention=attention,
        )
        model = diffjax.TransformerLM(cfg, rngs=nnx.Rngs(seed))
        ckpt = Checkpointer(str(run / label / f"seed_{seed}" / "checkpoints"), async_save=False)
        ckpt.save(1, {"params": nnx.state(model, nnx.Param)}, {}, {"model": cfg.to_dict()}, 1.0)
        ckpt.wait()
        ckpt.close()
        saved[label] = model
    (run / "config.json").write_text(
        json.dumps({"model": {}, "data": {"tokenizer": "byte"}, "train": {"seed": 0}})
    )
    lm = DiffJaxLM(path=str(run), model="standard", seed=1, batch_size=4)
    assert lm.model.config.attention == "standard" and lm.prefix_token_id == ByteTokenizer.bos_id
    for a, b in zip(
        jax.tree.leaves(nnx.state(lm.model, nnx.Param)),
        jax.tree.leaves(nnx.state(saved["standard"], nnx.Param)),
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert DiffJaxLM(path=str(run)).model.config.attention == "diff_v1"  # default: diff, seed 0
    with pytest.raises(ConfigError, match=r"no model 'standard' with seed 0.*standard/seed_1"):
        DiffJaxLM(path=str(run), model="standard")


# ---------------------------------------------------------------------------- the command line
def test_command_line_writes_the_output_path(export, tmp_path, monkeypatch):
    """``python -m diffjax.lm_eval`` (the module run as ``__main__``, in this process). lm-eval's
    command line indexes its ~15k built-in task files on every start (tens of seconds here), so
    the index is limited to ``--include_path``; the arguments are lm-eval's own."""
    import functools
    import runpy

    import lm_eval.tasks

    out = tmp_path / "out"
    argv = [
        "--model",
        "diffjax",
        "--model_args",
        f"path={export / 'hf'}",
        "--tasks",
        "djx_mc",
        "--include_path",
        str(export),
        "--output_path",
        str(out),
        "--log_samples",
        "--batch_size",
        "8",
    ]
    manager = lm_eval.tasks.TaskManager
    monkeypatch.setattr(
        manager,
        "__init__",
        functools.partialmethod(manager.__init__, include_defaults=False),
    )
    monkeypatch.setattr(sys, "argv", ["diffjax.lm_eval", *argv])
    runpy.run_module("diffjax.lm_eval", run_name="__main__")
    results = list(out.rglob("results_*.json"))
    samples = list(out.rglob("samples_djx_mc_*.jsonl"))
    assert results and samples, sorted(str(p) for p in out.rglob("*"))
    acc = json.loads(results[0].read_text())["results"]["djx_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0


# ---------------------------------------------------------------------------- a whole run
def _write_run(run) -> dict:
    """A train.py run of DIFF and its twin, seeds 0 and 1 each (tiny byte-level models)."""
    saved = {}
    for label, attention in (("diff", "diff_v1"), ("standard", "standard")):
        for seed in (0, 1):
            cfg = diffjax.ModelConfig(
                vocab_size=259,
                d_model=16,
                num_layers=1,
                num_heads=1,
                max_seq_len=32,
                attention=attention,
                init_std=0.2,
            )
            model = diffjax.TransformerLM(cfg, rngs=nnx.Rngs(seed + 10))
            path = run / label / f"seed_{seed}" / "checkpoints"
            ckpt = Checkpointer(str(path), async_save=False)
            state = {"params": nnx.state(model, nnx.Param)}
            ckpt.save(1, state, {}, {"model": cfg.to_dict()}, 1.0)
            ckpt.wait()
            ckpt.close()
            saved[label, seed] = model
    (run / "config.json").write_text(
        json.dumps({"model": {}, "data": {"tokenizer": "byte"}, "train": {"seed": 0}})
    )
    return saved


def test_a_whole_run_gives_every_model_and_seed_beside_its_twin(export, tmp_path):
    run = tmp_path / "run"
    _write_run(run)
    (run / "eval.md").write_text("# Evaluation\n\n## 1. Retrieval\n\nkept\n")
    kw = dict(include_path=str(export), include_defaults=False, limit=3, batch_size=4)
    data = evaluate_run_tasks(str(run), ["djx_mc"], log=lambda s: None, **kw)
    stored = json.loads((run / "lm_eval.json").read_text())
    assert stored == json.loads(json.dumps(data))
    got = {(m["label"], m["seed"]): m["metrics"]["djx_mc"]["acc,none"] for m in stored["models"]}
    assert set(got) == {("diff", 0), ("diff", 1), ("standard", 0), ("standard", 1)}
    # one model on its own: the same accuracy
    direct = lm_eval.simple_evaluate(
        model=DiffJaxLM(path=str(run), model="standard", seed=1, batch_size=4),
        tasks=["djx_mc"],
        task_manager=TaskManager(include_path=str(export), include_defaults=False),
        limit=3,
    )
    assert got["standard", 1] == direct["results"]["djx_mc"]["acc,none"]
    # again from the command line: the section is replaced, not repeated; the rest is kept
    from diffjax.evaluate.__main__ import main

    args = [str(run), "lm_eval.only=true", "lm_eval.tasks=djx_mc", "lm_eval.limit=3"]
    args += [f"lm_eval.include_path={export}", "lm_eval.default_tasks=false"]
    assert main([*args, "lm_eval.batch_size=4"]) == 0
    assert json.loads((run / "lm_eval.json").read_text()) == stored
    text = (run / "eval.md").read_text()
    assert text.count(HEADING) == 1 and "## 1. Retrieval\n\nkept" in text
    # the analyses' report (python -m diffjax.evaluate without lm_eval.only) keeps the section
    kept = report.lm_eval_tasks(types.SimpleNamespace(run_dir=str(run)))
    assert kept == render_section(stored) and "\n".join(kept) in text
    assert report.lm_eval_tasks(types.SimpleNamespace(run_dir=str(tmp_path))) == []
    assert "djx_mc acc ↑, DIFF minus the twin:" in text and "| `djx_mc` | acc ↑ |" in text
    assert "paired seeds" in text or "no spread" in text
    # the paper's columns, where a number is recorded
    lines = render_section(data, paper={("djx_mc", "acc,none"): (0.5, 0.625)})
    assert any(x.startswith("| `djx_mc` | acc") and x.endswith("| 0.500 | 0.625 |") for x in lines)


def test_the_task_table_gives_diff_minus_each_twin():
    """render_section with DIFF, the twin and the gated twin: a column and a sentence per twin,
    each the seed-paired difference (models listed out of seed order)."""
    acc = {"diff": [0.6, 0.7, 0.5], "standard": [0.4, 0.6, 0.5], "gated": [0.7, 0.6, 0.6]}
    models = [
        {"label": lab, "seed": s, "attention": "standard", "metrics": {"t": {"acc,none": v[s]}}}
        for lab, v in acc.items()
        for s in (2, 1, 0)
    ]
    data = {"models": models, "tasks": ["t"], "higher_is_better": {"t": {"acc": True}}}
    text = "\n".join(render_section(data, paper={}))
    assert "| DIFF − twin [95% t-interval] | DIFF − gated [95% t-interval] |" in text
    row = next(x for x in text.splitlines() if x.startswith("| `t` |"))
    cells = row.split(" | ")
    d_twin = np.subtract(acc["diff"], acc["standard"]).mean()
    d_gated = np.subtract(acc["diff"], acc["gated"]).mean()
    assert cells[5].startswith(f"{d_twin:+.3f} [") and cells[6].startswith(f"{d_gated:+.3f} [")
    assert "t acc ↑, DIFF minus the twin:" in text and "t acc ↑, DIFF minus the gated twin:" in text


def test_evaluate_rejects_bad_lm_eval_input_before_compute(export, tmp_path, capsys):
    # imported here: runpy warns when the command-line test runs a module already imported
    from diffjax.evaluate.__main__ import main
    from diffjax.lm_eval.__main__ import main as lm_eval_main

    (tmp_path / "empty").mkdir()
    tasks = [f"lm_eval.include_path={export}", "lm_eval.default_tasks=false"]
    assert main([str(tmp_path / "empty"), "lm_eval.tasks=djx_mc", *tasks]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "holds no model" in err and "\n" not in err
    run = tmp_path / "run"
    _write_run(run)
    # an unknown task: refused before the analyses run (no eval.md) or any model is loaded
    assert main([str(run), "lm_eval.tasks=djx_mc,djx_nope", *tasks]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown lm-eval task(s): djx_nope" in err and "\n" not in err
    assert not (run / "lm_eval.json").exists() and not (run / "eval.md").exists()
    assert main([str(run), "lm_eval.only=true"]) == 2
    assert "lm_eval.only: runs no task. Fix: add lm_eval.tasks=t1,t2" in capsys.readouterr().err
    assert main([str(run), "lm_eval.tasks=djx_mc", "lm_eval.default_tasks=false"]) == 2
    assert "Fix: pass lm_eval.include_path=DIR" in capsys.readouterr().err
    # the run mode moved: lm-eval's command line says where
    assert lm_eval_main(["--run", str(run), "--tasks", "djx_mc"]) == 2
    assert "python -m diffjax.evaluate RUN_DIR lm_eval.tasks=t1,t2" in capsys.readouterr().err


def test_the_analyses_and_the_comparison_do_not_import_lm_eval():
    """lm-eval is the `eval` extra: importing the comparison or the analyses leaves it out."""
    import subprocess

    code = (
        "import sys, diffjax.compare, diffjax.evaluate, diffjax.sweep; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'lm_eval'"
        " or m.startswith('diffjax.lm_eval') or m == 'diffjax.evaluate.lm_eval_run'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
