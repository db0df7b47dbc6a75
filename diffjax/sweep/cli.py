"""``python -m diffjax.sweep --config FILE [--report-only] [section.field=value ...]``.

``sweep.<field>=value`` overrides set the ladder's scalar fields (``sweep.tokens=4096``).

Runs the comparison of :mod:`diffjax.compare` (DIFF beside its twin, paired seeds) at every size
of the ladder the config file declares (``SWEEP``, :class:`diffjax.sweep.Ladder`), each into
``RUN_DIR/size_<d_model>x<num_layers>/``, then writes ``RUN_DIR/sweep.md`` and its plots
(:mod:`diffjax.sweep.report`). The overrides are train.py's, ``run.dir`` included; the ladder
sets each size's ``model.d_model``, ``model.num_layers`` (``model.num_heads`` when the size
gives it), ``train.steps`` and ``train.eval_every`` over them.

Resumable: a finished size (its ``sweep_done.json`` written with the same overrides) is
skipped; an unfinished one resumes from its checkpoints (the comparison's own resume). SIGTERM
or SIGINT stops the size in training at the next step, saved, and exits with status 75; the
same command resumes. Each size's own output goes to ``size_*/train.log``; the terminal gets
one line per size as it starts and finishes.

One process (any number of local devices): the comparison's multi-host start runs once per
process, so a multi-host ladder runs each size with ``train.py`` instead (docs/sweep.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from typing import Any

from diffjax import cli
from diffjax.infra import storage
from diffjax.compare import cli as compare_cli
from diffjax.compare import studies
from diffjax.compare.config import default_comparison, load_comparison
from diffjax.compare.runner import Run, RunFailed, run_log, run_plan
from diffjax.config import ConfigError, ModelConfig, split_scoped
from diffjax.data import DataError
from diffjax.evaluate.stats import twin_name
from diffjax.nn.param_count import count_params
from diffjax.train.config import apply_overrides, experiment_keys_help
from diffjax.train.loop import AfterStep
from diffjax.train.preemption import Preempted

from diffjax.sweep.ladder import (
    BUDGETS,
    SCALAR_FIELDS,
    Ladder,
    apply_ladder_overrides,
    load_ladder,
    size_name,
)
from diffjax.sweep.report import PLAN_FILE, write_sweep_report

EXIT_BAD_INPUT = compare_cli.EXIT_BAD_INPUT
EXIT_PREEMPTED = compare_cli.EXIT_PREEMPTED
DONE_FILE = "sweep_done.json"


@functools.lru_cache(maxsize=64)
def non_embedding_params(model: ModelConfig) -> int:
    """Parameters outside the token embedding and the output projection (counted from
    abstract shapes, no weights allocated)."""
    count = count_params(model)
    return count.total - count.parts["embedding"] - count.parts["lm_head"]


@dataclasses.dataclass(frozen=True)
class SizeRun:
    """One comparison of the sweep (a size, or a field's rung and an arm): its name, folder,
    the overrides of its comparison, its steps and tokens, and the non-embedding parameters of
    DIFF and the twin (None: an arm that trains DIFF alone) and of any other twin by name."""

    name: str
    shape: tuple[int, ...] | None
    directory: str
    overrides: tuple[str, ...]
    steps: int
    tokens: int
    diff_params: int
    twin_params: int | None
    note: str = ""
    value: Any = None  # a sweep over a field: this rung's value
    arm: str = ""  # the ladder's arm ("": none)
    others: dict = dataclasses.field(default_factory=dict)  # {"gated": its parameters}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def size_overrides(
    exp, ladder: Ladder, rung, directory: str, user: list[str], own: list[str]
) -> tuple[list[str], int, str]:
    """The comparison's overrides for one rung (``own``: the ladder's for this size or arm,
    then the user's, then the rung's shape or field value and the steps), its steps, and a
    note on what the ladder changed beyond them. ``exp``: the base experiment with ``own``
    and the user's overrides; ``rung``: a size's shape, or the field's value."""
    if ladder.field is not None:
        model, rung_keys = exp.model, [f"{ladder.field}={rung}"]
    elif ladder.arms_only:
        model, rung_keys = exp.model, []
    else:
        heads = {"num_heads": rung[2]} if len(rung) > 2 else {}
        model = exp.model.replace(d_model=rung[0], num_layers=rung[1], **heads)
        rung_keys = [f"model.d_model={rung[0]}", f"model.num_layers={rung[1]}"]
        rung_keys += [f"model.num_heads={rung[2]}"] if len(rung) > 2 else []
    tokens_per_step = exp.train.batch_size * exp.data.seq_len
    steps = ladder.steps(tokens_per_step, non_embedding_params(model), exp.train.steps)
    extra = [
        f"run.dir={directory}",
        *rung_keys,
        f"train.steps={steps}",
        f"train.eval_every={max(1, steps // ladder.evals)}",
    ]
    note = ""
    if exp.train.warmup_steps >= steps:
        warmup = steps // 10
        extra.append(f"train.warmup_steps={warmup}")
        note = f"warmup {exp.train.warmup_steps} >= {steps} steps: {warmup} used"
    if not any(o.split("=", 1)[0].strip() == "train.progress" for o in user):
        extra.append("train.progress=false")
    return [*own, *user, *extra], steps, note


