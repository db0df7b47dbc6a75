"""The analyses' registry (diffjax.evaluate.analyses): eval.md rendered from eval.json files the
code wrote before each analysis owned its result, section and plot is byte for byte what it was
then (tests/data/eval_golden: a quick evaluation of a tiny stdlib run and a full one of a tiny
needle run, two seeds of DIFF and its twin each); every analysis's typed result reads back and
writes its eval.json entry unchanged; and an analysis registered in the list alone adds its
entry to eval.json and its section to eval.md."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
from flax import nnx

import diffjax
from diffjax.evaluate import analyses as registry
from diffjax.evaluate.analysis import Analysis, Run, paired, table
from diffjax.evaluate.report import render
from diffjax.evaluate.run import data_config, evaluate_model, read_run_config
from diffjax.evaluate.settings import EvalSettings

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "eval_golden")
RUNS = ("golden_run", "golden_needle_full")


def _golden(name: str, tmp_path):
    """A copy of the golden run at tmp_path/<name> (without its figures), its eval.json, and
    the eval.md the earlier code wrote, its run path replaced by the copy's."""
    run = tmp_path / name
    os.makedirs(run)
    shutil.copy(os.path.join(GOLDEN, name, "config.json"), run / "config.json")
    with open(os.path.join(GOLDEN, name, "eval.json")) as f:
        ev = json.load(f)
    with open(os.path.join(GOLDEN, name, "eval.md")) as f:
        md = f.read().replace(f"/tmp/{name}", str(run))
    return str(run), ev, md


def _render(run: str, ev: dict, analyses=None) -> str:
    noise = {k: np.asarray(v) for k, v in ev["noise_closed_form"].items()}
    settings = EvalSettings.for_run(ev["quick"])
    return render(run, data_config(read_run_config(run)), settings, ev["models"], noise, analyses)


@pytest.mark.parametrize("name", RUNS)
def test_eval_md_from_an_earlier_eval_json_is_unchanged(name, tmp_path):
    run, ev, expected = _golden(name, tmp_path)
    assert _render(run, ev) == expected
    with open(os.path.join(GOLDEN, name, "figures.txt")) as f:
        figures = f.read().split()
    assert sorted(p for p in os.listdir(run) if p.endswith(".png")) == figures


@pytest.mark.parametrize("name", RUNS)
def test_each_typed_result_writes_back_its_eval_json_entry(name, tmp_path):
    _, ev, _ = _golden(name, tmp_path)
    for entry in ev["models"]:
        written = {k: entry[k] for k in ("attention", "lambda")}
        for a in registry.ANALYSES:
            result = a.load(entry)
            if result is not None:
                assert isinstance(result, a.result)
                a.store(result, written)
        rest = {k: entry[k] for k in ("label", "seed", "path", "params", "step", "tokens")}
        # the same JSON, key order included (eval.json is written in the entry's order)
        assert json.dumps({**written, **rest}, sort_keys=True) == json.dumps(entry, sort_keys=True)


def test_an_older_eval_json_without_the_later_fields_still_renders(tmp_path):
    """An eval.json from before the per-head shares (no per_head, retrieval_head, per_layer in
    the allocation) reads back: the sections render, without the retrieval head's."""
    run, ev, expected = _golden("golden_run", tmp_path)
    for entry in ev["models"]:
        for key in ("per_head", "retrieval_head", "per_layer"):
            del entry["allocation"][key]
    text = _render(run, ev)
    assert "**The retrieval head.**" in expected and "**The retrieval head.**" not in text
    assert "## 2. Attention allocation" in text and "## 6. Loss by position" in text


# ---------------------------------------------------------------------------- a new analysis
@dataclasses.dataclass(frozen=True)
class Embedding:
    """A tiny analysis: the mean absolute value of the embedding table."""

    mean_abs: float

    def to_dict(self) -> dict:
        return {"mean_abs": self.mean_abs}

    @classmethod
    def from_dict(cls, d: dict) -> "Embedding":
        return cls(d["mean_abs"])


