"""Activation outliers (the paper's Table 5): the largest and the median magnitudes of the
attention logits and of the hidden states over a fixed token budget.

As the paper's authors describe it (microsoft/unilm issue 1666): attention logits are the
pre-softmax ``q k^T / sqrt(d)`` of every head, both maps ``q1 k1^T`` and ``q2 k2^T`` for DIFF,
taken in absolute value (here only the entries a query may attend to: the causal mask's
entries are left out); hidden states are the output of each layer (a block: attention and FFN
with their residuals). All layers are pooled.

The analysis (:class:`Outliers` over the run's validation text) has its section of eval.md and
its plot here too."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from diffjax.infra import storage

from diffjax.evaluate import paper, plots
from diffjax.evaluate import positions as pos
from diffjax.evaluate.analysis import DOC, Analysis, Run, image, paired, table
from diffjax.evaluate.inputs import ModelInputs
from diffjax.evaluate.probe import attention_logits, capture_layers, check_tokens, for_analysis

KS = (1, 2, 3, 10, 100)


def top_magnitudes(values, ks: Sequence[int] = KS, mask=None) -> dict[str, float]:
    """``{"top-k": k-th largest |value|, ..., "median": median |value|}`` over every entry (where
    ``mask`` is True). ``top-k`` is NaN when there are fewer than k values."""
    mag = np.abs(np.asarray(values, np.float32))
    if mask is not None:
        mag = mag[np.broadcast_to(np.asarray(mask, bool), mag.shape)]
    mag = mag.ravel()
    out: dict[str, float] = {}
    kmax = min(max(ks), mag.size)
    top = -np.sort(-np.partition(mag, mag.size - kmax)[mag.size - kmax :]) if kmax else mag[:0]
    for k in ks:
        out[f"top-{k}"] = float(top[k - 1]) if k <= top.size else float("nan")
    out["median"] = float(np.median(mag)) if mag.size else float("nan")
    return out


@nnx.jit
def _activations(model, tokens, masks):
    _, attn_in, outs = capture_layers(model, tokens, **masks)
    logits = []
    mask = None
    for block, h in zip(model.layers, attn_in):
        got = attention_logits(block.attn, h, masks.get("positions"), masks.get("segment_ids"))
        mask = got["mask"]
        logits += [got[k] for k in ("logits", "logits1", "logits2") if k in got]
    stacked = jnp.stack(logits)  # [L * maps, B, H, T, S]
    if mask is not None:  # -1 marks the entries a query may not attend to
        stacked = jnp.where(mask[None, :, None], jnp.abs(stacked), -1.0)
    else:
        stacked = jnp.abs(stacked)
    return stacked, jnp.stack(outs)


def activation_outliers(
    model, tokens, *, batch_size: int = 4, ks: Sequence[int] = KS, masks: dict | None = None
) -> dict[str, dict[str, float]]:
    """Top-k and median magnitudes of ``model``'s attention logits and hidden states over the
    ``tokens`` ``[B, T]`` given (the token budget is ``B * T``); ``masks``: their
    ``positions`` and ``segment_ids`` ``[B, T]`` (documents kept apart), if any."""
    model = for_analysis(model)
    tokens = np.asarray(check_tokens(model, tokens))
    masks = {k: np.asarray(v, np.int32) for k, v in (masks or {}).items() if v is not None}
    logit_mags, hidden = [], []
    for i in range(0, len(tokens), batch_size):
        part = {k: jnp.asarray(v[i : i + batch_size]) for k, v in masks.items()}
        lg, hs = _activations(model, jnp.asarray(tokens[i : i + batch_size], jnp.int32), part)
        lg = np.asarray(lg)
        logit_mags.append(lg[lg >= 0])
        hidden.append(np.abs(np.asarray(hs)).ravel())
    return {
        "attention logits": top_magnitudes(np.concatenate(logit_mags), ks),
        "hidden states": top_magnitudes(np.concatenate(hidden), ks),
    }


# ---------------------------------------------------------------------------- the analysis
KINDS = ("attention logits", "hidden states")


@dataclasses.dataclass(frozen=True)
class Outliers:
    """:func:`activation_outliers` of one model: per kind (:data:`KINDS`) its statistics
    (``"top-k"``, ``"median"``), over ``tokens`` tokens."""

    stats: dict[str, dict[str, float]]
    tokens: int

    def to_dict(self) -> dict:
        return {**self.stats, "tokens": self.tokens}

    @classmethod
    def from_dict(cls, d: dict) -> "Outliers":
        return cls({k: v for k, v in d.items() if k != "tokens"}, d["tokens"])

    def get(self, kind: str, stat: str) -> float | None:
        return self.stats.get(kind, {}).get(stat)


def activation_text(inputs: ModelInputs) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """``(tokens [N, T], their positions and segment ids where documents are kept apart)``:
    ``outlier_examples`` sequences of the run's validation text at the trained context (a
    needle run: its haystack text; MQAR: its own validation examples), what the activation
    statistics read."""
    data, n = inputs.data, inputs.settings.outlier_examples
    corpus = pos.corpus_for_positions(data, data.seq_len)
    ex = (
        pos.validation_examples(corpus, n)
        if corpus is not None
        else {"inputs": inputs.val["inputs"][:n]}
    )
    return ex["inputs"], {k: ex[k] for k in ("positions", "segment_ids") if k in ex}


def measure(inputs: ModelInputs) -> Outliers:
    """Over the run's validation text (:func:`activation_text`)."""
    tokens, masks = activation_text(inputs)
    stats = activation_outliers(
        inputs.model, tokens, batch_size=min(inputs.settings.batch_size, 4), masks=masks
    )
    return Outliers(stats, int(tokens.size))


