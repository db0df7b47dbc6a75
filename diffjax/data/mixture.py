"""Mixtures: weighted blends of corpora, built on Grain's own mixing (``MapDataset.mix``).

Each component's train examples are shuffled with a seed of their own (:func:`component_seed`
of ``data.seed`` and the component's name) and repeated (``data.mixture.exhausted="repeat"``:
a new order each pass) or read once (``"stop"``); ``grain.MapDataset.mix`` then interleaves
them by their weights. Grain's mix is a deterministic function of the position: example ``k``
of the mixture is a fixed example of a fixed component (the weights rounded to integer
proportions, the smallest scaled to 100), so every global batch of ``G`` examples holds each
component's share to within one example, on any number of processes (each reads its rows of
the global batch) and the iterator's state is the batches read, as for one corpus.

A change of weights at a resume (``data.mixture.reweight``) starts a new *stage* at the
resumed batch: each component continues from the examples it had given
(:meth:`MixturePlan.examples_read`), mixed at the new weights. The stages are recorded with
each checkpoint (``mixture_stages`` in its metadata) and rebuilt from there, so a later resume
reads the same batches again.

:class:`MixturePlan` answers, without reading any data, what the mixture holds: how many
examples of each component the first ``b`` batches read, when a component runs out (the log
says it), where a ``"stop"`` mixture ends.
"""

from __future__ import annotations

import bisect
import dataclasses
import sys
from typing import Any, Sequence

from diffjax.config import ConfigError

from diffjax.data.config import DataConfig, DataError, component_seed

GRAIN_SCALE = 100  # Grain scales the smallest weight to this many parts (then rounds down)


def int_proportions(weights: Sequence[float]) -> list[int]:
    """The integer proportions Grain's mix turns positive ``weights`` into: the smallest scaled
    to :data:`GRAIN_SCALE`, every one rounded down (so a weight is realised to within about
    1/100 of the smallest; ``tests/test_mixture.py`` checks this against Grain)."""
    scale = GRAIN_SCALE / min(weights)
    return [int(w * scale) for w in weights]


def counts_before(k: int, proportions: Sequence[int]) -> list[int]:
    """How many of the first ``k`` examples of Grain's mix with integer ``proportions`` come
    from each dataset: the closed form of Grain's assignment of position to dataset (dataset
    ``i`` takes its share of the positions the datasets before it left)."""
    remaining, left, out = sum(proportions), int(k), []
    for p in proportions:
        rest = (left * (remaining - p)) // remaining
        out.append(left - rest)
        remaining, left = remaining - p, rest
    return out


@dataclasses.dataclass(frozen=True)
class Stage:
    """A span of the mixture at one set of weights: from global batch ``batch`` (the train
    step ``step`` resumed there) on, ``weights`` by component name, in mixing order."""

    batch: int
    step: int
    weights: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "batch": self.batch, "weights": dict(self.weights)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Stage":
        return cls(int(d["batch"]), int(d["step"]), {k: float(v) for k, v in d["weights"].items()})

    @property
    def mixed(self) -> list[str]:
        """The components this stage trains on (weight > 0), in mixing order."""
        return [n for n, w in self.weights.items() if w > 0]


def first_stage(config: DataConfig) -> list[Stage]:
    """The stages of a run that starts at step 0: the config's weights."""
    return [Stage(0, 0, config.weights)]


def _weights_words(old: dict[str, float], new: dict[str, float]) -> str:
    parts = []
    for name in [*old, *(n for n in new if n not in old)]:
        a = f"{old[name]:g}" if name in old else "(new)"
        b = f"{new[name]:g}" if name in new else "(removed)"
        if a != b:
            parts.append(f"{name} {a} -> {b}")
    return ", ".join(parts)


def resume_stages(
    config: DataConfig, saved: Sequence[dict] | None, saved_data: dict, batch: int, step: int
) -> tuple[list[Stage], str | None]:
    """The stages a run resumed at global batch ``batch`` (train step ``step``) reads, from
    those its checkpoint recorded (``saved``; None for a checkpoint that recorded none: the
    weights of its data config ``saved_data``), and the line to log when the weights change
    there. Changed weights need ``data.mixture.reweight``; a component of the checkpoint's
    mixture must stay in it (weight 0 stops training on it). Else a ConfigError naming the
    fix, before any compute."""
    if saved:
        stages = [Stage.from_dict(s) for s in saved]
    else:
        weights = DataConfig.from_saved(saved_data).weights
        stages = [Stage(0, 0, weights)]
    old, new = stages[-1].weights, config.weights
    if old == new:
        return stages, None
    words = _weights_words(old, new)
    removed = [n for n in old if n not in new]
    if removed:
        raise ConfigError(
            f"data.mixture: the checkpoint at step {step} mixes the component {removed[0]!r}, "
            f"which this config leaves out ({words}). Fix: keep it with weight 0 "
            f"(data.mixture.{removed[0]}.weight=0: no longer trained on, still evaluated), "
            f"or set run.dir to a new directory."
        )
    if not config.mixture.reweight:
        raise ConfigError(
            f"data.mixture: the weights differ from those of the checkpoint at step {step} "
            f"({words}), so the batches from here on would not be the run's. Fix: set "
            f"data.mixture.reweight=true to change them from step {step} on (recorded in the "
            f"checkpoints and the report), or resume with the checkpoint's weights."
        )
    stages = [s for s in stages if s.batch < batch] + [Stage(batch, step, dict(new))]
    return stages, (
        f"data.mixture: the weights change at step {step} ({words}; data.mixture.reweight); "
        f"each component continues from the examples it has given"
    )


