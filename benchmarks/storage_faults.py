"""What each fault of a bucket costs a run, and what the run does about it.

A corpus is prepared into a bucket of the GCS emulator (fake-gcs-server on 127.0.0.1, the test
extra's), then the same tiny ``train.py`` run (4 steps, a checkpoint every 2, then resumed to
6) is trained from it into the bucket through ``tests/fault_proxy.py``'s proxy: once clean,
then under each fault: a share of the requests answered 503 or 429, their connection reset or
stalled 2 s; the server gone for 20 s, gone for good, gone right after the first checkpoint
commits (the run stops; the same command once it is back); a kill -9 in the middle of the
second checkpoint's save under 503s (then resumed); two ``jax.distributed`` processes under
503s (against a clean two-process run); and ``data.prepare`` into the bucket under 503s, 429s
and resets (against the clean prepare's objects).

Each child's environment holds only ``STORAGE_EMULATOR_HOST`` (and
``DIFFJAX_STORAGE_TIMEOUT_S`` where the row says so). A row gives the outcome (losses equal to
the clean run's bit for bit, or the exit status and the first line of the message), its wall
time against its clean run's and the faults injected. Every row has a wall budget and the whole
benchmark one (``--budget``, default 600 s): a row past it reads "timed out after N s", a row
not started in time "not run". Rows run ``--lanes`` at a time (default 2: they mostly wait on
retry backoff), print as they finish, and the markdown table (``--out``) is rewritten as it
grows. Below it, the clean run's requests by what they were for, from the proxy's log: per
training step, per checkpoint save, per resume and per metrics sync.

    python benchmarks/storage_faults.py --out storage_faults.md   # about 10 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

TINY = [
    "compare.twins=",
    "model.d_model=32",
    "model.num_layers=1",
    "model.num_heads=1",
    "model.max_seq_len=32",
    "data.seq_len=16",
    "data.prefetch=0",  # read each batch when the step asks for it: no windows read past the end
    "train.batch_size=8",
    "train.eval_batches=1",
    "train.warmup_steps=2",
    "train.progress=false",
    "compare.seeds=1",
    "compare.throughput_rounds=0",
    "train.kernel_check=off",
    "compare.quick_eval=false",
    "train.tensorboard=false",
    "train.eval_every=2",
    "train.checkpoint_every=2",
    "run.sync_every_s=1",
]
SHARE = 0.1  # the share of requests a 503, 429, reset or stall row hits
SCHEDULE = ((4, ()), (6, ("--resume",)))  # the clean run's: 4 steps, then resumed to 6
FIRST_COMMIT = "checkpoints/2/commit_success.txt"  # the first checkpoint's commit marker
SECOND_SAVE = "checkpoints/4/"  # any write of the second checkpoint's save


class TimedOut(Exception):
    pass


@dataclasses.dataclass
class Row:
    what: str
    share: str = ""
    outcome: str = "not run"
    seconds: float | None = None
    base: float | None = None  # its clean run's seconds
    injected: str = ""

    def line(self) -> str:
        took = ""
        if self.seconds is not None:
            took = f"{self.seconds:.0f} s"
            if self.base is not None:
                took += f" ({self.seconds - self.base:+.0f} s)"
        return f"| {self.what} | {self.share} | {self.outcome} | {took} | {self.injected} |"


class Bench:
    """The bucket, the clean run's results, the deadline, and the children it starts."""

    def __init__(self, server, tmp: str, deadline: float):
        self.server, self.tmp, self.deadline = server, tmp, deadline
        self.bucket = server.new_bucket()
        self.corpus = os.path.join(tmp, "corpus")
        self.clean: list[float] = []
        self.clean_s = self.prep_s = 0.0
        self.prepared: dict[str, bytes] = {}
        self._n = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ children
    def env(self, host: str, budget: float | None = None, devices: int = 1) -> dict[str, str]:
        env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", self.tmp)}
        env |= {"TMPDIR": self.tmp, "STORAGE_EMULATOR_HOST": host}
        if devices > 1:
            env["JAX_NUM_CPU_DEVICES"] = str(devices)
        if budget is not None:
            env["DIFFJAX_STORAGE_TIMEOUT_S"] = str(budget)
        return env

    def spawn(self, args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, str]:
        with self._lock:
            self._n += 1
            err = os.path.join(self.tmp, f"child-{self._n}.err")
        with open(err, "w") as f:
            proc = subprocess.Popen(
                [sys.executable, *args],
                env=env,
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=f,
                start_new_session=True,  # a timeout kills the child and what it started
            )
        return proc, err

    def wait(self, children, end: float) -> list[tuple[int, str]]:
        """Each child's (exit status, stderr's last line); all killed at ``end``."""
        out = []
        try:
            for proc, err in children:
                proc.wait(timeout=max(0.0, end - time.monotonic()))
                with open(err) as f:
                    out.append((proc.returncode, (f.read().strip().splitlines() or [""])[-1]))
        except subprocess.TimeoutExpired:
            for proc, _ in children:
                kill(proc)
            raise TimedOut from None
        return out

    def run(self, args, env, end: float) -> tuple[int, str]:
        return self.wait([self.spawn(args, env)], end)[0]

    def train(self, name: str, steps: int, *flags: str) -> list[str]:
        return [
            "train.py",
            f"run.dir={self.bucket}/{slug(name)}",
            *TINY,
            "data.source=tokens",
            f"data.path={self.bucket}/prep",
            f"train.steps={steps}",
            *flags,
        ]

    def prepare(self, out: str, host: str, end: float) -> tuple[int, str]:
        args = ["-m", "diffjax.data.prepare", self.corpus, "prepare.tokenizer=byte"]
        args += [f"prepare.out={out}", "prepare.val_fraction=0.2", "prepare.progress=false"]
        return self.run(args, self.env(host), end)

    def schedule(self, name: str, host: str, end: float, budget=None, flags=()) -> tuple[int, str]:
        """The clean run's schedule under ``name``: (exit status, last line) of the first failure."""
        for steps, extra in SCHEDULE:
            rc, last = self.run(
                self.train(name, steps, *extra, *flags), self.env(host, budget), end
            )
            if rc != 0:
                return rc, last
        return 0, ""

    def losses(self, name: str) -> list[float]:
        from diffjax.train.metrics import read_metrics

        path = f"{self.bucket}/{slug(name)}/diff/seed_0/metrics.jsonl"
        return [r["loss"] for r in read_metrics(path)]

    def same(self, name: str, reference: list[float] | None = None) -> str:
        equal = self.losses(name) == (self.clean if reference is None else reference)
        return "losses equal to the clean run's" if equal else "DIFFERENT losses"


