"""The comparison's settings: what ``python train.py`` trains beside the configured model.

A :class:`Comparison` is one model's :class:`diffjax.train.ExperimentConfig` with a ``compare``
section (:class:`CompareConfig`): the twins trained beside the DIFF model on the same data, in
the same order, from the same init seeds (``compare.twins``), how many paired seeds
(``compare.seeds``), the side-by-side timing and the quick evaluation after. Its
:attr:`Comparison.models` are the labelled model configs a run trains; the library trains each
of them as one model (:func:`diffjax.train.train_model`).

A config file returns a :class:`Comparison`; one that returns a plain ``ExperimentConfig``
trains its model alone (:func:`as_comparison`). The keys these settings had before they moved
here (``compare=false``, ``train.num_seeds``, ...) are refused with the new spelling.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping

from diffjax.config import ModelConfig, check_declared, check_fields, declared, fail, twin
from diffjax.train.config import ExperimentConfig, default_config, load_config

# what a twin can be: the model's standard-attention twin (diffjax.config.twin), and that twin
# with gated attention's output gate (model.gate; Qiu et al. 2025)
TWINS = ("standard", "gated")


@dataclasses.dataclass(frozen=True)
class CompareConfig:
    """What a comparison trains beside the configured DIFF model, and what it measures after."""

    # the twins trained beside the DIFF model on the same data, order and init seeds (empty,
    # compare.twins=, trains it alone). "standard": its standard-attention twin; "gated": that
    # twin with gated attention's output gate (compare.twin_gate), more parameters than it.
    twins: tuple[str, ...] = declared(("standard",), choices=TWINS, what="twin")
    # the gated twin's gate (model.gate): "elementwise", the paper's best variant, or "headwise"
    twin_gate: str = declared("elementwise", choices=("headwise", "elementwise"), what="gate")
    # train each model from init seeds train.seed .. train.seed + seeds - 1. Paired: seed s of
    # DIFF and of its twin start from the same seed; every run sees the same batches (data.seed)
    seeds: int = declared(1, ge=1, fix="set compare.seeds to a positive integer")
    # rounds of the side-by-side timing after training (0: skip). Each round alternates the
    # models' compiled steps to measure their throughput side by side.
    throughput_rounds: int = declared(
        5, ge=0, fix="set compare.throughput_rounds=0 to skip the side-by-side timing, or more"
    )
    # after training and the report, the quick subset of `python -m diffjax.evaluate` on the
    # run's best checkpoints. Written to eval.md and appended to report.md (the default
    # comparison turns it on).
    quick_eval: bool = False
    # The twin's init std, when it is not model.init_std (None: the same init for both). A
    # per-model choice like a per-model learning rate: the report states it.
    twin_init_std: float | None = declared(
        None, gt=0, fix="use e.g. 0.02, or None for model.init_std"
    )

    def __post_init__(self):
        check_fields(self)
        check_declared(self)


_TWINS_FIX = "compare.twins=standard trains the standard twin, compare.twins= the model alone"


@dataclasses.dataclass(frozen=True)
class Comparison(ExperimentConfig):
    """A DIFF model and its twins (:class:`CompareConfig`) trained side by side: the library's
    one-model :class:`ExperimentConfig` plus the ``compare`` section."""

    compare: CompareConfig = CompareConfig()
    MOVED: ClassVar[dict[str, str]] = {
        **ExperimentConfig.MOVED,
        "compare": f"write compare.twins ({_TWINS_FIX})",
        "twin_init_std": "write compare.twin_init_std",
        "train.num_seeds": "write compare.seeds",
        "train.throughput_rounds": "write compare.throughput_rounds",
        "train.quick_eval": "write compare.quick_eval",
    }

    def __post_init__(self):
        super().__post_init__()
        c = self.compare
        if c.twin_init_std is not None and not c.twins:
            fail(
                "Comparison",
                "compare.twin_init_std",
                f"is {c.twin_init_std:g} but compare.twins is empty: no twin is trained",
                "leave compare.twin_init_std unset (None), or set compare.twins=standard",
            )
        if len(set(c.twins)) != len(c.twins):
            fail(
                "Comparison",
                "compare.twins",
                f"names a twin twice: {','.join(c.twins)}",
                "name each twin once, e.g. compare.twins=standard,gated",
            )
        if "gated" in c.twins and self.model.gate == c.twin_gate:
            fail(
                "Comparison",
                "compare.twins",
                f"lists the gated twin, but model.gate={self.model.gate!r} already gives the "
                f"standard twin that gate",
                "drop gated from compare.twins, or set compare.twin_gate to the other gate",
            )
        if c.twins and not self.model.is_diff:
            fail(
                "Comparison",
                "compare.twins",
                f"trains twins beside a DIFF model, but model.attention is "
                f"{self.model.attention!r}",
                "set model.attention=diff_v1 or diff_v2, or compare.twins= (the model alone)",
            )
        if self.train.init_from is not None and c.twins:
            fail(
                "Comparison",
                "compare.twins",
                f"train.init_from={self.train.init_from!r} starts one model from a checkpoint, "
                f"and its twin would start from random weights",
                "set compare.twins= (the model alone)",
            )
        if self.train.init_from is not None and c.seeds > 1:
            fail(
                "Comparison",
                "compare.seeds",
                f"train.init_from={self.train.init_from!r} starts every seed from the same "
                f"checkpoint weights, so {c.seeds} seeds would train one model {c.seeds} times",
                "set compare.seeds=1",
            )

    @property
    def models(self) -> dict[str, ModelConfig]:
        """``{label: model config}`` of every model the comparison trains: ``diff`` (the
        configured model) then each twin by its name (:data:`TWINS`), or the model alone by its
        label."""
        c = self.compare
        if not c.twins:
            return {self.label: self.model}
        twins = twin_models(self.model, c)
        return {"diff": self.model, **{name: twins[name] for name in c.twins}}

    @property
    def seeds(self) -> list[int]:
        """The init seeds: ``train.seed .. train.seed + compare.seeds - 1``."""
        return list(range(self.train.seed, self.train.seed + self.compare.seeds))

    def experiment(self, model: ModelConfig | None = None) -> ExperimentConfig:
        """One model's training (``model``, default the configured one) with these settings: what
        the library trains and plans."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(ExperimentConfig)}
        return ExperimentConfig(**{**fields, "model": model or self.model})


