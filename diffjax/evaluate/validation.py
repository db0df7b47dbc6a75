"""Validation loss, perplexity and (a task with answers) answer accuracy on the run's own data,
and for a mixture the loss on each component's own validation split: its result
(:class:`Validation`, the entry's ``val_*`` keys in eval.json) and its section of eval.md."""

from __future__ import annotations

import dataclasses

import numpy as np

from diffjax.data import query_kinds

from diffjax.evaluate import positions as pos
from diffjax.evaluate import retrieval as ret
from diffjax.evaluate.analysis import Analysis, Run, paired, table
from diffjax.evaluate.inputs import ModelInputs, validation_examples

# the optional rows of the table: eval.json key, row name
ACCURACY_ROWS = (
    ("val_accuracy", "answer accuracy (validation)"),
    ("val_first_query_accuracy", "first query (only the needles or pairs hold its answer)"),
    ("val_repeat_query_accuracy", "repeated queries (copyable from an earlier one)"),
)


@dataclasses.dataclass(frozen=True)
class Validation:
    """Loss (nats per weighted token) and perplexity; with answers, the accuracy per query, of
    the first query and of the repeated ones (None where the task has none)."""

    loss: float
    ppl: float
    accuracy: float | None = None
    first_query_accuracy: float | None = None
    repeat_query_accuracy: float | None = None
    by_component: dict[str, float] | None = None  # a mixture: each component's loss

    def to_dict(self) -> dict:
        out = {"val_loss": self.loss, "val_ppl": self.ppl}
        accuracies = (self.accuracy, self.first_query_accuracy, self.repeat_query_accuracy)
        for (key, _), value in zip(ACCURACY_ROWS, accuracies):
            if value is not None:
                out[key] = value
        if self.by_component is not None:
            out["val_loss_by_component"] = dict(self.by_component)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "Validation | None":
        if "val_loss" not in d:
            return None
        accuracies = (d.get(key) for key, _ in ACCURACY_ROWS)
        return cls(d["val_loss"], d["val_ppl"], *accuracies, d.get("val_loss_by_component"))

    def get(self, key: str) -> float | None:
        """A row's value by its eval.json key."""
        return self.to_dict().get(key)


def by_component(inputs: ModelInputs) -> dict[str, float] | None:
    """A mixture run: the loss on each component's own validation split (``val_examples`` of
    each, spread over it; a component without a validation split is left out), by name."""
    data = inputs.data
    if data.source != "mixture":
        return None
    out = {}
    for c in data.mixture.components:
        part = data.component(c.name)
        if part.val_fraction == 0:
            continue
        batch = validation_examples(part, inputs.settings.val_examples)
        losses, _ = inputs.losses_and_predictions(batch)
        out[c.name] = pos.validation_loss(losses, batch["weights"])[0]
    return out


def measure(inputs: ModelInputs) -> Validation:
    val = inputs.val
    losses, preds = inputs.val_outputs
    loss, ppl = pos.validation_loss(losses, val["weights"])
    if "answer_spans" not in val:
        return Validation(loss, ppl, by_component=by_component(inputs))
    correct = ret.query_correct(preds, val)
    first_acc = repeat_acc = None
    if "query_needle" in val or "query_pair" in val:
        first, repeat = query_kinds(val)
        first_acc = float(np.mean(correct[first]))
        if repeat.any():
            repeat_acc = float(np.mean(correct[repeat]))
    return Validation(loss, ppl, float(np.mean(correct)), first_acc, repeat_acc)


def section(run: Run) -> list[str]:
    def val(r) -> Validation:
        return r.get("validation")

    rows = [
        ["validation loss (nats/token)"]
        + [run.cell(lab, lambda r: val(r).loss, "{:.4f}") for lab in run.labels],
        ["validation perplexity"]
        + [run.cell(lab, lambda r: val(r).ppl, "{:.3f}") for lab in run.labels],
    ]
    for key, name in ACCURACY_ROWS:
        if any(v.get(key) is not None for v in run.measured("validation")):
            rows.append([name] + [run.cell(lab, lambda r: val(r).get(key)) for lab in run.labels])
    components = sorted(
        {name for v in run.measured("validation") for name in (v.by_component or {})},
        key=[c.name for c in run.data.mixture.components].index,
    )

    def component_loss(name):
        return lambda r: (val(r).by_component or {}).get(name)

    for name in components:
        rows.append(
            [f"validation loss: {name}"]
            + [run.cell(lab, component_loss(name), "{:.4f}") for lab in run.labels]
        )
    L = ["## Validation loss and perplexity", ""]
    L += table([""] + run.names(), rows) + [""]
    line = paired(run.groups, lambda r: val(r).loss, "validation loss", "nats")
    for name in components:
        line += paired(run.groups, component_loss(name), f"validation loss on {name}", "nats")
    L += line + [""] if line else []
    L += [
        f"Over {run.settings.val_examples} validation examples of the run's data spread over the "
        f"split ({'answer tokens only' if run.data.is_synthetic else 'every token'}); not the "
        f"same batches as the training report's, so the numbers differ slightly.",
        "",
    ]
    if components:
        L += [
            f"The mixture's components: {run.settings.val_examples} validation examples of each "
            f"component's own split (the first row draws from all of them together, in "
            f"proportion to their validation splits, not to the training weights).",
            "",
        ]
    return L


ANALYSIS = Analysis("validation", Validation, measure, section, flat=True)