def slug(name: str) -> str:
    """A row's name as its run folder's."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def failed(rc: int, last: str) -> str:
    return f"exit {rc}: {last[:160]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- the rows
# Each returns (outcome, faults injected) and may raise TimedOut; ``end`` is its deadline.
def share_of_requests(b: Bench, row: Row, proxy, end: float, kind: str, stall_s: float = 0.0):
    proxy.set(kind, rate=SHARE, stall_s=stall_s)
    rc, last = b.schedule(row.what, proxy.url, end)
    return (f"completed, {b.same(row.what)}" if rc == 0 else failed(rc, last)), proxy.injected


def gone_for(b: Bench, row: Row, proxy, end: float, seconds: float):
    proxy.down_for(seconds)
    rc, last = b.schedule(row.what, proxy.url, end)
    return (f"completed, {b.same(row.what)}" if rc == 0 else failed(rc, last)), proxy.injected


def gone_for_good(b: Bench, row: Row, proxy, end: float, budget: float):
    proxy.set("down")
    rc, last = b.schedule(row.what, proxy.url, end, budget=budget)
    return failed(rc, last), proxy.injected


def gone_after_first_checkpoint(b: Bench, row: Row, proxy, end: float, budget: float):
    """The server goes away once the first checkpoint has committed; the same command (4
    steps, --resume) once it is back."""
    proxy.down_after(FIRST_COMMIT)
    t0 = time.monotonic()
    rc, last = b.run(b.train(row.what, 4), b.env(proxy.url, budget), end)
    stopped = f'stopped with exit {rc} in {time.monotonic() - t0:.0f} s ("{last[:90]}…")'
    proxy.set(None)
    rc, last = b.run(b.train(row.what, 4, "--resume"), b.env(proxy.url, budget), end)
    if rc != 0:
        return f"{stopped}; the rerun: {failed(rc, last)}", proxy.injected
    return f"{stopped}; the rerun resumed, {b.same(row.what, b.clean[:4])}", proxy.injected


def killed_mid_checkpoint(b: Bench, row: Row, proxy, end: float):
    """kill -9 right after the second checkpoint's first write is answered, under 503s; then
    the clean run's schedule with --resume."""
    proxy.set("503", rate=SHARE)
    proxy.watch(SECOND_SAVE)
    child = b.spawn(b.train(row.what, 4), b.env(proxy.url))
    while not proxy.triggered.wait(0.01) and child[0].poll() is None:
        if time.monotonic() > end:
            kill(child[0])
            raise TimedOut
    kill(child[0])
    objects = b.server.objects(f"{b.bucket}/{slug(row.what)}/diff/seed_0/checkpoints")
    where = (
        "killed after step 4's checkpoint committed"
        if "4/commit_success.txt" in objects
        else "killed mid-save (step 4's checkpoint uncommitted)"
        if any(name.startswith("4/") for name in objects)
        else "killed before step 4's save"
    )
    rc, last = b.schedule(row.what, proxy.url, end, flags=("--resume",))
    return (
        f"{where}; resumed, {b.same(row.what)}" if rc == 0 else failed(rc, last)
    ), proxy.injected