def twin_models(model: ModelConfig, compare: CompareConfig) -> dict[str, ModelConfig]:
    """Every twin a comparison can train beside ``model`` (:data:`TWINS`), whether or not
    ``compare.twins`` lists it: ``{name: model config}``."""
    standard = twin(model).replace(init_std=compare.twin_init_std or model.init_std)
    return {"standard": standard, "gated": standard.replace(gate=compare.twin_gate)}


def saved_models(saved: Mapping[str, Any]) -> tuple[ModelConfig, CompareConfig]:
    """The configured model and the comparison settings of a run's saved ``config.json``
    (one written before the ``compare`` section: its standard twin); keys a newer version
    wrote and this one does not know are left out."""

    def known(cls, d):
        return {f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d}

    compare = known(CompareConfig, saved.get("compare") or {})
    if "twins" in compare:
        compare["twins"] = tuple(compare["twins"])
    return ModelConfig(**known(ModelConfig, saved["model"])), CompareConfig(**compare)


def as_comparison(config: ExperimentConfig, compare: CompareConfig | None = None) -> Comparison:
    """``config`` as a :class:`Comparison`: itself if it is one, else its model alone (or with
    ``compare``'s settings)."""
    if isinstance(config, Comparison):
        return config
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(ExperimentConfig)}
    return Comparison(**fields, compare=compare or CompareConfig(twins=()))


def default_comparison() -> Comparison:
    """The default comparison (``python train.py``): the default experiment's small DIFF V1
    model (:func:`diffjax.train.default_config`) and its standard twin, from two paired init
    seeds (so the report can give an interval on the difference), quick evaluation included;
    about seven minutes on 2 CPU cores (an estimate)."""
    return as_comparison(default_config(), CompareConfig(seeds=2, quick_eval=True))


def load_comparison(path: str | None) -> Comparison:
    """The comparison of the config file ``path`` (:func:`diffjax.train.load_config`; a file
    that returns a plain ``ExperimentConfig`` trains its model alone), or
    :func:`default_comparison` when ``path`` is None."""
    return default_comparison() if path is None else as_comparison(load_config(path))