@dataclasses.dataclass(frozen=True)
class MixturePlan:
    """What a mixture reads, from its components' sizes alone: ``lengths`` (train examples of
    each component, by name), ``global_batch`` examples per step, the ``stages`` and
    ``passes`` over each component (None: repeated forever)."""

    lengths: dict[str, int]
    global_batch: int
    stages: tuple[Stage, ...]
    passes: int | None = None

    def __post_init__(self) -> None:
        offsets = [dict.fromkeys(self.lengths, 0)]
        for stage, after in zip(self.stages, self.stages[1:]):
            offsets.append(self._counts_in(stage, offsets[-1], (after.batch - stage.batch)))
        object.__setattr__(self, "_offsets", tuple(offsets))

    def _counts_in(self, stage: Stage, offsets: dict[str, int], batches: int) -> dict[str, int]:
        mixed = stage.mixed
        ks = counts_before(batches * self.global_batch, self.proportions(stage))
        out = dict(offsets)
        for name, k in zip(mixed, ks):
            out[name] += k
        return out

    def proportions(self, stage: Stage) -> list[int]:
        return int_proportions([stage.weights[n] for n in stage.mixed])

    def _stage(self, batch: int) -> int:
        return bisect.bisect_right([s.batch for s in self.stages], batch) - 1

    def examples_read(self, batches: int) -> dict[str, int]:
        """Examples of each component in the first ``batches`` global batches (passes over a
        component counted on: 2.5 passes of 100 examples are 250)."""
        i = self._stage(batches)
        stage = self.stages[i]
        return self._counts_in(stage, self._offsets[i], batches - stage.batch)

    def offsets(self, i: int) -> dict[str, int]:
        """Examples each component had given when stage ``i`` began."""
        return dict(self._offsets[i])

    def weights_at(self, batch: int) -> dict[str, float]:
        return dict(self.stages[self._stage(batch)].weights)

    # ---------------------------------------------------------------- running out
    def notes(self, batch: int) -> list[str]:
        """What to log as global batch ``batch`` (0-based) is read: each component that has
        given every example and starts over (a repeated mixture)."""
        if self.passes is not None:
            return []
        before, after = self.examples_read(batch), self.examples_read(batch + 1)
        out = []
        for name, n in self.lengths.items():
            was, now = (before[name] - 1) // n, (after[name] - 1) // n
            if now > was and now >= 1:
                out.append(
                    f"data.mixture: component {name!r} has given all its {n:,} train examples; "
                    f"step {batch + 1} reads it again in a new order (pass {now + 1})"
                )
        return out

    def available_batches(self) -> int | None:
        """Global batches the mixture holds (None: endless): where a ``"stop"`` mixture ends,
        the first component that runs out ending it (Grain's mix stops there)."""
        if self.passes is None:
            return None
        import grain

        last, offsets = self.stages[-1], self._offsets[-1]
        left = [self.lengths[n] * self.passes - offsets[n] for n in last.mixed]
        if min(left) <= 0:
            return last.batch
        mixed = grain.MapDataset.mix(
            [grain.MapDataset.range(n) for n in left], [last.weights[n] for n in last.mixed]
        )
        return last.batch + len(mixed) // self.global_batch

    def ran_out(self) -> list[str]:
        """The components that end a ``"stop"`` mixture: those with the fewest examples left
        for their share (Grain's mix ends where the first would run out)."""
        if self.passes is None:
            return []
        last, offsets = self.stages[-1], self._offsets[-1]
        left = {n: self.lengths[n] * self.passes - offsets[n] for n in last.mixed}
        if min(left.values()) <= 0:
            return [n for n, k in left.items() if k <= 0]
        bound = {n: left[n] / p for n, p in zip(last.mixed, self.proportions(last))}
        return [n for n, b in bound.items() if b == min(bound.values())]

    def stop_note(self, steps: int) -> str | None:
        """The line to log before training when a ``"stop"`` mixture ends before ``steps``."""
        end = self.available_batches()
        if end is None or end >= steps:
            return None
        names = ", ".join(repr(n) for n in self.ran_out())
        return (
            f"data.mixture: component {names} runs out after {end:,} steps "
            f"(data.mixture.exhausted=stop): training stops there, before train.steps={steps:,}"
        )

    def end_note(self, step: int) -> str:
        """The line to log when a ``"stop"`` mixture has ended after ``step``."""
        names = ", ".join(repr(n) for n in self.ran_out())
        return (
            f"data.mixture: component {names} has given all its train examples: training "
            f"stops after step {step:,} (data.mixture.exhausted=stop)"
        )

    # ---------------------------------------------------------------- summaries
    def summary(self, batches: int) -> dict[str, Any]:
        """What the first ``batches`` global batches read, for ``result.json`` and the report:
        per component its train examples, the weight in force at the end, the examples read,
        their share of all read and the passes over it; and the stages."""
        read = self.examples_read(batches)
        total = max(sum(read.values()), 1)
        last = self.weights_at(max(batches - 1, 0))
        return {
            "batches": batches,
            "stages": [s.to_dict() for s in self.stages],
            "components": {
                name: {
                    "train_examples": n,
                    "weight": last.get(name, 0.0),
                    "examples": read[name],
                    "share": read[name] / total,
                    "passes": read[name] / n,
                }
                for name, n in self.lengths.items()
            },
        }

    # ---------------------------------------------------------------- the dataset
    def dataset(self, sources: dict[str, Any], seed: int, shuffle: bool):
        """The mixture as a ``grain.MapDataset`` of examples: ``sources`` (a random-access
        ``grain.MapDataset`` per component, by name) each shuffled with its own seed and
        repeated (or read ``passes`` times), then mixed with ``grain.MapDataset.mix`` per
        stage, each component continuing where the stage before left it."""
        import grain

        comps = {}
        for name, src in sources.items():
            ds = src.shuffle(seed=component_seed(seed, name)) if shuffle else src
            comps[name] = ds.repeat(self.passes)
        mixes = []
        for i, stage in enumerate(self.stages):
            offsets = self._offsets[i]
            parents = [comps[n][offsets[n] :] if offsets[n] else comps[n] for n in stage.mixed]
            if any(len(p) == 0 for p in parents):
                raise DataError(
                    f"DataConfig.mixture: the mixture ran out before step {stage.step}, where "
                    f"the weights change. Fix: resume with data.mixture.exhausted=repeat"
                )
            mixes.append(grain.MapDataset.mix(parents, [stage.weights[n] for n in stage.mixed]))
        if len(mixes) == 1:
            return mixes[0]
        return _stages_dataset(mixes, [s.batch * self.global_batch for s in self.stages])


