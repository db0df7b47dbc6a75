"""What one analysis of ``python -m diffjax.evaluate`` is, and what the sections of ``eval.md``
share.

An :class:`Analysis` is a module's measure of one model (a typed result: a dataclass with
``to_dict``/``from_dict``, or None where it does not apply), the result's place in a model's
entry of ``eval.json``, and its section of ``eval.md`` (which draws its plot). The registry
(:data:`diffjax.evaluate.analyses.ANALYSES`) lists them; the runner and the report only loop
over it.

A section reads the :class:`Run`: the run's folder, data and settings, and each model's typed
results (:class:`ModelResult`, grouped by label), and returns its lines, built from
:func:`table`, :func:`paired` (DIFF minus the twin over the paired seeds) and :func:`image`."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from diffjax.data import DataConfig

from diffjax.evaluate.results import model_name
from diffjax.evaluate.settings import EvalSettings
from diffjax.evaluate.stats import (
    describe_difference,
    fmt_mean_std,
    paired_by_seed,
    paired_difference,
    twin_name,
    twins_of,
)

DOC = "docs/evaluation.md"


@dataclasses.dataclass(frozen=True)
class Analysis:
    """One analysis: ``measure(inputs)`` (a :class:`diffjax.evaluate.inputs.ModelInputs`) gives
    its typed result or None; ``result`` is the result's type (``to_dict``/``from_dict``);
    ``name`` its key in a model's entry of eval.json (with ``flat``, its fields are the
    entry's own keys); ``section(run)`` its lines of eval.md."""

    name: str
    result: type
    measure: Callable[[Any], Any]
    section: Callable[["Run"], list[str]]
    flat: bool = False

    def store(self, result: Any, entry: dict) -> None:
        """``result`` into a model's eval.json entry."""
        if self.flat:
            entry.update(result.to_dict())
        else:
            entry[self.name] = result.to_dict()

    def load(self, entry: dict) -> Any:
        """The typed result from a model's eval.json entry (older files too), None where it
        was not measured."""
        if self.flat:
            return self.result.from_dict(entry)
        raw = entry.get(self.name)
        return None if raw is None else self.result.from_dict(raw)


@dataclasses.dataclass(frozen=True)
class ModelResult:
    """One model (label and seed) of a run: its eval.json entry and its analyses' typed
    results by analysis name (absent: not measured)."""

    entry: dict
    analyses: dict[str, Any]

    @classmethod
    def load(cls, entry: dict, analyses: Sequence[Analysis]) -> "ModelResult":
        loaded = {a.name: a.load(entry) for a in analyses}
        return cls(entry, {k: v for k, v in loaded.items() if v is not None})

    def get(self, name: str) -> Any:
        return self.analyses.get(name)

    @property
    def label(self) -> str:
        return self.entry["label"]

    @property
    def seed(self) -> int:
        return self.entry["seed"]

    @property
    def attention(self) -> str:
        return self.entry["attention"]

    @property
    def gate(self) -> str:
        return self.entry.get("gate", "none")


@dataclasses.dataclass(frozen=True)
class Run:
    """What every section reads: the run, its settings, each model's results (grouped by label,
    in seed order) and the closed-form noise floor."""

    run_dir: str
    data: DataConfig
    settings: EvalSettings
    models: list[ModelResult]
    groups: dict[str, list[ModelResult]]
    noise: dict

    @property
    def labels(self) -> list[str]:
        return list(self.groups)

    @property
    def zero_shot(self) -> bool:
        return self.data.source != "needle"

    def names(self) -> list[str]:
        return [model_name(lab, rs) for lab, rs in self.groups.items()]

    def measured(self, name: str) -> list[Any]:
        """The results of analysis ``name`` of the models that have one, in model order."""
        return [m.get(name) for m in self.models if m.get(name) is not None]

    def cell(self, lab: str, getter, spec: str = "{:.3f}") -> str:
        return fmt_mean_std([getter(r) for r in self.groups[lab]], spec)


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(r) + " |" for r in rows
    ]


def paired(groups, getter, what: str, unit: str = "", *, spec: str = "{:+.4f}") -> list[str]:
    """``- DIFF - twin ...`` for each twin beside DIFF (every other label; the standard twin is
    "the twin", another "the <label> twin") over the seeds both have, with a 95% t-interval;
    no line for a twin without values, none without DIFF."""
    out = []
    for twin in twins_of(groups):
        a, b = paired_by_seed(groups, getter, b=twin)
        if not a:
            continue
        d = paired_difference(a, b)
        text = describe_difference(
            d, what + (f" ({unit})" if unit else ""), b=twin_name(twin), spec=spec
        )
        out.append(f"- {text}")
    return out


def image(alt: str, name: str) -> list[str]:
    return [f"![{alt}]({name})", ""]
