"""Validation loss and perplexity, and loss by position (does a model use far context?): the
functions, and the analysis of loss by position (its result :class:`LossByPosition`, its
section of eval.md and its plot)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from diffjax.infra import storage
from diffjax.data import DataConfig

from diffjax.evaluate import plots
from diffjax.evaluate.analysis import DOC, Analysis, Run, image, model_name, table
from diffjax.evaluate.inputs import ModelInputs, validation_examples
from diffjax.evaluate.results import seed_mean
from diffjax.evaluate.stats import fmt_mean_std


def corpus_for_positions(data: DataConfig, seq_len: int) -> DataConfig | None:
    """The corpus to measure loss by position on: the run's corpus, or for a needle run the text
    its haystacks are cut from; None for MQAR (no running text)."""
    if data.source in ("stdlib", "text", "tokens"):
        return data.replace(seq_len=seq_len)
    if data.source == "needle":
        return DataConfig(
            source="stdlib" if data.path is None else "text",
            path=data.path,
            seq_len=seq_len,
            val_fraction=data.val_fraction,
            max_files=data.max_files,
            stdlib=data.stdlib,
            document_mask=False,  # as the haystacks the model trained on
        )
    return None


def validation_loss(losses: np.ndarray, weights: np.ndarray) -> tuple[float, float]:
    """``(weighted mean loss, perplexity exp(loss))`` from per-token losses and weights."""
    w = np.asarray(weights, np.float64)
    if w.sum() <= 0:
        raise ValueError("validation_loss: every weight is 0")
    loss = float((losses * w).sum() / w.sum())
    return loss, math.exp(min(loss, 50.0))


def loss_by_position(
    losses: np.ndarray,
    weights: np.ndarray,
    num_buckets: int = 16,
    positions: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Mean loss in ``num_buckets`` equal position buckets: ``(bucket end positions, loss)``
    (weighted by ``weights``; NaN for a bucket with no weight). ``positions`` ``[B, T]``: each
    token's position counted from its document's start (a batch that keeps documents apart);
    None: its column."""
    t = losses.shape[1]
    num_buckets = max(1, min(num_buckets, t))
    edges = np.linspace(0, t, num_buckets + 1).astype(int)
    pos = np.broadcast_to(np.arange(t), losses.shape) if positions is None else positions
    bucket = np.searchsorted(edges, np.asarray(pos), side="right") - 1
    w = np.asarray(weights, np.float64)
    total = np.bincount(bucket.ravel(), (losses * w).ravel(), minlength=num_buckets)
    weight = np.bincount(bucket.ravel(), w.ravel(), minlength=num_buckets)
    out = np.full(num_buckets, np.nan)
    seen = weight > 0
    out[seen] = total[seen] / weight[seen]
    return edges[1:], out


# ---------------------------------------------------------------------------- the analysis
@dataclasses.dataclass(frozen=True)
class LossByPosition:
    """Mean loss in equal position buckets (``ends``: each bucket's end) at context ``length``
    of a model trained at ``trained_length``."""

    length: int
    trained_length: int
    ends: list[int]
    loss: list[float]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LossByPosition":
        return cls(d["length"], d["trained_length"], list(d["ends"]), list(d["loss"]))


def measure(inputs: ModelInputs) -> LossByPosition | None:
    """On the run's corpus (a needle run: its haystack text) at the trained context (quick) or
    the model's longest; None for a task without running text (MQAR)."""
    data, settings = inputs.data, inputs.settings
    length = data.seq_len if settings.quick else inputs.model.config.max_seq_len
    corpus = corpus_for_positions(data, length)
    if corpus is None:
        return None
    if corpus == data:
        losses, ex = inputs.val_outputs[0], inputs.val
    else:
        ex = validation_examples(corpus, settings.val_examples)
        losses = inputs.losses_and_predictions(ex)[0]
    ends, by_pos = loss_by_position(
        losses, ex["weights"], settings.loss_buckets, ex.get("positions")
    )
    return LossByPosition(length, data.seq_len, ends.tolist(), by_pos.tolist())


def figure(run: Run, p0: LossByPosition) -> str:
    """Loss by position bucket, mean over seeds; ``p0``: one model's result (the bucket ends
    and the lengths)."""
    series = {}
    for lab, rs in run.groups.items():
        ps = [np.asarray(r.get("positions").loss) for r in rs if r.get("positions")]
        if ps:
            series[model_name(lab, rs)] = (np.asarray(p0.ends), seed_mean(ps))
    name = "eval_loss_by_position.png"
    plots.lines(
        series,
        xlabel="position (bucket end)",
        ylabel="loss (nats/token)",
        title=f"loss by position at context {p0.length} (trained at {p0.trained_length})",
        path=storage.join(run.run_dir, name),
    )
    return name


def section(run: Run) -> list[str]:
    L = ["## 6. Loss by position", ""]
    measured = run.measured("positions")
    if not measured:
        return L + ["Not measured: the run's task (MQAR) has no running text.", ""]
    p0 = measured[0]
    ends = p0.ends
    idx = sorted({0, len(ends) // 2, len(ends) - 1})
    rows = [
        [model_name(lab, rs)]
        + [
            fmt_mean_std([r.get("positions").loss[i] for r in rs if r.get("positions")], "{:.4f}")
            for i in idx
        ]
        for lab, rs in run.groups.items()
    ]
    starts = [0] + ends[:-1]
    L += table(["model"] + [f"positions {starts[i]}–{ends[i] - 1}" for i in idx], rows)
    name = figure(run, p0)
    beyond = p0.length > p0.trained_length
    L += [
        "",
        f"Per-token loss on validation text at context {p0.length} (the models were trained "
        f"at {p0.trained_length}"
        + ("; positions beyond it test length extrapolation" if beyond else "")
        + "), in equal position buckets"
        + (
            ", each token's position counted from its document's start"
            if run.data.masks_documents
            else ""
        )
        + f". What it measures: {DOC}, section 6.",
        "",
    ]
    if run.data.source == "needle":
        L += [
            "**Read with care:** the needle task trains on the answer digits only, so this "
            "curve is not a language-modelling measure; this run's far-context measure is the "
            "retrieval grid of section 1.",
            "",
        ]
    return L + image("loss by position", name)


ANALYSIS = Analysis("positions", LossByPosition, measure, section)