def _stat(r, kind: str, stat: str) -> float | None:
    got = r.get("outliers")
    return None if got is None else got.get(kind, stat)


def figure(run: Run) -> str:
    """Top-k magnitudes against k, mean over seeds."""
    ks = np.array(KS, float)
    series = {
        f"{lab}: {kind}": (
            ks,
            np.array([np.mean([_stat(r, kind, f"top-{k}") for r in rs]) for k in KS]),
        )
        for kind in KINDS
        for lab, rs in run.groups.items()
    }
    name = "eval_outliers.png"
    plots.lines(
        series,
        xlabel="k (top-k magnitude)",
        ylabel="magnitude",
        logx=True,
        logy=True,
        title="activation outliers (mean over seeds)",
        path=storage.join(run.run_dir, name),
        xticks=(list(ks), [str(k) for k in KS]),
    )
    return name


def section(run: Run) -> list[str]:
    L = ["## 3. Activation outliers (paper Table 5)", ""]
    columns = ["activation", "statistic"] + run.names()
    columns += ["paper Transformer (3B)", "paper DIFF (3B)"]
    rows = []
    for kind in KINDS:
        for stat in [f"top-{k}" for k in KS] + ["median"]:
            p = paper.OUTLIERS[kind].get(stat)
            rows.append(
                [kind, stat]
                + [run.cell(lab, lambda r: _stat(r, kind, stat)) for lab in run.labels]
                + ([f"{p[0]}", f"{p[1]}"] if p else ["", ""])
            )
    L += table(columns, rows)
    tokens = run.models[0].get("outliers").tokens
    L += [
        "",
        f"Magnitudes over {tokens:,} tokens of validation text: the logits of every head, map "
        f"and layer (causally visible entries), the hidden states at each block's output. What "
        f"it measures: {DOC}, section 3.",
        "",
    ]
    line = paired(
        run.groups, lambda r: _stat(r, "attention logits", "top-1"), "top-1 attention logit"
    )
    L += line + [""] if line else []
    return L + image("activation outliers", figure(run))


ANALYSIS = Analysis("outliers", Outliers, measure, section)
