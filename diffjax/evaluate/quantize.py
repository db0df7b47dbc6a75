"""Simulated absmax quantization of the attention logits (the paper's Fig. 8).

Each map's pre-softmax logits ``q k^T / sqrt(d)`` are quantized per example and head: the
scale is the largest magnitude over the ``T x S`` block (masked entries left out),
``scale = absmax / (2^(bits-1) - 1)``, and each logit becomes ``round(x / scale) * scale``
(symmetric, round to nearest); then masking, softmax and the value product run in float32 as
usual. A large outlier sets a coarse step for every other logit of its head, which is how
outliers hurt low-bit attention.

The quantized forward is the reference math with ``logit_bits`` set
(:func:`diffjax.kernels.reference.absmax_quantize` on the logits), packaged as the attention
implementation :class:`QuantizedLogits`; :func:`with_quantized_logits` builds a model whose
attention layers use it, holding the original's parameters. ``attention_impl`` is a static
attribute of the layers, so a jitted function traced for the quantized model is a different
cache entry from the original model's: nothing leaks into later calls.

The analysis (:class:`Quantization`: the sweep on the validation examples and a needle task)
has its section of eval.md and its plot here too.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from flax import nnx

from diffjax.infra import storage
from diffjax.nn.model import TransformerLM, rebuilt
from diffjax.kernels import reference
from diffjax.kernels.reference import absmax_quantize, check_logit_bits

from diffjax.evaluate import paper, plots
from diffjax.evaluate.analysis import DOC, Analysis, Run, image, model_name, table
from diffjax.evaluate.inputs import ModelInputs
from diffjax.evaluate.paper import QUANTIZATION_BITS as PAPER_BITS
from diffjax.evaluate.results import seed_mean
from diffjax.evaluate.positions import validation_loss
from diffjax.evaluate.probe import losses_and_predictions
from diffjax.evaluate.retrieval import query_correct

__all__ = [
    "PAPER_BITS",
    "Quantization",
    "QuantizedLogits",
    "absmax_quantize",
    "quantization_sweep",
    "with_quantized_logits",
]


@dataclasses.dataclass(frozen=True)
class QuantizedLogits:
    """An attention implementation (a value for a layer's ``attention_impl``, or ``impl=`` of
    :mod:`diffjax.ops`): the reference math with every map's logits absmax-quantized to
    ``bits`` bits before the softmax. Frozen, so it hashes by value as a static attribute."""

    bits: int

    def __post_init__(self):
        check_logit_bits(self.bits)

    def attention(self, q, k, v, *, second=None, causal, segment_ids, kv_segment_ids, scale):
        return reference.attention(
            q,
            k,
            v,
            second=second,
            causal=causal,
            segment_ids=segment_ids,
            kv_segment_ids=kv_segment_ids,
            scale=scale,
            logit_bits=self.bits,
        )


def with_quantized_logits(model: TransformerLM, bits: int | None) -> TransformerLM:
    """``model`` built again (sharing its parameter arrays) with attention layers that quantize
    their logits to ``bits`` (:class:`QuantizedLogits`; None: the plain XLA path). ``model``
    itself is not modified."""
    check_logit_bits(bits)
    if not isinstance(model, TransformerLM):
        raise ValueError(
            f"with_quantized_logits: takes a diffjax TransformerLM, got {type(model).__name__}. "
            f"Fix: pass the language model (its attention layers are built with the quantized "
            f"implementation)"
        )
    return rebuilt(model, attention_impl="xla" if bits is None else QuantizedLogits(int(bits)))


def quantization_sweep(
    model: nnx.Module,
    val_batch: dict,
    needle_batch: dict | None = None,
    *,
    bits=PAPER_BITS,
    batch_size: int = 8,
) -> list[dict]:
    """Validation loss (weighted by ``val_batch["weights"]``) and, with ``needle_batch``, query
    retrieval accuracy of ``model`` with full-precision logits (``bits=None``, first row) and
    with logits quantized to each width in ``bits``."""
    rows = []
    for b in (None, *bits):
        q = model if b is None else with_quantized_logits(model, b)
        loss, _ = losses_and_predictions(q, val_batch, batch_size)
        row = {"bits": b, "val_loss": validation_loss(loss, val_batch["weights"])[0]}
        if needle_batch is not None:
            _, preds = losses_and_predictions(q, needle_batch, batch_size)
            row["accuracy"] = float(np.mean(query_correct(preds, needle_batch)))
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------- the analysis
@dataclasses.dataclass(frozen=True)
class Quantization:
    """The rows of :func:`quantization_sweep`: ``bits`` (None: float32), ``val_loss`` and, with
    a needle task, ``accuracy``."""

    rows: list[dict]

    def to_dict(self) -> list[dict]:
        return [dict(r) for r in self.rows]

    @classmethod
    def from_dict(cls, d: list[dict]) -> "Quantization":
        return cls([dict(r) for r in d])

    @property
    def widths(self) -> list:
        return [r["bits"] for r in self.rows]

    def get(self, i: int, key: str) -> float | None:
        return self.rows[i].get(key) if i < len(self.rows) else None


def measure(inputs: ModelInputs) -> Quantization:
    """On the validation examples, and for accuracy on them (a task with answers) or on the
    run's needle setting at the trained context (where it fits)."""
    val, s = inputs.val, inputs.settings
    task = val if "answer_spans" in val else None
    n0, r0 = inputs.needle_setting
    if task is None and inputs.fits(inputs.data.seq_len, n0, r0):
        task = inputs.needle_examples(inputs.data.seq_len, s.retrieval_examples, seed=0)
    rows = quantization_sweep(inputs.model, val, task, bits=s.bits, batch_size=s.batch_size)
    return Quantization(rows)


