"""Input-pipeline tokens/s from a bucket and from local disk, beside the default train step's.

    python benchmarks/data_speed.py                       # starts a GCS emulator on 127.0.0.1
    python benchmarks/data_speed.py --bucket gs://my-bucket/bench   # a real bucket (credentials)
    python benchmarks/data_speed.py --prefetch 0 1 2 8 --latency-ms 0 30 --markdown out.md

Prepares the stdlib corpus (byte tokenizer, ``python -m diffjax.data.prepare``) into a local
folder and into the bucket, then times, for each prefetch depth (``data.prefetch``: batches read
ahead by the pipeline's threads), the ``tokens`` source's training batches of the default shapes
(``data.seq_len`` 256, ``train.batch_size`` 16) from each copy: ``make_dataset`` iterated for
``--batches`` batches after the first. ``--latency-ms`` (with the emulator) adds that many
milliseconds to every request to the bucket: the client reaches the emulator through a TCP
relay on 127.0.0.1 that holds each request that long before passing it on. The emulator answers
in about a millisecond, a cloud bucket in tens, and the depth that hides the difference is what
the default must cover.

Beside them: the default model's train step (``train.py compare.twins=``, the default config,
trained from the same prepared corpus, local and in the bucket) in tokens/s, the median of
``metrics.jsonl``'s ``tokens_per_s`` after the first steps, and how long the loop waited for
each batch (``metrics.jsonl``'s ``data_wait``). Reading never stalls the step when the
pipeline's rate is well above the step's (the goal: 3x) and the wait is a negligible part of
the step from either copy.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.parse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stdlib_texts(folder: str, max_files: int) -> str:
    """The first ``max_files`` stdlib ``.py`` files copied as ``.txt`` inputs into ``folder``."""
    import shutil

    from diffjax.data.sources import stdlib_files

    os.makedirs(folder)
    for i, p in enumerate(stdlib_files(max_files=max_files)):
        if os.path.getsize(p):  # prepare refuses an empty input (a bare __init__.py)
            shutil.copyfile(p, os.path.join(folder, f"{i:05d}.txt"))
    return folder


def prepare_corpus(inputs: str, out: str) -> None:
    from diffjax.data import prepare as prep

    options = prep.PrepareOptions(
        inputs=(inputs,), tokenizer="byte", out=out, workers=1, progress=False
    )
    prep.prepare(options)


class LatencyRelay:
    """A TCP relay on 127.0.0.1 to ``url``'s host and port that holds what the client sends for
    ``delay`` seconds before passing it on (the answers come back at once): each request to the
    bucket then takes that much longer, as from a farther bucket. ``delay`` may change at any
    time; :attr:`url` is the address to give the client."""

    def __init__(self, url: str):
        target = urllib.parse.urlsplit(url)
        self.target = (target.hostname, target.port)
        self.delay = 0.0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(self.target)
            for s in (client, upstream):  # no Nagle wait on small requests and answers
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for src, dst, held in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pipe, args=(src, dst, held), daemon=True).start()

    def _pipe(self, src, dst, held: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if held and self.delay:
                    time.sleep(self.delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.server.close()


def pipeline_rate(path: str, prefetch: int, batches: int) -> tuple[float, float]:
    """(tokens/s over ``batches`` batches after the first, seconds to the first batch)."""
    from diffjax.data import DataConfig, make_dataset

    config = DataConfig(source="tokens", path=path, prefetch=prefetch)
    t0 = time.perf_counter()
    it = iter(make_dataset(config, "train", batch_size=16))
    first = next(it)
    t1 = time.perf_counter()
    for _ in range(batches):
        next(it)
    seconds = time.perf_counter() - t1
    return batches * first["inputs"].size / seconds, t1 - t0


def step_rate(path: str, steps: int, run_dir: str) -> tuple[float, float, float]:
    """The default model's train step: (tokens/s, median and largest wait for a batch in ms),
    over the steps after the 5th."""
    from diffjax.infra import storage
    from diffjax.compare.cli import main
    from diffjax.train.metrics import read_metrics

    args = [
        f"run.dir={run_dir}",
        "compare.twins=",
        "data.source=tokens",
        f"data.path={path}",
        f"train.steps={steps}",
        "train.eval_every=1000000",
        "train.checkpoint_every=1000000",
        "compare.quick_eval=false",
        "train.progress=false",
        "train.tensorboard=false",
        "compare.throughput_rounds=0",
        "compare.seeds=1",
    ]
    with contextlib.redirect_stdout(sys.stderr):
        rc = main(args)
    if rc != 0:
        raise SystemExit(f"train.py {' '.join(args)} exited with {rc}")
    records = read_metrics(storage.join(run_dir, "diff", "seed_0", "metrics.jsonl"))
    rates = [r["tokens_per_s"] for r in records[5:] if r.get("tokens_per_s")]
    late = [r["data_wait"] for r in records[5:]]
    return statistics.median(rates), 1e3 * statistics.median(late), 1e3 * max(late)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bucket", help="a gs:// prefix to use (default: a GCS emulator)")
    p.add_argument("--prefetch", type=int, nargs="+", default=[0, 1, 2, 8])
    p.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 30.0])
    p.add_argument("--batches", type=int, default=200, help="batches timed per measurement")
    p.add_argument("--steps", type=int, default=25, help="train steps per step measurement")
    p.add_argument("--rounds", type=int, default=2, help="step measurements of each copy")
    p.add_argument("--max-files", type=int, default=400, help="stdlib files in the corpus")
    p.add_argument("--markdown", help="also write the table here")
    a = p.parse_args(argv)

    with contextlib.ExitStack() as stack:
        if a.bucket is None:
            sys.path.insert(0, os.path.join(ROOT, "tests"))
            from gcs_emulator import GcsEmulator

            server = stack.enter_context(GcsEmulator())
            remote = f"{server.new_bucket()}/bench"
            where = "fake-gcs-server on 127.0.0.1"
            relay = LatencyRelay(server.url)  # every client request goes through it
            stack.callback(relay.close)
            for var in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL"):
                os.environ[var] = relay.url
        else:
            if any(a.latency_ms):
                p.error("--latency-ms needs the emulator (a real bucket has its own latency)")
            remote, where, relay = a.bucket.rstrip("/"), a.bucket, None
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        local = os.path.join(tmp, "prepared")
        print(f"preparing {a.max_files} stdlib files locally and into {remote} ...", flush=True)
        texts = stdlib_texts(os.path.join(tmp, "texts"), a.max_files)
        t = time.perf_counter()
        prepare_corpus(texts, local)
        t_local = time.perf_counter() - t
        t = time.perf_counter()
        prepare_corpus(texts, f"{remote}/prepared")
        t_remote = time.perf_counter() - t

        rows = []
        for prefetch in a.prefetch:
            rate, first = pipeline_rate(local, prefetch, a.batches)
            rows.append(("local disk", "-", prefetch, rate, first))
            print(rows[-1], flush=True)
            for ms in a.latency_ms if relay else [0.0]:
                if relay:
                    relay.delay = ms / 1000
                rate, first = pipeline_rate(f"{remote}/prepared", prefetch, a.batches)
                if relay:
                    relay.delay = 0.0
                rows.append(("bucket", f"+{ms:g} ms" if ms else "0", prefetch, rate, first))
                print(rows[-1], flush=True)
        step_local, step_remote = [], []
        for r in range(a.rounds):  # alternated, so a busy machine slows both alike
            step_local.append(step_rate(local, a.steps, os.path.join(tmp, f"run-local-{r}")))
            remote_run = os.path.join(tmp, f"run-bucket-{r}")
            step_remote.append(step_rate(f"{remote}/prepared", a.steps, remote_run))
            print("step (tokens/s, wait ms): local", step_local[-1], "bucket", step_remote[-1])

    import jax

    step = max(r[0] for r in step_local)  # "x the step": against the fastest step measured

    lines = [
        f"Input pipeline vs the default train step ({datetime.date.today()}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"jax {jax.__version__}; bucket: {where})",
        "",
        f"Prepared in {t_local:.1f} s locally, {t_remote:.1f} s into the bucket. Batches of "
        f"16 x 256 tokens; {a.batches} batches timed after the first.",
        "",
        "| data | added latency | data.prefetch | pipeline tokens/s | first batch s | x the step |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for src, ms, prefetch, rate, first in rows:
        lines.append(
            f"| {src} | {ms} | {prefetch} | {rate:,.0f} | {first:.2f} | {rate / step:,.1f} |"
        )
    lines += [
        "",
        f"The default train step ({a.steps} steps a run, {a.rounds} runs of each, alternated; "
        f"medians over the steps after the 5th; the wait: `data_wait` in `metrics.jsonl`):",
        "",
        "| data from | run | step tokens/s | wait for a batch, median ms | largest ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, runs in (("local disk", step_local), ("the bucket", step_remote)):
        for r, (rate, wait, worst) in enumerate(runs):
            lines.append(f"| {name} | {r + 1} | {rate:,.0f} | {wait:.2f} | {worst:.1f} |")
    text = "\n".join(lines)
    print(text)
    if a.markdown:
        with open(a.markdown, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
