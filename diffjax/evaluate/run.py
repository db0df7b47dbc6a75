"""``python -m diffjax.evaluate RUN_DIR [--quick]``: every analysis on every model of a run.

:func:`discover_models` finds the models a ``train.py`` run wrote (``RUN_DIR/<label>/`` or
``RUN_DIR/<label>/seed_<n>/``, each holding ``checkpoints/``); :func:`evaluate_run` loads the
best checkpoint of each, runs the analyses and writes ``RUN_DIR/eval.md``, ``RUN_DIR/eval.json``
and the plots ``RUN_DIR/eval_*.png``."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from typing import Any, Callable

import numpy as np

from diffjax.config import ConfigError
from diffjax.data import DataConfig, query_kinds

from . import allocation as alloc_lib
from . import noise_floor as nf
from . import outliers as outl
from . import plots
from . import positions as pos
from . import quantize as quant
from . import retrieval as ret
from diffjax.train.stats import describe_difference, paired_difference

from .stats import fmt_mean_std

# The paper's numbers (shared/reference/diff-transformer.md), as (Transformer, DIFF).
PAPER_SCALE = "the paper's 3B-size models at 4K context"
PAPER_RETRIEVAL = {
    (1, 1): (1.00, 1.00),
    (2, 2): (0.85, 0.92),
    (4, 2): (0.62, 0.84),
    (6, 2): (0.55, 0.85),
}
PAPER_ALLOCATION = {  # depth: (answer T, answer DIFF, noise T, noise DIFF)
    0.0: (0.03, 0.27, 0.51, 0.01),
    0.25: (0.03, 0.30, 0.54, 0.02),
    0.5: (0.03, 0.31, 0.52, 0.02),
    0.75: (0.07, 0.32, 0.49, 0.02),
    1.0: (0.09, 0.40, 0.49, 0.01),
}
PAPER_OUTLIERS = {
    "attention logits": {"top-1": (318.0, 38.8), "top-10": (284.7, 32.0), "median": (5.4, 3.3)},
    "hidden states": {"top-1": (3608.6, 1688.2), "top-10": (3552.1, 1624.3), "median": (0.6, 1.2)},
}
NOISE_MARGIN = 5.0  # logit margin of the signal key in the closed-form noise floor
NOISE_LAMBDA = 0.8  # lambda of the closed form (the depth schedule's deep-layer value)


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """One trained model of a run: ``label`` (first folder under the run), ``seed``, folder."""

    label: str
    seed: int
    path: str


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """How much of each analysis to run. :meth:`for_run` gives the quick or full set."""

    quick: bool
    retrieval_examples: int
    allocation_examples: int
    val_examples: int
    outlier_examples: int
    depth_bins: int = 5
    bits: tuple[int, ...] = quant.PAPER_BITS
    batch_size: int = 8
    loss_buckets: int = 16

    @classmethod
    def for_run(cls, quick: bool) -> "EvalSettings":
        if quick:
            return cls(
                True,
                retrieval_examples=16,
                allocation_examples=8,
                val_examples=16,
                outlier_examples=4,
            )
        return cls(
            False,
            retrieval_examples=128,
            allocation_examples=64,
            val_examples=128,
            outlier_examples=16,
        )


# ---------------------------------------------------------------------------- discovery
def discover_models(run_dir: str, default_seed: int = 0) -> list[ModelEntry]:
    """Every folder under ``run_dir`` holding a ``checkpoints/`` folder with a committed step,
    as ``ModelEntry(label, seed, path)``: label = the first path component under ``run_dir``
    (the run folder's own name when the checkpoints are directly in it), seed = ``n`` of a
    ``seed_<n>`` component, else ``default_seed``. Sorted by label then seed."""
    from diffjax.train.checkpoint import committed_steps

    run_dir = os.path.abspath(run_dir)
    found = []
    for root, dirs, _ in os.walk(run_dir):
        if "checkpoints" in dirs and committed_steps(os.path.join(root, "checkpoints")):
            rel = os.path.relpath(root, run_dir)
            parts = [] if rel == "." else rel.split(os.sep)
            label = parts[0] if parts else os.path.basename(run_dir)
            seed = default_seed
            for p in parts:
                m = re.fullmatch(r"seed_(\d+)", p)
                if m:
                    seed = int(m.group(1))
            found.append(ModelEntry(label, seed, root))
        dirs[:] = [d for d in dirs if d != "checkpoints"]
    order = {"diff": 0, "standard": 1}
    return sorted(found, key=lambda e: (order.get(e.label, 2), e.label, e.seed))


def read_run_config(run_dir: str) -> dict[str, Any]:
    """``RUN_DIR/config.json`` (``ExperimentConfig.to_dict()``)."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(
            f"{run_dir} has no config.json. Fix: pass a run directory written by "
            f"train.py (e.g. runs/default)"
        )
    with open(path) as f:
        return json.load(f)


def data_config(cfg: dict[str, Any]) -> DataConfig:
    """The run's ``DataConfig`` (fields this version does not know are ignored)."""
    names = {f.name for f in dataclasses.fields(DataConfig)}
    return DataConfig(**{k: v for k, v in cfg.get("data", {}).items() if k in names})