def two_processes(b: Bench, row: Row, proxy, end: float):
    """Two processes of one device each, on the clean run's schedule: clean (its baseline),
    then under 503s."""

    def both(name: str, host: str) -> tuple[int, str]:
        for steps, extra in SCHEDULE:
            port = free_port()
            children = [
                b.spawn(
                    b.train(name, steps, *extra, "--coordinator_address", f"127.0.0.1:{port}")
                    + ["--num_processes", "2", "--process_id", str(i)],
                    b.env(host),
                )
                for i in range(2)
            ]
            for rc, last in b.wait(children, end):
                if rc != 0:
                    return rc, last
        return 0, ""

    t0 = time.monotonic()
    rc, last = both(f"{row.what} (clean)", b.server.url)
    if rc != 0:
        return f"the clean two-process run failed: {failed(rc, last)}", ""
    row.base = time.monotonic() - t0
    proxy.set("503", rate=SHARE)
    rc, last = both(row.what, proxy.url)
    if rc != 0:
        return failed(rc, last), proxy.injected
    reference = b.losses(f"{row.what} (clean)")
    same = b.same(row.what, reference).replace("the clean run's", "the clean two-process run's")
    return f"completed, {same} ({row.base:.0f} s)", proxy.injected


def prepare_under(b: Bench, row: Row, proxy, end: float, kind: str):
    proxy.set(kind, rate=SHARE)
    out = f"{b.bucket}/prep-{kind}"
    rc, last = b.prepare(out, proxy.url, end)
    if rc != 0:
        return failed(rc, last), proxy.injected
    same = b.server.objects(out) == b.prepared
    return ("completed, the same objects as the clean prepare" if same else "DIFFERENT objects"), (
        proxy.injected
    )