def plan_sweep(
    config: str, overrides: list[str], study: str = "SWEEP"
) -> tuple[str, Ladder, list[SizeRun]]:
    """The run directory, the ladder the config file declares as ``study`` (``sweep.*``
    overrides applied) and every size's :class:`SizeRun`, each size's config checked (a bad
    shape stops here, before anything trains)."""
    mine, overrides = split_scoped(overrides, "sweep")
    ladder = apply_ladder_overrides(load_ladder(config, study), mine)
    base = load_comparison(config)
    exp = apply_overrides(base, overrides)
    if not exp.compare.twins:
        raise ConfigError(
            "the sweep compares DIFF with its twin at every size, but compare.twins is empty. "
            "Fix: drop compare.twins= (or set compare.twins=standard)."
        )
    run_dir = exp.run.path
    runs = []
    arms = ladder.arms or {"": ()}
    for folder, rung in ladder.rungs:
        for arm, arm_overrides in arms.items():
            sized = ladder.field is None and not ladder.arms_only
            name = "/".join(p for p in ((size_name(rung) if sized else folder), arm) if p)
            directory = storage.join(run_dir, *[p for p in (folder, arm) if p])
            try:
                own = [
                    *(ladder.size_overrides.get(size_name(rung), ()) if sized else ()),
                    *arm_overrides,
                ]
                inner, steps, note = size_overrides(
                    apply_overrides(base, [*own, *overrides]),
                    ladder,
                    rung,
                    directory,
                    overrides,
                    own,
                )
                size_exp = apply_overrides(base, inner)
            except ConfigError as e:
                raise ConfigError(f"{'size' if sized else 'rung'} {name}: {e}") from None
            twin = size_exp.models.get("standard")
            runs.append(
                SizeRun(
                    name,
                    rung if sized else None,
                    directory,
                    tuple(inner),
                    steps,
                    steps * size_exp.train.batch_size * size_exp.data.seq_len,
                    non_embedding_params(size_exp.models["diff"]),
                    None if twin is None else non_embedding_params(twin),
                    note,
                    value=None if sized else rung,
                    arm=arm,
                    others={
                        k: non_embedding_params(m)
                        for k, m in size_exp.models.items()
                        if k not in ("diff", "standard")
                    },
                )
            )
    return run_dir, ladder, runs


def write_plan(run_dir: str, config: str, ladder: Ladder, runs: list[SizeRun]) -> None:
    """``RUN_DIR/sweep_plan.json``: the ladder and every size's plan, for the report."""
    storage.makedirs(run_dir)
    plan = {
        "config": config,
        "ladder": dataclasses.asdict(ladder),
        "sizes": [r.to_dict() for r in runs],
    }
    storage.write_json(storage.join(run_dir, PLAN_FILE), plan)


def run_size(
    config: str, run: SizeRun, after_step: AfterStep | None = None, study: str = "SWEEP"
) -> None:
    """The comparison of one size (``diffjax.compare``'s command line), its output appended to
    its folder's ``train.log`` (:func:`diffjax.compare.runner.run_log`). Raises
    :class:`Preempted` when it stopped and saved, :class:`RunFailed` on another failure.
    ``after_step``: as :func:`diffjax.compare.main`'s."""
    with run_log(run.directory, after_step) as step:
        argv = ["--config", config, *run.overrides]
        code = compare_cli.main(argv, after_step=step, study=study)
    if code == EXIT_PREEMPTED:
        raise Preempted(None, run.directory)
    if code != 0:
        raise RunFailed(_plan_run(run), code)


