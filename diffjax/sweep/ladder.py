"""The ladder of a sweep: which rungs to train (model shapes, or the values of any one setting)
and for how many tokens.

A sweep config file is an ordinary config file (``get_config()`` gives the base experiment:
data, recipe, seeds) with a module-level ``SWEEP``, a :class:`Ladder` or a dict of its fields::

    SWEEP = Ladder(sizes=[(64, 2), (128, 2), (128, 4)], budget="fixed", tokens=400_000)
    SWEEP = Ladder(field="train.lr", values=[1e-4, 1e-3, 1e-2], tokens=400_000)

* ``sizes``: ``(d_model, num_layers)`` or ``(d_model, num_layers, num_heads)`` per size, from
  small to large (without heads: the base config's ``model.num_heads``).
* or ``field`` and ``values``: the rungs set that one ``train.py`` key (``"train.lr"``) to each
  value in turn, everything else as the base config; each rung's folder is
  ``<last part of the key>_<value>`` (:func:`rung_name`). The report is then the field's
  (:mod:`diffjax.sweep.field_report`): final loss against the value, and for ``train.lr`` the
  learning-rate sensitivity.
* ``arms``: ``{name: ["section.field=value", ...]}``: every rung runs one comparison per arm, in
  ``<rung>/<name>/`` (e.g. DIFF V1 and DIFF V2 at every learning rate). Arms alone (neither
  sizes nor a field) are one rung, the base config: a comparison per arm in ``<name>/``, its
  report the arms' learning curves side by side (:mod:`diffjax.sweep.curves_report`). An arm with
  ``compare.twins=`` (:data:`ALONE`) trains its DIFF model alone; the report pairs it with another arm's twin
  when that is its twin (the same config). Default: one comparison in the rung's folder.
* ``budget``: ``"fixed"``, every size trains on ``tokens`` tokens (None: the base config's
  ``train.steps``); or ``"proportional"``, each on ``tokens_per_param`` x its DIFF model's
  non-embedding parameters. Steps = tokens / (``train.batch_size`` x ``data.seq_len``),
  rounded up, at least ``min_steps``.
* ``evals``: validation points per run (the learning curves of the tokens ratio):
  ``train.eval_every`` = steps / evals.
* ``curve_size``: the index in ``sizes`` whose learning curves give the tokens ratio (None:
  the largest).
* ``size_overrides``: ``{size name: ["section.field=value", ...]}``, settings of one size only
  (e.g. the microbatches or remat a large size needs, found with ``python -m diffjax.plan``);
  the size name is ``"<d_model>x<num_layers>"`` (:func:`size_name`). The command line's
  overrides come after them, the ladder's shape and steps last.

A bad declaration stops with :class:`diffjax.config.ConfigError` naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

from diffjax.compare import studies
from diffjax.config import ConfigError, apply_scoped

BUDGETS = ("fixed", "proportional")
# an arm's setting that trains its DIFF model alone, without a twin
ALONE = "compare.twins="


def _fail(field: str, problem: str, fix: str):
    raise ConfigError(f"SWEEP.{field}: {problem}. Fix: {fix}.")


def _size(entry: Any, i: int) -> tuple[int, ...]:
    """One ``sizes`` entry as a tuple of 2 or 3 positive ints."""
    if not isinstance(entry, (tuple, list)) or len(entry) not in (2, 3):
        _fail(
            "sizes",
            f"entry {i} is {entry!r}",
            "give (d_model, num_layers) or (d_model, num_layers, num_heads), e.g. (64, 2)",
        )
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in entry):
        _fail("sizes", f"entry {i} is {entry!r}", "use positive integers")
    return tuple(entry)


@dataclasses.dataclass(frozen=True)
class Ladder:
    """The sizes of a sweep and its token budget; checked at construction (see the module)."""

    # (d_model, num_layers[, num_heads]) per size, small first; None for a sweep over a field
    sizes: tuple[tuple[int, ...], ...] | None = None
    # how each size's tokens are set: fixed (`tokens` each) or proportional (tokens_per_param x
    # the size's non-embedding parameters)
    budget: str = "fixed"
    tokens: int | None = None  # with budget fixed: the tokens of every size (None: train.steps)
    # with budget proportional: tokens per non-embedding parameter of each size's DIFF model
    tokens_per_param: float | None = None
    min_steps: int = 10  # the fewest train steps a size gets
    evals: int = 8  # validation points per run (train.eval_every = steps / evals)
    # the index in sizes whose learning curves give the tokens ratio (None: the largest)
    curve_size: int | None = None
    size_overrides: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    field: str | None = None  # a sweep over one setting: its train.py key, e.g. "train.lr"
    values: tuple[Any, ...] | None = None  # the field's value at each rung, in order
    # named groups of settings: one comparison per arm at every rung, in <rung>/<arm>/
    arms: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    # {arm: other arm}: the DIFF model of an arm trained alone (compare.twins=) is paired with
    # the other arm's twin although that is not its own twin (a parameter-matched variant)
    twins: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self._check_arms()
        if self.field is not None or self.values is not None:
            self._check_field()
            return
        if self.sizes is None and self.arms:
            self._check_arms_only()
            return
        if not isinstance(self.sizes, (tuple, list)) or len(self.sizes) < 1:
            _fail(
                "sizes",
                f"got {self.sizes!r}",
                "give a list of (d_model, num_layers) pairs, or field and values for a sweep "
                "over one setting",
            )
        sizes = tuple(_size(s, i) for i, s in enumerate(self.sizes))
        object.__setattr__(self, "sizes", sizes)
        names = [size_name(s) for s in sizes]
        if len(set(names)) != len(names):
            _fail(
                "sizes",
                f"a (d_model, num_layers) is listed twice: {names}",
                "list each shape once",
            )
        if self.budget not in BUDGETS:
            _fail(
                "budget",
                f"unknown budget {self.budget!r}",
                f"use one of {', '.join(map(repr, BUDGETS))}",
            )
        if self.budget == "proportional":
            if self.tokens_per_param is None or not self.tokens_per_param > 0:
                _fail(
                    "tokens_per_param",
                    f"budget 'proportional' needs a positive tokens_per_param, got "
                    f"{self.tokens_per_param!r}",
                    "set e.g. tokens_per_param=20 (tokens per non-embedding parameter)",
                )
            if self.tokens is not None:
                _fail(
                    "tokens",
                    "budget 'proportional' sets each size's tokens from tokens_per_param",
                    "leave tokens unset, or use budget='fixed'",
                )
        else:
            if self.tokens_per_param is not None:
                _fail(
                    "tokens_per_param",
                    "budget 'fixed' trains every size on the same tokens",
                    "leave tokens_per_param unset, or use budget='proportional'",
                )
            if self.tokens is not None and not (isinstance(self.tokens, int) and self.tokens >= 1):
                _fail("tokens", f"got {self.tokens!r}", "give a positive integer, or None")
        for name in ("min_steps", "evals"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                _fail(name, f"got {getattr(self, name)!r}", "give a positive integer")
        if self.curve_size is not None and not -len(sizes) <= self.curve_size < len(sizes):
            _fail(
                "curve_size",
                f"index {self.curve_size} is not one of the {len(sizes)} sizes",
                f"give an index 0 .. {len(sizes) - 1}, or None for the largest",
            )

        if not isinstance(self.size_overrides, Mapping):
            _fail(
                "size_overrides",
                f"got {type(self.size_overrides).__name__}",
                "give a dict {size name: [key=value, ...]}",
            )
        for name, items in self.size_overrides.items():
            if name not in names:
                _fail(
                    "size_overrides",
                    f"{name!r} is not a size of the ladder",
                    f"use one of {', '.join(names)}",
                )
            if isinstance(items, str) or not all(isinstance(o, str) and "=" in o for o in items):
                _fail(
                    "size_overrides",
                    f"{name!r}: {items!r} is not a list of key=value strings",
                    "give e.g. ['train.grad_accum_steps=4']",
                )
        object.__setattr__(
            self, "size_overrides", {k: tuple(v) for k, v in self.size_overrides.items()}
        )

    def _check_field(self) -> None:
        """A sweep over ``field``: a ``section.key`` and at least two distinct values, a fixed
        budget and none of the size-only fields."""
        if self.sizes is not None:
            _fail("sizes", "given with field/values", "give either sizes or field and values")
        if not (isinstance(self.field, str) and "." in self.field):
            _fail("field", f"got {self.field!r}", "give a train.py key, e.g. 'train.lr'")
        if not isinstance(self.values, (tuple, list)) or len(self.values) < 2:
            _fail("values", f"got {self.values!r}", "give at least two values of the field")
        if len({repr(v) for v in self.values}) != len(self.values):
            _fail("values", f"a value is listed twice: {list(self.values)}", "list each once")
        object.__setattr__(self, "values", tuple(self.values))
        if self.budget != "fixed" or self.tokens_per_param is not None:
            _fail(
                "budget",
                "a sweep over a field trains every rung on the same tokens",
                "use budget='fixed' with tokens (or the base config's train.steps)",
            )
        if self.tokens is not None and not (isinstance(self.tokens, int) and self.tokens >= 1):
            _fail("tokens", f"got {self.tokens!r}", "give a positive integer, or None")
        if self.curve_size is not None or self.size_overrides:
            _fail(
                "curve_size" if self.curve_size is not None else "size_overrides",
                "is a setting of a sweep over sizes",
                "leave it unset for a sweep over a field (arms set per-group settings)",
            )
        for name in ("min_steps", "evals"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                _fail(name, f"got {getattr(self, name)!r}", "give a positive integer")

    def _check_arms_only(self) -> None:
        """Arms alone: one rung, the base config, a comparison per arm (e.g. DIFF V1 and DIFF
        V2 beside one twin, trained long); a fixed budget and none of the size-only fields."""
        if self.budget != "fixed" or self.tokens_per_param is not None:
            _fail(
                "budget",
                "arms without sizes train every arm on the same tokens",
                "use budget='fixed' with tokens (or the base config's train.steps)",
            )
        if self.tokens is not None and not (isinstance(self.tokens, int) and self.tokens >= 1):
            _fail("tokens", f"got {self.tokens!r}", "give a positive integer, or None")
        if self.curve_size is not None or self.size_overrides:
            _fail(
                "curve_size" if self.curve_size is not None else "size_overrides",
                "is a setting of a sweep over sizes",
                "leave it unset when the ladder has arms only",
            )
        for name in ("min_steps", "evals"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                _fail(name, f"got {getattr(self, name)!r}", "give a positive integer")

    @property
    def arms_only(self) -> bool:
        """One rung (the base config) with a comparison per arm: neither sizes nor a field."""
        return self.sizes is None and self.field is None

    def _check_arms(self) -> None:
        if not isinstance(self.arms, Mapping):
            _fail("arms", f"got {type(self.arms).__name__}", "give a dict {name: [key=value]}")
        for name, items in self.arms.items():
            if not (isinstance(name, str) and name.isidentifier()):
                _fail("arms", f"name {name!r}", "use a plain name such as 'v1' (a folder name)")
            if isinstance(items, str) or not all(isinstance(o, str) and "=" in o for o in items):
                _fail(
                    "arms",
                    f"{name!r}: {items!r} is not a list of key=value strings",
                    "give e.g. ['model.attention=diff_v2', 'model.num_heads=2']",
                )
        object.__setattr__(self, "arms", {k: tuple(v) for k, v in self.arms.items()})
        if not isinstance(self.twins, Mapping):
            _fail("twins", f"got {type(self.twins).__name__}", "give a dict {arm: other arm}")
        for arm, other in self.twins.items():
            if arm not in self.arms or other not in self.arms or arm == other:
                _fail(
                    "twins",
                    f"{arm!r}: {other!r} does not name two different arms of {list(self.arms)}",
                    "give {arm: the arm whose twin it is compared with}",
                )
            if ALONE in self.arms[other] or ALONE not in self.arms[arm]:
                _fail(
                    "twins",
                    f"{arm!r}: {other!r}",
                    f"train {arm!r} alone ({ALONE}) and {other!r} with its twin",
                )
        object.__setattr__(self, "twins", dict(self.twins))

    @property
    def rungs(self) -> list[tuple[str, Any]]:
        """``(folder name, size or value)`` of each rung, in order."""
        if self.field is not None:
            return [(rung_name(self.field, v), v) for v in self.values]
        if self.arms_only:
            return [("", None)]
        return [(f"size_{size_name(s)}", s) for s in self.sizes]

    @classmethod
    def of(cls, value: Any) -> "Ladder":
        """A :class:`Ladder` from a config file's ``SWEEP`` (a Ladder or a dict of its fields)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                _fail(
                    unknown[0],
                    "unknown field",
                    f"use only {', '.join(f.name for f in dataclasses.fields(cls))}",
                )
            if "sizes" not in value and "field" not in value and not value.get("arms"):
                _fail(
                    "sizes",
                    "missing",
                    "give a list of (d_model, num_layers) pairs, field and values, or arms",
                )
            return cls(**value)
        raise ConfigError(
            f"SWEEP is a {type(value).__name__}. Fix: set SWEEP to a diffjax.sweep.Ladder or a "
            f"dict such as {{'sizes': [(64, 2), (128, 2)], 'budget': 'fixed'}}."
        )

    def steps(self, tokens_per_step: int, non_embedding_params: int, base_steps: int) -> int:
        """The train steps of one size (see the module)."""
        if self.budget == "proportional":
            tokens = self.tokens_per_param * non_embedding_params
        elif self.tokens is not None:
            tokens = self.tokens
        else:
            return max(base_steps, self.min_steps)
        return max(math.ceil(tokens / tokens_per_step), self.min_steps)

    @property
    def curve_index(self) -> int:
        """The index of the size whose learning curves give the tokens ratio."""
        return len(self.sizes) - 1 if self.curve_size is None else self.curve_size % len(self.sizes)