# ---------------------------------------------------------------------------- one model
def _needle_setting(data: DataConfig) -> tuple[int, int]:
    return (data.num_needles, data.num_queries) if data.source == "needle" else (1, 1)


def _replacement(data: DataConfig, n: int, r: int) -> bool:
    """The run's own needle setting keeps its query_replacement; the paper's settings ask R
    distinct needles."""
    return data.source == "needle" and data.query_replacement and (n, r) == _needle_setting(data)


def _task(data: DataConfig, seq_len: int, n: int, r: int, **kw) -> DataConfig:
    return ret.needle_task(
        data,
        seq_len=seq_len,
        num_needles=n,
        num_queries=r,
        query_replacement=_replacement(data, n, r),
        **kw,
    )


def _fits(data: DataConfig, seq_len: int, n: int, r: int) -> bool:
    try:
        _task(data, seq_len, n, r)
        return True
    except ConfigError:
        return False


def evaluate_model(
    model, data: DataConfig, settings: EvalSettings, log: Callable[[str], Any] = print
) -> dict[str, Any]:
    """Every analysis on one model; a JSON-able dict."""
    bs = settings.batch_size
    seq_len, max_len = data.seq_len, model.config.max_seq_len
    out: dict[str, Any] = {"attention": model.config.attention}
    lam = model.lambdas() if model.config.attention == "diff_v1" else None
    out["lambda"] = None if lam is None else [float(x) for x in lam]

    t0 = time.perf_counter()
    val = pos.validation_examples(data, settings.val_examples)
    losses, preds = _lp(model, val, bs)
    out["val_loss"], out["val_ppl"] = pos.validation_loss(losses, val["weights"])
    if "answer_spans" in val:
        correct = ret.query_correct(preds, val)
        out["val_accuracy"] = float(np.mean(correct))
        if "query_needle" in val or "query_pair" in val:
            first, repeat = query_kinds(val)
            out["val_first_query_accuracy"] = float(np.mean(correct[first]))
            if repeat.any():
                out["val_repeat_query_accuracy"] = float(np.mean(correct[repeat]))
    log(f"    validation loss {out['val_loss']:.4f} ({time.perf_counter() - t0:.1f}s)")

    # 6. loss by position (long contexts: the model's max_seq_len in the full set)
    t0 = time.perf_counter()
    length = seq_len if settings.quick else max_len
    corpus = pos.corpus_for_positions(data, length)
    if corpus is not None:
        if corpus == data:
            pl, pw = losses, val["weights"]
        else:
            ex = pos.validation_examples(corpus, settings.val_examples)
            pl, pw = _lp(model, ex, bs)[0], ex["weights"]
        ends, by_pos = pos.loss_by_position(pl, pw, settings.loss_buckets)
        out["positions"] = {
            "length": length,
            "trained_length": seq_len,
            "ends": ends.tolist(),
            "loss": by_pos.tolist(),
        }
        log(f"    loss by position at {length} ({time.perf_counter() - t0:.1f}s)")

    # 1. multi-needle retrieval
    t0 = time.perf_counter()
    n0, r0 = _needle_setting(data)
    settings_nr = [(n0, r0)]
    if not settings.quick:
        settings_nr += [s for s in ret.PAPER_SETTINGS if s != (n0, r0)]
    lengths = (
        [seq_len]
        if settings.quick
        else sorted({x for x in (seq_len // 4, seq_len // 2, seq_len, max_len) if x <= max_len})
    )
    out["retrieval"] = {}
    for n, r in settings_nr:
        ls = [x for x in lengths if _fits(data, x, n, r)]
        if not ls:
            continue
        grid = ret.multi_needle_retrieval(
            model,
            lengths=ls,
            num_needles=n,
            num_queries=r,
            data=data,
            num_examples=settings.retrieval_examples,
            num_depth_bins=settings.depth_bins,
            batch_size=bs,
            query_replacement=_replacement(data, n, r),
        )
        out["retrieval"][f"{n},{r}"] = grid.to_dict()
    log(f"    retrieval ({time.perf_counter() - t0:.1f}s)")

    # 2. attention allocation and 5. the measured noise floor
    t0 = time.perf_counter()
    if _fits(data, seq_len, n0, r0):
        batch = ret.task_examples(
            _task(data, seq_len, n0, r0, num_examples=settings.allocation_examples, seed=1)
        )
        a = alloc_lib.attention_allocation(
            model, batch, num_depth_bins=settings.depth_bins, batch_size=bs
        )
        out["allocation"] = a.to_dict()
        out["noise_measured"] = []
        for x in [seq_len] if settings.quick else lengths:
            if not _fits(data, x, n0, r0):
                continue
            b = (
                batch
                if x == seq_len
                else ret.task_examples(
                    _task(data, x, n0, r0, num_examples=settings.allocation_examples, seed=1)
                )
            )
            m = alloc_lib.measured_noise_floor(model, b, batch_size=bs)
            out["noise_measured"].append({"length": x, **m})
    log(f"    attention allocation and noise floor ({time.perf_counter() - t0:.1f}s)")

    # 3. activation outliers
    t0 = time.perf_counter()
    ocorpus = pos.corpus_for_positions(data, seq_len)
    otokens = (
        pos.validation_examples(ocorpus, settings.outlier_examples)["inputs"]
        if ocorpus is not None
        else val["inputs"][: settings.outlier_examples]
    )
    out["outliers"] = outl.activation_outliers(model, otokens, batch_size=min(bs, 4))
    out["outliers"]["tokens"] = int(otokens.size)
    log(f"    activation outliers ({time.perf_counter() - t0:.1f}s)")

    # 4. quantization
    t0 = time.perf_counter()
    task = val if "answer_spans" in val else None
    if task is None and _fits(data, seq_len, n0, r0):
        task = ret.task_examples(
            _task(data, seq_len, n0, r0, num_examples=settings.retrieval_examples)
        )
    out["quantization"] = quant.quantization_sweep(
        model, val, task, bits=settings.bits, batch_size=bs
    )
    log(f"    quantization ({time.perf_counter() - t0:.1f}s)")
    return out


def _lp(model, batch, bs):
    from .probe import losses_and_predictions

    return losses_and_predictions(model, batch, bs)


# ---------------------------------------------------------------------------- the run
def _scale(entry: ModelEntry, model, cfg: dict[str, Any]) -> dict[str, Any]:
    from diffjax.param_count import count_params
    from diffjax.train.checkpoint import Checkpointer

    ckpt = Checkpointer(os.path.join(entry.path, "checkpoints"), async_save=False)
    try:
        step = ckpt.best_step()
    finally:
        ckpt.close()
    t, d = cfg.get("train", {}), cfg.get("data", {})
    tokens = int(step or 0) * int(t.get("batch_size", 0)) * int(d.get("seq_len", 0))
    return {"params": count_params(model).total, "step": step, "tokens": tokens}


def evaluate_run(
    run_dir: str,
    *,
    quick: bool = False,
    log: Callable[[str], Any] = print,
    settings: EvalSettings | None = None,
) -> str:
    """Evaluate every model of a ``train.py`` run; write ``eval.md``, ``eval.json`` and the
    plots into ``run_dir``; return the markdown. ``quick``: a small subset (one context length,
    few examples: 51 s of CPU time for the default comparison's two models). ``settings``
    overrides the quick/full choice (e.g. fewer examples or bit widths)."""
    from diffjax.train.checkpoint import load_model

    run_dir = os.path.abspath(run_dir)
    if not os.path.isdir(run_dir):
        raise ConfigError(
            f"run directory {run_dir} does not exist. Fix: pass the folder "
            f"train.py wrote (e.g. runs/default)"
        )
    cfg = read_run_config(run_dir)
    data = data_config(cfg)
    entries = discover_models(run_dir, default_seed=int(cfg.get("train", {}).get("seed", 0)))
    if not entries:
        raise ConfigError(
            f"{run_dir} holds no model with a committed checkpoint (looked for "
            f"*/checkpoints/<step>). Fix: train first (python train.py), or pass "
            f"the run's own folder"
        )
    settings = EvalSettings.for_run(quick) if settings is None else settings
    results = []
    for e in entries:
        log(f"evaluating {e.label} (seed {e.seed}) from {e.path}")
        model = load_model(e.path, "best")
        r = evaluate_model(model, data, settings, log)
        r.update(
            label=e.label,
            seed=e.seed,
            path=os.path.relpath(e.path, run_dir),
            **_scale(e, model, cfg),
        )
        results.append(r)
    noise = nf.noise_floor_closed_form(nf.DEFAULT_NS, NOISE_MARGIN, NOISE_LAMBDA)
    text = render(run_dir, cfg, data, settings, results, noise)
    with open(os.path.join(run_dir, "eval.md"), "w") as f:
        f.write(text)
    with open(os.path.join(run_dir, "eval.json"), "w") as f:
        json.dump(
            {
                "quick": quick,
                "models": results,
                "noise_closed_form": {k: np.asarray(v).tolist() for k, v in noise.items()},
            },
            f,
            indent=1,
            default=_json_default,
        )
    log(f"evaluation: {os.path.join(run_dir, 'eval.md')}")
    return text


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


# ---------------------------------------------------------------------------- markdown
def _by_label(results) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in results:
        out.setdefault(r["label"], []).append(r)
    return out


def _get(r: dict, *keys, default=None):
    for k in keys:
        if isinstance(r, dict) and k in r:
            r = r[k]
        elif isinstance(r, list) and isinstance(k, int) and k < len(r):
            r = r[k]
        else:
            return default
    return r


def _paired_line(groups, getter, what: str, unit: str = "") -> str | None:
    """``DIFF - twin`` over the seeds both have, with a 95% t-interval."""
    if "diff" not in groups or "standard" not in groups:
        return None
    a = {r["seed"]: getter(r) for r in groups["diff"]}
    b = {r["seed"]: getter(r) for r in groups["standard"]}
    seeds = sorted(s for s in a if s in b and a[s] is not None and b[s] is not None)
    if not seeds:
        return None
    d = paired_difference([a[s] for s in seeds], [b[s] for s in seeds])
    return f"- {describe_difference(d, what + (f' ({unit})' if unit else ''))}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(r) + " |" for r in rows
    ]


def _col_name(label: str, rs: list[dict]) -> str:
    return f"{label} ({rs[0]['attention']})"


def render(
    run_dir: str,
    cfg: dict,
    data: DataConfig,
    settings: EvalSettings,
    results: list[dict],
    noise: dict,
) -> str:
    groups = _by_label(results)
    labels = list(groups)
    name = os.path.basename(run_dir)
    seeds = sorted({r["seed"] for r in results})
    L = []
    L += [f"# Evaluation of {name}" + (" (quick subset)" if settings.quick else ""), ""]
    scale = "; ".join(
        f"{lab}: {rs[0]['attention']}, {rs[0]['params']:,} parameters, "
        f"{fmt_mean_std([r['tokens'] for r in rs], '{:,.0f}')} training tokens (best checkpoint, "
        f"step {', '.join(str(r['step']) for r in rs)}), seeds {[r['seed'] for r in rs]}"
        for lab, rs in groups.items()
    )
    L += [
        f"**Our scale**: {scale}. Trained on `{data.source}` at context {data.seq_len}. "
        f"With several seeds a cell is mean ± standard deviation over seeds. "
        f"**Paper columns** are {PAPER_SCALE} (DIFF V1), quoted for the shape of the result, "
        f"not as a target at this scale.",
        "",
    ]
    if settings.quick:
        L += [
            "Quick subset: one context length, few examples per cell "
            f"({settings.retrieval_examples} retrieval, {settings.allocation_examples} "
            f"allocation, {settings.val_examples} validation, {settings.outlier_examples} "
            f"outlier examples); run `python -m diffjax.evaluate {run_dir}` for the full set.",
            "",
        ]
    zero_shot = data.source != "needle"
    if zero_shot:
        L += [
            f"The models were trained on `{data.source}`, not on the needle task: the "
            f"retrieval, allocation and measured noise-floor numbers below are zero-shot on a "
            f"task they never saw, and say little about retrieval.",
            "",
        ]

    # validation
    L += ["## Validation loss and perplexity", ""]
    rows = [
        ["validation loss (nats/token)"]
        + [fmt_mean_std([r["val_loss"] for r in groups[lab]], "{:.4f}") for lab in labels],
        ["validation perplexity"]
        + [fmt_mean_std([r["val_ppl"] for r in groups[lab]], "{:.3f}") for lab in labels],
    ]
    if any("val_accuracy" in r for r in results):
        rows.append(
            ["answer accuracy (validation)"]
            + [fmt_mean_std([r.get("val_accuracy") for r in groups[lab]]) for lab in labels]
        )
    for key, name in (
        ("val_first_query_accuracy", "first query (only the needles or pairs hold its answer)"),
        ("val_repeat_query_accuracy", "repeated queries (copyable from an earlier one)"),
    ):
        if any(key in r for r in results):
            rows.append(
                [name] + [fmt_mean_std([r.get(key) for r in groups[lab]]) for lab in labels]
            )
    L += _table([""] + [_col_name(lab, groups[lab]) for lab in labels], rows)
    L += [""]
    line = _paired_line(groups, lambda r: r["val_loss"], "validation loss", "nats")
    if line:
        L += [line, ""]
    L += [
        f"Over {settings.val_examples} validation examples of the run's data spread over the "
        f"split ({'answer tokens only' if data.is_synthetic else 'every token'}); not the "
        f"same batches as the training report's, so the numbers differ slightly.",
        "",
    ]

    # 1. retrieval
    L += ["## 1. Multi-needle retrieval (paper Table 2)", ""]
    settings_nr = sorted(
        {k for r in results for k in r.get("retrieval", {})},
        key=lambda s: tuple(map(int, s.split(","))),
    )
    if settings_nr:
        header = (
            ["N needles, R queried", "context"]
            + [_col_name(lab, groups[lab]) for lab in labels]
            + ["paper Transformer (3B, 4K)", "paper DIFF (3B, 4K)"]
        )
        rows = []
        for s in settings_nr:
            n, r_ = map(int, s.split(","))
            g0 = next(r["retrieval"][s] for r in results if s in r.get("retrieval", {}))
            for li, length in enumerate(g0["lengths"]):
                cells = []
                for lab in labels:
                    vals = []
                    for r in groups[lab]:
                        g = r.get("retrieval", {}).get(s)
                        if g and length in g["lengths"]:
                            i = g["lengths"].index(length)
                            vals.append(sum(g["correct"][i]) / max(sum(g["total"][i]), 1))
                    cells.append(fmt_mean_std(vals, "{:.2f}"))
                p = PAPER_RETRIEVAL.get((n, r_))
                name = f"N={n}, R={r_}" + (" (with replacement)" if r_ > n else "")
                rows.append(
                    [name, str(length)]
                    + cells
                    + (
                        [f"{p[0]:.2f}", f"{p[1]:.2f}"]
                        if p and li == len(g0["lengths"]) - 1
                        else ["", ""]
                    )
                )
        L += _table(header, rows)
        L += [
            "",
            f"Accuracy per query (all answer digits right, greedy), "
            f"{settings.retrieval_examples} examples per row, averaged over the needle "
            f"depths (heatmaps below: by depth, bins centred at 0, 25, 50, 75, 100%). "
            f"Paper values are at 4K context (the last row of each setting)."
            + (
                " Rows with replacement (R > N) count repeated queries too, which can be "
                "copied from the earlier query of the same key: the validation table above "
                "gives the first query alone, which only the needles answer."
                if any(int(x.split(",")[1]) > int(x.split(",")[0]) for x in settings_nr)
                else ""
            ),
            "",
        ]
        s0 = settings_nr[0]
        for s in settings_nr:
            grids = {}
            for lab in labels:
                gs = [r["retrieval"][s] for r in groups[lab] if s in r.get("retrieval", {})]
                if gs:
                    acc = _nanmean(
                        [
                            ret.RetrievalGrid(
                                g["lengths"],
                                g["depths"],
                                0,
                                0,
                                np.asarray(g["correct"]),
                                np.asarray(g["total"]),
                            ).accuracy
                            for g in gs
                        ]
                    )
                    grids[_col_name(lab, groups[lab])] = (gs[0]["lengths"], gs[0]["depths"], acc)
            if grids:
                fname = f"eval_retrieval_N{s.replace(',', '_R')}.png"
                plots.retrieval_heatmaps(
                    grids,
                    f"retrieval accuracy, N={s.split(',')[0]} needles, R={s.split(',')[1]} queried",
                    os.path.join(run_dir, fname),
                )
                if s == s0 or not settings.quick:
                    L += [f"![retrieval N,R={s}]({fname})", ""]
        lines_ = [
            _paired_line(groups, lambda r, s=s: _retr_overall(r, s), f"retrieval accuracy N,R={s}")
            for s in settings_nr
        ]
        L += [x for x in lines_ if x] + [""]
    else:
        L += ["Not measured: the run's context is too short for a needle and a query.", ""]

    # 2. allocation
    L += ["## 2. Attention allocation (paper Table 3)", ""]
    if any("allocation" in r for r in results):
        a0 = next(r["allocation"] for r in results if "allocation" in r)
        cats = a0["categories"]
        ia, inoise = cats.index("answer"), cats.index("noise context")
        header = ["depth"]
        for lab in labels:
            header += [f"{lab}: answer", f"{lab}: noise"]
        header += ["paper T: answer", "paper DIFF: answer", "paper T: noise", "paper DIFF: noise"]
        rows = []
        for di, d in enumerate(a0["depths"]):
            row = [f"{d:.0%}"]
            for lab in labels:
                for c in (ia, inoise):
                    row.append(
                        fmt_mean_std(
                            [_get(r, "allocation", "shares", di, c) for r in groups[lab]], "{:.3f}"
                        )
                    )
            p = PAPER_ALLOCATION.get(round(d, 2))
            row += [f"{x:.2f}" for x in p] if p else ["", "", "", ""]
            rows.append(row)
        L += _table(header, rows)
        counts = ", ".join(f"{d:.0%}: {c}" for d, c in zip(a0["depths"], a0["count"]))
        L += [
            "",
            f"Share of attention from the answer-producing positions (the inputs whose "
            f"outputs predict the answer digits) to the asked needle's value digits "
            f"(answer) and to the haystack text around the needles (noise), averaged over "
            f"heads, layers, rows and examples; queries per depth bin: {counts}. Standard "
            f"attention: its softmax map. DIFF: the differential map A1 − λ·A2, each row "
            f"divided by its absolute mass Σ_j |A1 − λ·A2|_ij (a softmax row's is 1), so "
            f"cancelled weight shows as a share near 0 (our normalisation: the paper shows "
            f"its own only as an image). Other categories (the asked needle's key and "
            f"template, the other needles, BOS and the query) are in eval.json and the plot.",
            "",
        ]
        bars = {}
        for lab in labels:
            sh = [
                np.asarray(r["allocation"]["shares"], float)
                for r in groups[lab]
                if "allocation" in r
            ]
            if sh:
                bars[_col_name(lab, groups[lab])] = (a0["depths"], _nanmean(sh))
        plots.allocation_bars(
            bars,
            cats,
            os.path.join(run_dir, "eval_allocation.png"),
            "attention allocation of the answer-producing positions",
        )
        L += ["![attention allocation](eval_allocation.png)", ""]
        line = _paired_line(groups, lambda r: _alloc_overall(r, ia), "answer share")
        L += [line, ""] if line else []
        L += _retrieval_head_lines(groups, labels, ia)
    else:
        L += ["Not measured: the run's context is too short for the needle task.", ""]

    # 3. outliers
    L += ["## 3. Activation outliers (paper Table 5)", ""]
    header = (
        ["activation", "statistic"]
        + [_col_name(lab, groups[lab]) for lab in labels]
        + ["paper Transformer (3B)", "paper DIFF (3B)"]
    )
    rows = []
    for kind in ("attention logits", "hidden states"):
        for stat in [f"top-{k}" for k in outl.KS] + ["median"]:
            p = PAPER_OUTLIERS[kind].get(stat)
            rows.append(
                [kind, stat]
                + [
                    fmt_mean_std([_get(r, "outliers", kind, stat) for r in groups[lab]], "{:.3f}")
                    for lab in labels
                ]
                + ([f"{p[0]}", f"{p[1]}"] if p else ["", ""])
            )
    L += _table(header, rows)
    tokens = results[0]["outliers"]["tokens"]
    L += [
        "",
        f"Magnitudes over {tokens:,} tokens of validation text: attention logits "
        f"|q·k|/√d of every head and layer (both maps for DIFF), the causally visible "
        f"entries only; hidden states at the output of each block. (As the paper's authors "
        f"describe it in microsoft/unilm issue 1666.)",
        "",
    ]
    line = _paired_line(
        groups, lambda r: _get(r, "outliers", "attention logits", "top-1"), "top-1 attention logit"
    )
    L += [line, ""] if line else []
    ks = np.array(outl.KS, float)
    series = {
        f"{lab}: {kind}": (
            ks,
            np.array(
                [
                    np.mean([_get(r, "outliers", kind, f"top-{k}") for r in groups[lab]])
                    for k in outl.KS
                ]
            ),
        )
        for kind in ("attention logits", "hidden states")
        for lab in labels
    }
    plots.lines(
        series,
        xlabel="k (top-k magnitude)",
        ylabel="magnitude",
        logx=True,
        logy=True,
        title="activation outliers (mean over seeds)",
        path=os.path.join(run_dir, "eval_outliers.png"),
    )
    L += ["![activation outliers](eval_outliers.png)", ""]

    # 4. quantization
    L += ["## 4. Quantization of the attention logits (paper Fig. 8)", ""]
    has_acc = any("accuracy" in q for r in results for q in r["quantization"])
    header = ["logit bits"]
    for lab in labels:
        header += [f"{lab}: val loss"] + ([f"{lab}: accuracy"] if has_acc else [])
    rows = []
    q0 = results[0]["quantization"]
    for i, q in enumerate(q0):
        row = ["float32" if q["bits"] is None else str(q["bits"])]
        for lab in labels:
            row.append(
                fmt_mean_std(
                    [_get(r, "quantization", i, "val_loss") for r in groups[lab]], "{:.4f}"
                )
            )
            if has_acc:
                row.append(
                    fmt_mean_std(
                        [_get(r, "quantization", i, "accuracy") for r in groups[lab]], "{:.3f}"
                    )
                )
        rows.append(row)
    L += _table(header, rows)
    L += [
        "",
        "Each map's logits q·k/√d absmax-quantized (simulated) per example and head "
        "before the softmax: step = max|logit| / (2^(bits−1) − 1), round to nearest. "
        "Paper (Fig. 8, 3B): DIFF keeps its accuracy down to 6 bits, the Transformer "
        "drops at 6 bits, and 4-bit DIFF is about as good as 6-bit Transformer."
        + (
            " Accuracy: retrieval on the run's task."
            if not zero_shot
            else " Accuracy: zero-shot needle retrieval (the models were not trained on it)."
        ),
        "",
    ]
    series = {}
    for lab in labels:
        xs = [q["bits"] or 32 for q in q0]
        series[_col_name(lab, groups[lab])] = (
            np.asarray(xs),
            np.asarray(
                [
                    _nanmean([_get(r, "quantization", i, "val_loss") for r in groups[lab]])
                    for i in range(len(q0))
                ]
            ),
        )
    plots.lines(
        series,
        xlabel="logit bits (32 = float32)",
        ylabel="validation loss",
        title="quantized attention logits",
        path=os.path.join(run_dir, "eval_quantization.png"),
        logx=True,
    )
    L += ["![quantization](eval_quantization.png)", ""]

    # 5. noise floor
    L += ["## 5. The noise floor", ""]
    ns = noise["num_distractors"]
    shown = [i for i, n in enumerate(ns) if int(n) in (1024, 4096, 16384, 65536, 262144)]
    rows = []
    for i in shown:
        sd = noise["diff_signal"][i] / (
            abs(noise["diff_signal"][i]) + abs(noise["diff_distractors"][i])
        )
        dd = noise["diff_distractors"][i] / (
            abs(noise["diff_signal"][i]) + abs(noise["diff_distractors"][i])
        )
        rows.append(
            [
                f"{int(ns[i]):,}",
                f"{noise['softmax_signal'][i]:.4f}",
                f"{noise['softmax_distractors'][i]:.4f}",
                f"{sd:.4f}",
                f"{dd:.4f}",
                f"{noise['diff_snr'][i] / noise['softmax_snr'][i]:.2f}x",
            ]
        )
    L += _table(
        [
            "distractors N",
            "softmax: signal",
            "softmax: distractors",
            "diff: signal",
            "diff: distractors",
            "signal/distractor gain",
        ],
        rows,
    )
    L += [
        "",
        f"Closed form (diffjax.evaluate.noise_floor): one signal key {NOISE_MARGIN:g} "
        f"logits above N equal distractors; the differential map A1 − λ·A2 with λ = "
        f"{NOISE_LAMBDA} and a second map that does not single out the signal. Shares of "
        f"the row's absolute mass. The common-mode distractor mass is cut by λ, so the "
        f"signal-to-distractor ratio gains about 1/(1−λ); the floor still grows with N.",
        "",
    ]
    series = {
        "softmax: signal": (ns, noise["softmax_signal"]),
        "softmax: distractors": (ns, noise["softmax_distractors"]),
        "diff (normalised): signal": (
            ns,
            noise["diff_signal"]
            / (np.abs(noise["diff_signal"]) + np.abs(noise["diff_distractors"])),
        ),
        "diff (normalised): distractors": (
            ns,
            noise["diff_distractors"]
            / (np.abs(noise["diff_signal"]) + np.abs(noise["diff_distractors"])),
        ),
    }
    for lab in labels:
        pts = [m for r in groups[lab] for m in r.get("noise_measured", [])]
        if pts:
            x = np.asarray([m["num_distractors"] for m in pts])
            series[f"{lab} measured: signal"] = (x, np.asarray([m["signal_share"] for m in pts]))
            series[f"{lab} measured: distractors"] = (
                x,
                np.asarray([m["distractor_share"] for m in pts]),
            )
    styles = {
        k: ("x" if k.endswith("measured: signal") else "+" if "measured" in k else "-")
        for k in series
    }
    plots.lines(
        series,
        xlabel="distractors N (measured: distractor positions)",
        ylabel="share of the row's absolute attention",
        title=f"noise floor (margin {NOISE_MARGIN:g}, λ={NOISE_LAMBDA})",
        path=os.path.join(run_dir, "eval_noise_floor.png"),
        logx=True,
        symlog_threshold=1e-4,
        styles=styles,
    )
    L += ["![noise floor](eval_noise_floor.png)", ""]
    if any(r.get("noise_measured") for r in results):
        rows = []
        for lab in labels:
            lengths = sorted(
                {m["length"] for r in groups[lab] for m in r.get("noise_measured", [])}
            )
            for x in lengths:
                ms = [
                    m for r in groups[lab] for m in r.get("noise_measured", []) if m["length"] == x
                ]
                rows.append(
                    [
                        _col_name(lab, groups[lab]),
                        str(x),
                        f"{np.mean([m['num_distractors'] for m in ms]):.0f}",
                        fmt_mean_std([m["signal"] for m in ms], "{:.4f}"),
                        fmt_mean_std([m["distractors"] for m in ms], "{:.4f}"),
                        fmt_mean_std([m["signal_share"] for m in ms], "{:.4f}"),
                        fmt_mean_std([m["distractor_share"] for m in ms], "{:.4f}"),
                        fmt_mean_std([m["snr"] for m in ms], "{:.3f}"),
                    ]
                )
        L += [
            "Measured on the models' own maps (needle examples; answer-producing rows; "
            "signal = the answer span, distractors = the other needles and the haystack "
            "text; raw weights, then shares of the row's absolute mass; averaged over rows, "
            "heads, layers and examples):",
            "",
        ]
        L += _table(
            [
                "model",
                "context",
                "distractor positions",
                "signal (raw)",
                "distractors (raw)",
                "signal share",
                "distractor share",
                "signal-to-distractor ratio",
            ],
            rows,
        )
        L += [""]

    # 6. loss by position
    L += ["## 6. Loss by position", ""]
    if any("positions" in r for r in results):
        p0 = next(r["positions"] for r in results if "positions" in r)
        series = {}
        rows = []
        for lab in labels:
            ps = [np.asarray(r["positions"]["loss"]) for r in groups[lab] if "positions" in r]
            if ps:
                series[_col_name(lab, groups[lab])] = (np.asarray(p0["ends"]), _nanmean(ps))
        idx = sorted({0, len(p0["ends"]) // 2, len(p0["ends"]) - 1})
        for lab in labels:
            rows.append(
                [_col_name(lab, groups[lab])]
                + [
                    fmt_mean_std(
                        [r["positions"]["loss"][i] for r in groups[lab] if "positions" in r],
                        "{:.4f}",
                    )
                    for i in idx
                ]
            )
        starts = [0] + p0["ends"][:-1]
        L += _table(["model"] + [f"positions {starts[i]}–{p0['ends'][i] - 1}" for i in idx], rows)
        plots.lines(
            series,
            xlabel="position (bucket end)",
            ylabel="loss (nats/token)",
            title=f"loss by position at context {p0['length']} (trained at {p0['trained_length']})",
            path=os.path.join(run_dir, "eval_loss_by_position.png"),
        )
        L += [
            "",
            f"Per-token loss on validation text at context {p0['length']} (the models "
            f"were trained at {p0['trained_length']}"
            + (
                "; positions beyond it test length extrapolation"
                if p0["length"] > p0["trained_length"]
                else ""
            )
            + "), in equal position buckets.",
            "",
        ]
        if data.source == "needle":
            L += [
                "**Read with care:** the needle task trains on the answer digits only, so "
                "these models never had a loss on running text and the curve above is not a "
                "language-modelling measure; for this run, far-context use is the retrieval "
                "grid of section 1 (accuracy by context length and depth).",
                "",
            ]
        L += ["![loss by position](eval_loss_by_position.png)", ""]
    else:
        L += ["Not measured: the run's task (MQAR) has no running text.", ""]
    lam = [(r["label"], r["seed"], r["lambda"]) for r in results if r.get("lambda")]
    if lam:
        L += [
            "DIFF V1 λ per layer: "
            + "; ".join(f"{lab} seed {s}: " + ", ".join(f"{x:.3f}" for x in v) for lab, s, v in lam)
            + ".",
            "",
        ]
    L += [
        f"Seeds: {seeds}. Numbers: eval.json. Written by `python -m diffjax.evaluate"
        f"{' --quick' if settings.quick else ''}`.",
        "",
    ]
    return "\n".join(L)


def _nanmean(arrays) -> np.ndarray:
    """Mean over seeds ignoring NaN (empty depth bins), NaN where every seed has NaN."""
    a = (
        np.asarray([np.nan if x is None else x for x in arrays], float)
        if not any(isinstance(x, (list, np.ndarray)) for x in arrays)
        else np.asarray(arrays, float)
    )
    n = np.isfinite(a).sum(0)
    return np.where(n > 0, np.nansum(a, 0) / np.maximum(n, 1), np.nan)


def _retr_overall(r: dict, s: str) -> float | None:
    g = r.get("retrieval", {}).get(s)
    if not g:
        return None
    return float(np.sum(g["correct"]) / max(np.sum(g["total"]), 1))


def _alloc_overall(r: dict, c: int) -> float | None:
    a = r.get("allocation")
    if not a:
        return None
    w = np.asarray(a["count"], float)
    sh = np.nan_to_num(np.asarray(a["shares"], float)[:, c])
    return float((sh * w).sum() / max(w.sum(), 1))


def _retrieval_head_share(r: dict) -> float | None:
    h = _get(r, "allocation", "retrieval_head")
    if not h or h.get("layer") is None or not np.isfinite(h["share"]):
        return None
    return float(h["share"])


def _retrieval_head_lines(groups: dict, labels: list[str], ia: int) -> list[str]:
    """The retrieval-head table: per model, the chosen (layer, head) of each seed, its held-out
    answer share, and the mean over every head for comparison."""
    if not any(_retrieval_head_share(r) is not None for rs in groups.values() for r in rs):
        return []
    rows = []
    for lab in labels:
        rs = [r for r in groups[lab] if _retrieval_head_share(r) is not None]
        if not rs:
            continue
        heads = ", ".join(
            f"L{r['allocation']['retrieval_head']['layer']}."
            f"H{r['allocation']['retrieval_head']['head']}"
            for r in rs
        )
        nheads = np.asarray(rs[0]["allocation"]["per_head"], float).shape[:2]
        rows.append(
            [
                _col_name(lab, rs),
                f"{nheads[0]} x {nheads[1]}",
                heads,
                fmt_mean_std([_retrieval_head_share(r) for r in rs], "{:.3f}"),
                fmt_mean_std([_alloc_overall(r, ia) for r in rs], "{:.3f}"),
            ]
        )
    held = all(
        r["allocation"]["retrieval_head"]["held_out"]
        for rs in groups.values()
        for r in rs
        if _retrieval_head_share(r) is not None
    )
    L = [
        "**The retrieval head.** The mean over heads and layers above mixes the heads that do "
        "the lookup with the rest. Below, per model, the one (layer, head) with the largest "
        "answer share (per seed, LlayerHhead, counted from 0), "
        + (
            "chosen on the even examples and measured on the odd ones, so the maximum over "
            "heads does not inflate the figure"
            if held
            else "chosen and measured on the same examples (too few to hold any out)"
        )
        + "; same normalisation as above. A DIFF head is one differential map (two softmax "
        "maps), so DIFF has half its twin's number of heads to choose from.",
        "",
    ]
    L += _table(
        [
            "model",
            "layers x heads",
            "retrieval head per seed",
            "its answer share (held out)",
            "mean over every head",
        ],
        rows,
    )
    line = _paired_line(groups, _retrieval_head_share, "retrieval head's answer share")
    caveat = (
        "A share of attention is not what a position contributes: a model can look the "
        "answer up through many small weights, and DIFF at CPU scale does (its answer "
        "follows a swapped needle value while none of its heads puts more than a few "
        "percent of its attention on the value; docs/retrieval.md). Read these shares "
        "beside the retrieval accuracy, and run `python benchmarks/lookup_attention.py "
        "RUN_DIR` for that causal check."
    )
    return L + ([""] + [line] if line else []) + ["", caveat, ""]