def _value(r, i: int, key: str) -> float | None:
    got = r.get("quantization")
    return None if got is None else got.get(i, key)


def figure(run: Run, widths: list) -> str:
    """Validation loss against the logit bit width (32 = float32), mean over seeds."""
    xs = np.asarray([b or 32 for b in widths])
    series = {
        model_name(lab, rs): (
            xs,
            np.asarray(
                [seed_mean([_value(r, i, "val_loss") for r in rs]) for i in range(len(widths))]
            ),
        )
        for lab, rs in run.groups.items()
    }
    name = "eval_quantization.png"
    plots.lines(
        series,
        xlabel="logit bits",
        ylabel="validation loss",
        title="quantized attention logits",
        path=storage.join(run.run_dir, name),
        logx=True,
        xticks=(list(xs), ["float32" if b is None else str(b) for b in widths]),
    )
    return name


def section(run: Run) -> list[str]:
    L = ["## 4. Quantization of the attention logits (paper Fig. 8)", ""]
    measured = run.measured("quantization")
    has_acc = any("accuracy" in row for q in measured for row in q.rows)
    columns = ["logit bits"]
    for lab in run.labels:
        columns += [f"{lab}: val loss"] + ([f"{lab}: accuracy"] if has_acc else [])
    widths = run.models[0].get("quantization").widths
    rows = []
    for i, b in enumerate(widths):
        row = ["float32" if b is None else str(b)]
        for lab in run.labels:
            row.append(run.cell(lab, lambda r: _value(r, i, "val_loss"), "{:.4f}"))
            if has_acc:
                row.append(run.cell(lab, lambda r: _value(r, i, "accuracy")))
        rows.append(row)
    L += table(columns, rows)
    task = (
        "zero-shot needle retrieval (the models were not trained on it)"
        if run.zero_shot
        else "retrieval on the run's task"
    )
    L += [
        "",
        f"Logits absmax-quantized (simulated) per example and head before the softmax. Paper "
        f"(Fig. 8, 3B): {paper.QUANTIZATION_FINDING}. Accuracy: {task}. What it measures: "
        f"{DOC}, section 4.",
        "",
    ]
    return L + image("quantization", figure(run, widths))


ANALYSIS = Analysis("quantization", Quantization, measure, section)