# (row, share, the row's function, its arguments, its wall budget in seconds); longest first
def plan() -> list[tuple[str, str, object, tuple, float]]:
    share = f"{SHARE:g}"
    return [
        ("two processes, 503 answers", share, two_processes, (), 300),
        ("kill -9 mid-checkpoint, 503 answers", share, killed_mid_checkpoint, (), 240),
        ("503 answers", share, share_of_requests, ("503",), 200),
        ("429 answers", share, share_of_requests, ("429",), 200),
        ("requests stalled 2 s", share, share_of_requests, ("stall", 2.0), 200),
        ("connection resets", share, share_of_requests, ("reset",), 150),
        (
            "server gone after the first checkpoint, budget 10 s",
            "",
            gone_after_first_checkpoint,
            (10,),
            150,
        ),
        ("server gone for 20 s at the start", "", gone_for, (20,), 120),
        ("server gone, budget 10 s", "1", gone_for_good, (10,), 60),
        ("data.prepare, 503 answers", share, prepare_under, ("503",), 60),
        ("data.prepare, 429 answers", share, prepare_under, ("429",), 60),
        ("data.prepare, connection resets", share, prepare_under, ("reset",), 60),
    ]


# ---------------------------------------------------------------------- requests
def request_kind(method: str, path: str, saves: set[str]) -> str:
    """What one logged request of a run was for (``saves``: the steps it saved)."""
    p = urllib.parse.unquote(path)
    if re.search(r"prep/train_\d+\.bin", p):
        return "training windows"
    if re.search(r"prep/val_\d+\.bin", p):
        return "validation windows"
    if "prep/" in p:
        return "prepared data: manifest, listing, indexes"
    step = re.search(r"checkpoints/(\d+)", p)
    if step:
        return "checkpoint saves" if step.group(1) in saves else "earlier checkpoints: restore"
    if "checkpoints" in p:
        return "checkpoints: listing the committed steps"
    if method == "POST" and "metrics.jsonl" in p:
        return "metrics syncs (metrics.jsonl uploads)"
    if "metrics.jsonl" in p:
        return "metrics.jsonl: reading the copy in the bucket"
    if re.fullmatch(r"/storage/v1/b/[^/?]+(\?.*)?", p):
        return "bucket access checks"
    return "other (config, results, logs)"


def requests_table(logs: list[list[tuple[str, str]]]) -> list[str]:
    """The clean run's requests by kind: the fresh run (4 steps, saves at 2 and 4) and the
    resumed one (to 6: a restore, steps 5-6, a save at 6); then the figures per unit."""
    runs = [{"2", "4"}, {"6"}]
    counts = [
        collections.Counter(request_kind(m, p, s) for m, p in log) for log, s in zip(logs, runs)
    ]
    kinds = sorted(set(counts[0]) | set(counts[1]), key=lambda k: -(counts[0][k] + counts[1][k]))
    lines = [
        "| requests of the clean run | fresh: 4 steps, saves at 2 and 4 | resumed: to 6, a save at 6 |",
        "|---|---:|---:|",
        *(f"| {k} | {counts[0][k]} | {counts[1][k]} |" for k in kinds),
        f"| all | {sum(counts[0].values())} | {sum(counts[1].values())} |",
    ]
    step = (counts[0]["training windows"] + counts[1]["training windows"]) / 6
    save = (counts[0]["checkpoint saves"] + counts[1]["checkpoint saves"]) / 3
    restore = counts[1]["earlier checkpoints: restore"]
    restore += counts[1]["checkpoints: listing the committed steps"]
    syncs = counts[0]["metrics syncs (metrics.jsonl uploads)"]
    lines += [
        "",
        f"Per training step: {step:g} ranged reads (one per window of the batch, 8 here). Per "
        f"checkpoint save: {save:.0f} requests. Per resume: {restore} requests to find and "
        f"restore the checkpoint. Per metrics sync: one upload of each file that changed "
        f"({syncs} uploads of metrics.jsonl in the fresh run).",
    ]
    return lines


