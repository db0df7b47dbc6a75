"""Multi-needle retrieval (the paper's Table 2): accuracy over context lengths x needle depths.

Examples come from the generator behind ``data.source=needle``
(:class:`diffjax.data.NeedleSource`: N needles at random depths in corpus text, R of them
asked at the end). Each query is scored on its own: correct when every digit of its answer is
the model's greedy (argmax) prediction. Queries are binned by the depth of the needle they ask
for (its start as a fraction of the haystack), so a cell is "retrieval of a needle at this
depth with N - 1 distractor needles around it".

The analysis (:class:`Retrieval`, one grid per needle setting) has its section of eval.md and
its heatmaps here too."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from diffjax.infra import storage
from diffjax.data import DataConfig
from diffjax.data import query_correct as data_query_correct
from diffjax.infra.runtime import Runtime

from diffjax.evaluate import paper, plots
from diffjax.evaluate.analysis import DOC, Analysis, Run, image, model_name, paired, table
from diffjax.evaluate.inputs import ModelInputs, needle_task, task_examples
from diffjax.evaluate.probe import check_model, losses_and_predictions
from diffjax.evaluate.results import seed_mean
from diffjax.evaluate.stats import fmt_mean_std


def query_correct(preds_or_logits, batch: dict) -> np.ndarray:
    """``[B, R]`` bool: query r of example b has every answer token (``answer_spans[b, r]``, in
    target positions) predicted exactly. ``preds_or_logits``: ``[B, T]`` ids or ``[B, T, V]``.
    The first half of :func:`diffjax.data.query_correct` (which also says which queries have an
    answer)."""
    return data_query_correct(preds_or_logits, batch)[0]


def query_depths(batch: dict) -> np.ndarray:
    """``[B, R]``: the depth (fraction of the haystack) of the needle each query asks for."""
    depths, asked = np.asarray(batch["needle_depths"]), np.asarray(batch["query_needle"])
    return np.take_along_axis(depths, asked, axis=1)


def depth_bins(depths: np.ndarray, num_bins: int) -> np.ndarray:
    """Bin index of each depth: the nearest of ``num_bins`` evenly spaced centres in [0, 1]."""
    if num_bins < 1:
        raise ValueError(f"depth_bins: num_bins must be >= 1, got {num_bins}")
    if num_bins == 1:
        return np.zeros(np.shape(depths), int)
    return np.clip(np.rint(np.asarray(depths) * (num_bins - 1)), 0, num_bins - 1).astype(int)


@dataclasses.dataclass
class RetrievalGrid:
    """Per (context length, depth bin): ``correct`` and ``total`` query counts."""

    lengths: list[int]
    depths: list[float]  # bin centres
    num_needles: int
    num_queries: int
    correct: np.ndarray  # [L, D] int
    total: np.ndarray  # [L, D] int

    @property
    def accuracy(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.total > 0, self.correct / np.maximum(self.total, 1), np.nan)

    def length_accuracy(self) -> np.ndarray:
        """Accuracy per length over every depth (``[L]``)."""
        return self.correct.sum(1) / np.maximum(self.total.sum(1), 1)

    def overall(self) -> float:
        return float(self.correct.sum() / max(self.total.sum(), 1))

    def to_dict(self) -> dict:
        return {
            "lengths": self.lengths,
            "depths": self.depths,
            "num_needles": self.num_needles,
            "num_queries": self.num_queries,
            "correct": self.correct.tolist(),
            "total": self.total.tolist(),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "RetrievalGrid":
        return cls(
            d["lengths"],
            d["depths"],
            d["num_needles"],
            d["num_queries"],
            np.asarray(d["correct"]),
            np.asarray(d["total"]),
        )


def multi_needle_retrieval(
    model,
    *,
    lengths: Sequence[int],
    num_needles: int,
    num_queries: int,
    data: DataConfig | None = None,
    num_examples: int = 64,
    num_depth_bins: int = 5,
    batch_size: int = 8,
    seed: int = 0,
    query_replacement: bool = False,
    runtime: Runtime | None = None,
) -> RetrievalGrid:
    """Retrieval accuracy of ``model`` on the needle task, per context length and needle depth.

    ``data``: the run's data config (keys, values and haystack text are taken from it when it
    is a needle task). ``num_examples`` examples per length (validation split, seed ``seed``),
    each with ``num_queries`` scored queries (drawn with replacement with
    ``query_replacement``). ``runtime``: the mesh and context spec the forward runs with
    (:func:`.probe.losses_and_predictions`)."""
    check_model(model)
    lengths = [int(x) for x in lengths]
    too_long = [x for x in lengths if x > model.config.max_seq_len]
    if too_long:
        raise ValueError(
            f"multi_needle_retrieval: lengths {too_long} exceed the model's "
            f"max_seq_len {model.config.max_seq_len}. Fix: drop them"
        )
    correct = np.zeros((len(lengths), num_depth_bins), int)
    total = np.zeros_like(correct)
    for li, length in enumerate(lengths):
        cfg = needle_task(
            data,
            seq_len=length,
            num_needles=num_needles,
            num_queries=num_queries,
            num_examples=num_examples,
            seed=seed,
            query_replacement=query_replacement,
        )
        batch = task_examples(cfg)
        preds = losses_and_predictions(model, batch, batch_size, runtime)[1]
        ok = query_correct(preds, batch)
        bins = depth_bins(query_depths(batch), num_depth_bins)
        np.add.at(correct[li], bins.ravel(), ok.ravel().astype(int))
        np.add.at(total[li], bins.ravel(), 1)
    centres = list(np.linspace(0, 1, num_depth_bins)) if num_depth_bins > 1 else [0.5]
    return RetrievalGrid(
        lengths, [float(c) for c in centres], num_needles, num_queries, correct, total
    )


# ---------------------------------------------------------------------------- the analysis
@dataclasses.dataclass(frozen=True)
class Retrieval:
    """One grid per needle setting ``"N,R"`` measured (the run's own first, then the paper's
    that fit the context)."""

    grids: dict[str, RetrievalGrid]

    def to_dict(self) -> dict:
        return {s: g.to_dict() for s, g in self.grids.items()}

    @classmethod
    def from_dict(cls, d: dict) -> "Retrieval":
        return cls({s: RetrievalGrid.from_dict(g) for s, g in d.items()})

    def overall(self, setting: str) -> float | None:
        """Accuracy over every length and depth of ``setting``; None where not measured."""
        g = self.grids.get(setting)
        return None if g is None else g.overall()

    def at(self, setting: str, length: int) -> float | None:
        """Accuracy over every depth of ``setting`` at ``length``; None where not measured."""
        g = self.grids.get(setting)
        if g is None or length not in g.lengths:
            return None
        i = g.lengths.index(length)
        return g.correct[i].sum() / max(g.total[i].sum(), 1)


def measure(inputs: ModelInputs) -> Retrieval:
    """The run's own needle setting, and (full set) the paper's settings, at the trained
    context (quick) or a quarter, half, one and the longest context the model takes."""
    n0, r0 = inputs.needle_setting
    settings_nr = [(n0, r0)]
    if not inputs.settings.quick:
        settings_nr += [s for s in paper.RETRIEVAL_SETTINGS if s != (n0, r0)]
    grids = {}
    for n, r in settings_nr:
        ls = [x for x in inputs.lengths if inputs.fits(x, n, r)]
        if ls:
            grids[f"{n},{r}"] = multi_needle_retrieval(
                inputs.model,
                lengths=ls,
                num_needles=n,
                num_queries=r,
                data=inputs.data,
                num_examples=inputs.settings.retrieval_examples,
                num_depth_bins=inputs.settings.depth_bins,
                batch_size=inputs.settings.batch_size,
                query_replacement=inputs.replacement(n, r),
            )
    return Retrieval(grids)


def figures(run: Run, settings_nr: list[str]) -> dict[str, str]:
    """Per needle setting ``"N,R"``: accuracy heatmaps by context length and depth, mean over
    seeds, one panel per model. Returns ``{setting: file name}`` for the settings drawn."""
    out = {}
    for s in settings_nr:
        grids = {}
        for lab, rs in run.groups.items():
            gs = [r.get("retrieval").grids[s] for r in rs if _has(r, s)]
            if gs:
                acc = seed_mean([g.accuracy for g in gs])
                grids[model_name(lab, rs)] = (gs[0].lengths, gs[0].depths, acc)
        if grids:
            n, r = s.split(",")
            out[s] = f"eval_retrieval_N{n}_R{r}.png"
            plots.retrieval_heatmaps(
                grids,
                f"retrieval accuracy, N={n} needles, R={r} queried",
                storage.join(run.run_dir, out[s]),
            )
    return out


def _has(r, setting: str) -> bool:
    got = r.get("retrieval")
    return got is not None and setting in got.grids


def section(run: Run) -> list[str]:
    L = ["## 1. Multi-needle retrieval (paper Table 2)", ""]
    settings_nr = sorted(
        {k for got in run.measured("retrieval") for k in got.grids},
        key=lambda s: tuple(map(int, s.split(","))),
    )
    if not settings_nr:
        return L + ["Not measured: the run's context is too short for a needle and a query.", ""]
    columns = (
        ["N needles, R queried", "context"]
        + run.names()
        + ["paper Transformer (3B, 4K)", "paper DIFF (3B, 4K)"]
    )
    rows = []
    for s in settings_nr:
        n, r_ = map(int, s.split(","))
        g0 = next(got.grids[s] for got in run.measured("retrieval") if s in got.grids)
        p = paper.RETRIEVAL.get((n, r_))
        name = f"N={n}, R={r_}" + (" (with replacement)" if r_ > n else "")
        for li, length in enumerate(g0.lengths):
            cells = [
                fmt_mean_std([_at(r, s, length) for r in run.groups[lab]], "{:.2f}")
                for lab in run.labels
            ]
            last = p and li == len(g0.lengths) - 1
            rows.append(
                [name, str(length)] + cells + ([f"{p[0]:.2f}", f"{p[1]:.2f}"] if last else ["", ""])
            )
    L += table(columns, rows)
    replacement = any(int(x.split(",")[1]) > int(x.split(",")[0]) for x in settings_nr)
    L += [
        "",
        f"Accuracy per query, {run.settings.retrieval_examples} examples per row, over the "
        f"needle depths (heatmaps below: by depth); paper values at 4K context, on the last row "
        f"of each setting"
        + (
            "; rows with replacement (R > N) count repeated queries too, the validation table "
            "above gives the first query alone"
            if replacement
            else ""
        )
        + f". What it measures: {DOC}, section 1.",
        "",
    ]
    for s, fname in figures(run, settings_nr).items():
        if s == settings_nr[0] or not run.settings.quick:
            L += image(f"retrieval N,R={s}", fname)
    lines_ = [
        x
        for s in settings_nr
        for x in paired(run.groups, lambda r, s=s: _overall(r, s), f"retrieval accuracy N,R={s}")
    ]
    return L + lines_ + [""]


def _at(r, setting: str, length: int) -> float | None:
    got = r.get("retrieval")
    return None if got is None else got.at(setting, length)


def _overall(r, setting: str) -> float | None:
    got = r.get("retrieval")
    return None if got is None else got.overall(setting)


ANALYSIS = Analysis("retrieval", Retrieval, measure, section)
