"""Many runs, one runner: a study is a plan of runs, and :func:`run_plan` trains them.

A run is a name, a folder and the overrides that make its config (a continuation's starting
checkpoint among them, ``train.init_from``). The runner goes through a plan in order: a run
whose folder holds the plan's done-marker written with these same overrides finished earlier
and is skipped; any other run is handed to the study's ``execute``, which trains it (resuming
from the checkpoints in its folder) with its output appended to the folder's ``train.log``
(:func:`run_log`: synced to a ``gs://`` folder as it grows), and on success the marker is
written. SIGTERM or SIGINT stops the run at the next step boundary with its step saved
(:class:`~diffjax.train.preemption.Preempted`, ``train.py``'s exit 75): the same command
resumes, skipping what finished. The comparison's paired seeds (:func:`diffjax.compare.cli.
train_seeds`: no markers, each model resumes from its own checkpoints), the sweep's ladders
(:mod:`diffjax.sweep`) and the retrofit study (:mod:`diffjax.compare.retrofit_study`) are plans
on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Iterator, Sequence

from diffjax.infra import storage
from diffjax.train.preemption import Preempted, preemption_guard

AfterStep = Callable[[int, Any], None]


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of a plan: its name (``"64x2"``, ``"v2/seed_1"``), folder and overrides; ``kind``
    names what a run is in the progress lines (``"size"``: ``[size 1/4] 64x2``; ``""``:
    ``[1/4] ...``)."""

    name: str
    directory: str
    overrides: tuple[str, ...]
    kind: str = ""


def is_done(run: Run, done_file: str) -> bool:
    """Whether ``run`` finished earlier with these same overrides (its folder's ``done_file``)."""
    path = storage.join(run.directory, done_file)
    if not storage.exists(path):
        return False
    return storage.read_json(path).get("overrides") == list(run.overrides)


@contextlib.contextmanager
def run_log(directory: str, after_step: AfterStep | None = None) -> Iterator[AfterStep]:
    """Everything printed inside goes to ``directory/train.log`` (appended to: a resumed run
    keeps what it printed before; in a ``gs://`` folder on local disk after the bucket's copy,
    uploaded whole every 30 s of training and at the end). Yields the ``after_step`` to train
    with: it syncs the log when due, then calls ``after_step``."""
    storage.makedirs(directory)
    logs = storage.SyncedDir(directory)
    logs.pull("train.log")
    log = open(logs.local_path("train.log"), "a")

    def step(i: int, checkpointer) -> None:
        if logs.due():
            log.flush()
            logs.sync()
        if after_step is not None:
            after_step(i, checkpointer)

    try:
        with log, contextlib.redirect_stdout(log):
            yield step
    finally:
        logs.close()


def run_plan(
    runs: Sequence[Run],
    execute: Callable[[Run], Any],
    *,
    run_dir: str,
    done_file: str | None,
    describe: Callable[[Run], str] = lambda run: "training",
    record: Callable[[Any], dict] = lambda result: result or {},
    say: Callable[[str], None] = print,
) -> list[Any]:
    """Train every run of ``runs`` not done yet, in order, and return what ``execute(run)``
    returned for each (None for a run skipped). ``execute`` trains (and whatever else the study
    does with) one run; ``record(its result)``: what the run's marker records beside its
    overrides and finishing time. ``done_file`` None: no markers, every run is executed and
    resumes from its own checkpoints (a finished one ends at once). ``describe(run)``: the
    progress line's words for it; ``run_dir``: the plan's folder (named when a signal comes
    after the last run). Raises :class:`Preempted` (stopped and saved, said in the progress
    line: the same call resumes) and what ``execute`` raises."""
    n, results = len(runs), []
    with preemption_guard() as guard:
        for i, run in enumerate(runs, 1):
            where = f"[{f'{run.kind} ' if run.kind else ''}{i}/{n}] {run.name}"
            if done_file is not None and is_done(run, done_file):
                say(f"{where}: finished earlier, skipped")
                results.append(None)
                continue
            log = "" if done_file is None else f"; log: {storage.join(run.directory, 'train.log')}"
            say(f"{where}: {describe(run)}{log}")
            start = time.time()
            try:
                results.append(execute(run))
            except Preempted:
                say(
                    f"{where}: stopped and saved; re-run the same command to resume (finished "
                    f"runs are skipped)"
                )
                raise
            if done_file is not None:
                marker = {"overrides": list(run.overrides), "finished": time.time()}
                marker.update(record(results[-1]))
                storage.write_json(storage.join(run.directory, done_file), marker)
            say(f"{where}: done in {time.time() - start:.0f} s")
        if not guard.synced and guard.requested():  # after the last run's last step
            raise Preempted(None, run_dir, guard.signal_name)
    return results


class RunFailed(Exception):
    """A run of a plan ended with a non-zero exit code other than preemption's."""

    def __init__(self, run: Run, code: int):
        self.run, self.code = run, code
        super().__init__(f"{run.name} failed (exit {code}); see {run.directory}/train.log")