# ---------------------------------------------------------------------- main
def setup(b: Bench, proxy_cls) -> list[list[tuple[str, str]]]:
    """The corpus, its clean prepare (timed) and the clean run (timed, its requests logged)."""
    os.makedirs(b.corpus)
    for i in range(6):
        with open(os.path.join(b.corpus, f"d{i}.txt"), "w") as f:
            f.write("".join(f"def f{i}_{j}(x):\n    return x * {i + j}\n" for j in range(150)))
    t0 = time.monotonic()
    rc, last = b.prepare(f"{b.bucket}/prep", b.server.url, b.deadline)
    assert rc == 0, f"the clean prepare failed: {last}"
    b.prep_s = time.monotonic() - t0
    b.prepared = b.server.objects(f"{b.bucket}/prep")
    logs = []
    t0 = time.monotonic()
    with proxy_cls(b.server.url) as proxy:
        for steps, extra in SCHEDULE:
            n = len(proxy.log)
            rc, last = b.run(b.train("clean", steps, *extra), b.env(proxy.url), b.deadline)
            assert rc == 0, f"the clean run failed: {last}"
            logs.append(proxy.log[n:])
    b.clean_s = time.monotonic() - t0
    b.clean = b.losses("clean")
    return logs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the table to this markdown file, as it grows")
    parser.add_argument("--budget", type=float, default=600, help="seconds for the whole run")
    parser.add_argument("--lanes", type=int, default=2, help="rows run at a time")
    parser.add_argument("--rows", help="only the rows whose name contains one of these (a,b)")
    args = parser.parse_args()

    from fault_proxy import FaultProxy
    from gcs_emulator import GcsEmulator

    from diffjax.infra import storage

    start = time.monotonic()
    chosen = [r for r in plan() if not args.rows or any(k in r[0] for k in args.rows.split(","))]
    with GcsEmulator() as server, tempfile.TemporaryDirectory() as tmp:
        b = Bench(server, tmp, start + args.budget)
        logs = setup(b, FaultProxy)
        rows = [Row("none (clean run)", "", f"completed, {len(b.clean)} steps", b.clean_s)]
        rows.append(Row("none (data.prepare into the bucket)", "", "completed", b.prep_s))
        rows += [Row(what, share) for what, share, *_ in chosen]
        lock = threading.Lock()

        def write() -> None:
            lines = [
                "| fault | share of requests | outcome | wall time (against its clean run) "
                "| faults injected |",
                "|---|---:|---|---:|---:|",
                *(r.line() for r in rows),
                "",
                *requests_table(logs),
            ]
            if args.out:
                storage.write_text(args.out, "\n".join(lines) + "\n")
            return lines

        def one(i: int, seed: int) -> None:
            what, _, fn, extra, budget = chosen[i]
            row = rows[2 + i]
            row.base = b.prep_s if what.startswith("data.prepare") else b.clean_s
            t0 = time.monotonic()
            end = min(t0 + budget, b.deadline)
            if end - t0 < 10:
                row.outcome = f"not run (the benchmark's {args.budget:.0f} s were spent)"
                row.base = None
            else:
                with FaultProxy(server.url, seed=seed) as proxy:
                    try:
                        row.outcome, row.injected = fn(b, row, proxy, end, *extra)
                    except TimedOut:
                        row.outcome = f"timed out after {end - t0:.0f} s"
                        row.injected = proxy.injected
                row.seconds = time.monotonic() - t0
            with lock:
                print(row.line(), file=sys.stderr, flush=True)
                write()

        write()
        with concurrent.futures.ThreadPoolExecutor(args.lanes) as pool:
            for future in [pool.submit(one, i, i) for i in range(len(chosen))]:
                future.result()
        print("\n".join(write()))
    print(f"{time.monotonic() - start:.0f} s in all", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
