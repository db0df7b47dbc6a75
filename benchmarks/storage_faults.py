"""What a bucket's faults cost a run: ``python benchmarks/storage_faults.py [--out FILE.md]``.

A corpus is prepared into a bucket of the GCS emulator (fake-gcs-server on 127.0.0.1, the test
extra's), then the same tiny ``train.py`` run (4 steps, a checkpoint every 2, then resumed to
6) is trained from it into the bucket through ``tests/fault_proxy.py``'s proxy, once clean and
once under each fault: a share of the requests answered 503 or 429 or their connection reset,
every request stalled, the server gone for a while, the server gone for good. Each child's
environment holds only ``STORAGE_EMULATOR_HOST`` (and ``DIFFJAX_STORAGE_TIMEOUT_S`` where the
row says so). A row gives the outcome (losses equal to the clean run's bit for bit, or the exit
status and the first line of the message) and the wall time against the clean run's. A
markdown table on stdout (and ``--out``)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

TINY = [
    "compare=false",
    "model.d_model=32",
    "model.num_layers=1",
    "model.num_heads=1",
    "model.max_seq_len=32",
    "data.seq_len=16",
    "train.batch_size=8",
    "train.eval_batches=1",
    "train.warmup_steps=2",
    "train.progress=false",
    "train.num_seeds=1",
    "train.throughput_rounds=0",
    "train.kernel_check=off",
    "train.quick_eval=false",
    "train.tensorboard=false",
    "train.eval_every=2",
    "train.checkpoint_every=2",
    "run.sync_every_s=0.5",
]

# (row, proxy kind, rate, stall s, down for s, budget s)
FAULTS = [
    ("503 answers", "503", 0.2, 0.0, None, None),
    ("429 answers", "429", 0.2, 0.0, None, None),
    ("connection resets", "reset", 0.2, 0.0, None, None),
    ("every request stalled 2 s", "stall", 1.0, 2.0, None, None),
    ("server gone for 20 s at the start", None, 0.0, 0.0, 20.0, None),
    ("server gone, budget 10 s", "down", 1.0, 0.0, None, 10),
]


def env_for(host: str, tmp: str, budget: float | None) -> dict[str, str]:
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", tmp), "TMPDIR": tmp}
    env["STORAGE_EMULATOR_HOST"] = host
    if budget is not None:
        env["DIFFJAX_STORAGE_TIMEOUT_S"] = str(budget)
    return env


def train(bucket: str, name: str, host: str, tmp: str, budget=None) -> tuple[int, str, float]:
    """4 steps, then resumed to 6: (exit status, stderr's last line, seconds)."""
    args = [sys.executable, "train.py", f"run.dir={bucket}/{name}", *TINY]
    args += ["data.source=tokens", f"data.path={bucket}/prep"]
    t0 = time.monotonic()
    for steps, extra in (("4", []), ("6", ["--resume"])):
        out = subprocess.run(
            [*args, f"train.steps={steps}", *extra],
            env=env_for(host, tmp, budget),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if out.returncode != 0:
            last = (out.stderr.strip().splitlines() or [""])[-1]
            return out.returncode, last, time.monotonic() - t0
    return 0, "", time.monotonic() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args()

    from fault_proxy import FaultProxy
    from gcs_emulator import GcsEmulator

    from diffjax import storage
    from diffjax.train.metrics import read_metrics

    def losses(bucket, name):
        return [r["loss"] for r in read_metrics(f"{bucket}/{name}/diff/seed_0/metrics.jsonl")]

    with GcsEmulator() as server, tempfile.TemporaryDirectory() as tmp:
        bucket = server.new_bucket()
        corpus = os.path.join(tmp, "corpus")
        os.makedirs(corpus)
        for i in range(6):
            with open(os.path.join(corpus, f"d{i}.txt"), "w") as f:
                f.write("".join(f"def f{i}_{j}(x):\n    return x * {i + j}\n" for j in range(150)))
        subprocess.run(
            [sys.executable, "-m", "diffjax.data.prepare", corpus, "prepare.tokenizer=byte"]
            + [f"prepare.out={bucket}/prep", "prepare.val_fraction=0.2", "prepare.progress=false"],
            env=env_for(server.url, tmp, None),
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        with FaultProxy(server.url) as proxy:
            rc, _, clean_s = train(bucket, "clean", proxy.url, tmp)
            assert rc == 0, "the clean run failed"
        clean = losses(bucket, "clean")
        rows = [("none (clean run)", "", f"completed, {len(clean)} steps", f"{clean_s:.0f} s", "")]
        for i, (what, kind, rate, stall, down_s, budget) in enumerate(FAULTS):
            with FaultProxy(server.url, seed=i) as proxy:
                if down_s is not None:
                    proxy.down_for(down_s)
                else:
                    proxy.set(kind, rate=rate, stall_s=stall)
                name = f"fault{i}"
                rc, last, took = train(bucket, name, proxy.url, tmp, budget)
                injected = proxy.injected
            if rc == 0:
                same = losses(bucket, name) == clean
                outcome = "completed, losses equal to the clean run's" if same else "DIFFERENT"
            else:
                outcome = f"exit {rc}: {last[:160]}"
            cost = f"{took:.0f} s ({took - clean_s:+.0f} s)"
            rows.append((what, f"{rate:g}" if down_s is None else "", outcome, cost, injected))
            print(f"{what}: {outcome} in {cost}", file=sys.stderr, flush=True)
    lines = [
        "| fault | share of requests | outcome | wall time (against the clean run) "
        "| faults injected |",
        "|---|---:|---|---:|---:|",
        *(f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        storage.write_text(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