def _stages_dataset(mixes, starts: list[int]):
    """One ``grain.MapDataset``: example ``k`` is example ``k - starts[s]`` of ``mixes[s]``, the
    stage whose span holds ``k`` (each read in one batched read per stage)."""
    import grain

    class Stages(grain.MapDataset):
        def __len__(self) -> int:
            return min(sys.maxsize, starts[-1] + len(self._parents[-1]))

        def _locate(self, k: int) -> tuple[int, int]:
            s = bisect.bisect_right(starts, k) - 1
            return s, k - starts[s]

        def __getitem__(self, k):
            if isinstance(k, slice):
                return self.slice(k)
            s, j = self._locate(int(k))
            return self._parents[s][j]

        def _getitems(self, indices):
            out: list[Any] = [None] * len(indices)
            by_stage: dict[int, list[tuple[int, int]]] = {}
            for pos, k in enumerate(indices):
                s, j = self._locate(int(k))
                by_stage.setdefault(s, []).append((pos, j))
            for s, items in by_stage.items():
                rows = self._parents[s]._getitems([j for _, j in items])
                for (pos, _), row in zip(items, rows):
                    out[pos] = row
            return out

        def __str__(self) -> str:
            return f"MixtureStages(starts={starts})"

    return Stages(mixes)


def batches_read(state: dict[str, Any] | None) -> int:
    """The global batches a train iterator's state (``get_state()``) has read."""
    return 0 if not state else int(state.get("next_index", 0))


def stage_words(stages: Sequence[dict[str, Any]]) -> list[str]:
    """Each stage in words: ``"from step 0: web 0.7, code 0.3"``."""
    return [
        f"from step {s['step']}: " + ", ".join(f"{n} {w:g}" for n, w in s["weights"].items())
        for s in stages
    ]


def shares(weights: dict[str, float]) -> dict[str, float]:
    """The weights normalised to sum to 1 (as Grain realises them: :func:`int_proportions`)."""
    mixed = [n for n, w in weights.items() if w > 0]
    props = int_proportions([weights[n] for n in mixed])
    total = sum(props)
    return {n: (props[mixed.index(n)] / total if n in mixed else 0.0) for n in weights}


__all__ = [
    "MixturePlan",
    "Stage",
    "batches_read",
    "counts_before",
    "first_stage",
    "int_proportions",
    "resume_stages",
    "shares",
    "stage_words",
]