# the fields a command line may set as sweep.<field>=value
SCALAR_FIELDS = ("budget", "tokens", "tokens_per_param", "min_steps", "evals", "curve_size")


def apply_ladder_overrides(ladder: Ladder, overrides: list[str]) -> Ladder:
    """``ladder`` with ``["sweep.tokens=4096", ...]`` applied (:data:`SCALAR_FIELDS`), checked
    once all are applied."""
    return apply_scoped(
        ladder, "sweep", SCALAR_FIELDS, overrides, "the sizes are set in the config file"
    )


def rung_name(field: str, value: Any) -> str:
    """A field rung's folder name: ``"lr_0.001"`` for ``train.lr=0.001``."""
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return f"{field.rsplit('.', 1)[-1]}_{text}"


def size_name(size: tuple[int, ...]) -> str:
    """``"<d_model>x<num_layers>"``: the size's folder is ``size_<name>``."""
    return f"{size[0]}x{size[1]}"


def load_ladder(path: str, study: str = "SWEEP") -> Ladder:
    """The ladder the config file at ``path`` declares as ``study``: ``SWEEP`` (sizes, arms or
    any field), or ``SENSITIVITY`` (a ladder over ``train.lr``: the learning-rate sensitivity).
    A :class:`ConfigError` names a missing file, a file for another program (with that
    program's command: :mod:`diffjax.compare.studies`) or a bad ladder, and the fix."""
    if not os.path.isfile(path):
        raise ConfigError(
            f"config file {path!r} does not exist. Fix: pass a sweep config such as "
            f"configs/scaling_cpu.py."
        )
    try:
        ladder = Ladder.of(studies.check_command(path, study))
    except ConfigError as e:
        raise ConfigError(e.args[0] if str(e).startswith(path) else f"{path}: {e}") from None
    if study == "SENSITIVITY" and ladder.field != "train.lr":
        raise ConfigError(
            f"{path}: SENSITIVITY is a ladder over train.lr, this one is over "
            f"{ladder.field or 'sizes or arms'}. Fix: SENSITIVITY = Ladder(field='train.lr', "
            f"values=[...], arms=...), or declare another ladder as SWEEP (python -m diffjax.sweep)"
        )
    return ladder