def _plan_run(run: SizeRun) -> Run:
    """``run`` as a run of the one runner's plan."""
    return Run(run.name, run.directory, run.overrides, "size" if run.shape is not None else "rung")


def _describe(run: SizeRun) -> str:
    """The progress line's words for a size or rung."""
    twin = "" if run.twin_params is None else f" and the twin ({run.twin_params:,})"
    twin += "".join(f" and {twin_name(k)} ({n:,})" for k, n in run.others.items())
    note = f" ({run.note})" if run.note else ""
    return (
        f"training DIFF ({run.diff_params:,} non-embedding parameters){twin}, {run.steps} "
        f"steps, {run.tokens:,} tokens each{note}"
    )


def _keys_help() -> str:
    """The ``sweep.*`` keys (the ladder's scalar fields; Ladder's defaults, which the config
    file's SWEEP may change) and then train.py's."""
    ladder = Ladder(sizes=((64, 2),))  # the sizes are the config file's: not a key
    section = cli.Section(
        "sweep",
        ladder,
        {"budget": BUDGETS},
        exclude=tuple(f.name for f in dataclasses.fields(Ladder) if f.name not in SCALAR_FIELDS),
    )
    title = "sweep settings (set as sweep.field=value; defaults: Ladder's, unless SWEEP sets them):"
    return (
        cli.keys_help([section], title=title) + "\n\n" + experiment_keys_help(default_comparison())
    )


def build_parser(study: str = "SWEEP") -> argparse.ArgumentParser:
    what = {
        "SWEEP": "Train DIFF and its twin at every size of a ladder (the config file's SWEEP; or "
        "at every arm, or every value of a field), then fit their scaling curves and the "
        "parameter-efficiency ratio (RUN_DIR/sweep.md).",
        "SENSITIVITY": "Train DIFF and its twin at every learning rate of the config file's "
        "SENSITIVITY ladder, then their learning-rate sensitivity with its paired interval "
        "(RUN_DIR/sweep.md).",
    }[study]
    parser = argparse.ArgumentParser(
        prog=studies.COMMANDS[study],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_keys_help(),
        description=f"{what} Overrides as train.py's (python train.py --help lists the keys), "
        "and sweep.<field>=value for the ladder's budget, tokens, tokens_per_param, min_steps, "
        "evals and curve_size.",
    )
    parser.add_argument(
        "--config", required=True, help=f"a config file with get_config() and {study}"
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing: write sweep.md from the runs finished so far",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    return parser


def summary_section(markdown: str) -> str:
    """The body of the ``## Summary`` section of ``sweep.md``."""
    body = markdown.split("\n## Summary\n", 1)[-1]
    return body.split("\n## ", 1)[0].strip()


def _say(text: str) -> None:
    print(text, flush=True)


def main(
    argv: list[str] | None = None,
    *,
    after_step: AfterStep | None = None,
    study: str = "SWEEP",
) -> int:
    """The sweep's command line (``study="SENSITIVITY"``: the learning-rate sensitivity's,
    :mod:`diffjax.sweep.lr_sensitivity`); returns the exit code. ``after_step``: passed to every
    size's comparison (:func:`diffjax.compare.main`; the resume test stops a run from it)."""
    args = build_parser(study).parse_args(argv)
    try:
        run_dir, ladder, runs = plan_sweep(args.config, args.overrides, study)
        storage.check_access(run_dir, what="run.dir", write=True)  # a gs:// one, before training
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    write_plan(run_dir, args.config, ladder, runs)
    kind = (
        "arms"
        if ladder.arms_only
        else "sizes"
        if ladder.field is None
        else f"comparisons over {ladder.field}"
    )
    _say(f"sweep: {len(runs)} {kind} into {run_dir}")
    if not args.report_only:
        by_name = {r.name: r for r in runs}
        try:
            run_plan(
                [_plan_run(r) for r in runs],
                lambda run: run_size(args.config, by_name[run.name], after_step, study),
                run_dir=run_dir,
                done_file=DONE_FILE,
                describe=lambda run: _describe(by_name[run.name]),
                say=_say,
            )
        except Preempted:
            return EXIT_PREEMPTED
        except RunFailed as e:
            print(f"error: {e}", file=sys.stderr)
            return e.code
    text = write_sweep_report(run_dir)
    _say(summary_section(text))
    _say(f"report: {storage.join(run_dir, 'sweep.md')}")
    return 0