def _measure(inputs) -> Embedding:
    return Embedding(float(np.abs(np.asarray(inputs.model.embed.embedding.value)).mean()))


def _section(run: Run) -> list[str]:
    rows = [
        ["mean |embedding|"]
        + [run.cell(lab, lambda r: r.get("embedding").mean_abs, "{:.4f}") for lab in run.labels]
    ]
    line = paired(run.groups, lambda r: r.get("embedding").mean_abs, "mean |embedding|")
    return ["## 7. Embedding size", "", *table([""] + run.names(), rows), "", *line, ""]


EMBEDDING = Analysis("embedding", Embedding, _measure, _section)


def test_a_registered_analysis_adds_its_entry_and_its_section(tmp_path, monkeypatch):
    """Registering the analysis (one line in the registry's list) is all it takes: the runner
    measures it into each model's entry, the report adds its section after the others."""
    monkeypatch.setattr(registry, "ANALYSES", (*registry.ANALYSES, EMBEDDING))
    run, ev, before = _golden("golden_run", tmp_path)
    for i, entry in enumerate(ev["models"]):
        entry["embedding"] = {"mean_abs": 0.5 + 0.01 * i}
    text = _render(run, ev)
    section = text[text.index("## 7. Embedding size") :]
    assert "| mean |embedding| | 0.5050 ± 0.0071 | 0.5250 ± 0.0071 |" in section
    assert "- mean |embedding|, DIFF minus the twin: -0.0200 in each of 2 paired seeds" in section
    # every earlier section unchanged, the new one before the footer
    assert text.index("## 6. Loss by position") < text.index("## 7. Embedding size")
    footer = text.index("DIFF V1 λ per layer")
    assert text.index("## 7. Embedding size") < footer
    assert text.replace(text[text.index("## 7.") : footer], "") == before

    # measured: the runner stores the typed result in the model's eval.json entry
    monkeypatch.setattr(registry, "ANALYSES", (EMBEDDING,))
    cfg = diffjax.ModelConfig(vocab_size=259, d_model=16, num_layers=1, num_heads=2)
    model = diffjax.TransformerLM(cfg, rngs=nnx.Rngs(0))
    settings = EvalSettings.for_run(True)
    entry = evaluate_model(model, data_config(read_run_config(run)), settings, log=lambda _: None)
    expected = float(np.abs(np.asarray(model.embed.embedding.value)).mean())
    assert entry == {
        "attention": "diff_v1",
        "lambda": entry["lambda"],
        "embedding": {"mean_abs": expected},
    }


# ---------------------------------------------------------------------------- paired statistics
def test_the_pairs_and_the_cell_of_a_paired_difference():
    """stats.paired_by_seed pairs the seeds both models have a value for (objects or eval.json
    entries); stats.difference_cell is the comparison's and the sweep's cell."""
    from diffjax.evaluate.stats import difference_cell, paired_by_seed, paired_difference

    groups = {
        "diff": [{"seed": 0, "x": 1.0}, {"seed": 1, "x": None}, {"seed": 2, "x": 3.0}],
        "standard": [{"seed": 2, "x": 1.0}, {"seed": 0, "x": 0.5}, {"seed": 3, "x": 9.0}],
    }
    assert paired_by_seed(groups, lambda r: r["x"]) == ([1.0, 3.0], [0.5, 1.0])
    assert paired_by_seed({"diff": groups["diff"]}, lambda r: r["x"]) == ([], [])
    d = paired_difference([1.0, 3.0], [0.5, 1.0])
    assert difference_cell(d) == f"+1.2500 [{d.low:+.4f}, {d.high:+.4f}]"
    equal = paired_difference([1.0, 2.0], [0.0, 1.0])
    assert difference_cell(equal) == "+1.0000 (equal in all 2 seeds: no interval)"
    assert difference_cell(equal, why=False) == "+1.0000 (no interval)"
    assert (
        difference_cell(paired_difference([1.0], [0.5]), "{:+.2f}")
        == "+0.50 (one seed: no interval)"
    )
    assert difference_cell(paired_difference([], [])) == "n/a"
