"""Tokens per second of ``python -m diffjax.data.prepare`` against a plain ``tokenizers`` loop.

    python benchmarks/prepare_speed.py [--mb 30] [--files 4] [--vocab 8192] [--workers 1 2]

Builds a synthetic ``.jsonl`` corpus (Zipf-distributed made-up words, one document a line) and a
byte-level BPE ``tokenizer.json`` trained on it with ``tokenizers`` (nothing is downloaded), then
times ``prepare`` (tokenize, split, write shards) with each worker count and a single-process
loop that reads the same files and calls ``Tokenizer.encode_batch`` (no splitting, no writing).
``CPU s``: the CPU time spent (this process and the workers), which the wall time exceeds on a
machine busy with other work. ``prepare`` counts each document's BOS/EOS ids too.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time

import numpy as np

from diffjax.data import prepare as prep


def make_words(rng: np.random.Generator, n: int) -> list[str]:
    """``n`` distinct made-up lowercase words of 2-9 letters."""
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    words: set[str] = set()
    while len(words) < n:
        size = int(rng.integers(2, 10))
        words.add("".join(letters[rng.zipf(1.5, size) % 26]))
    return sorted(words)


def make_corpus(folder: str, megabytes: float, files: int, seed: int = 0) -> list[str]:
    """``files`` jsonl files of about ``megabytes`` MB in all; returns their paths."""
    rng = np.random.default_rng(seed)
    words = np.array(make_words(rng, 20_000))
    per_file = int(megabytes * 1e6 / files)
    paths = []
    for f in range(files):
        path = os.path.join(folder, f"part_{f:03d}.jsonl")
        written = 0
        with open(path, "w") as fh:
            while written < per_file:
                n = int(rng.integers(50, 800))
                ids = np.minimum(rng.zipf(1.2, n) - 1, len(words) - 1)
                line = json.dumps({"text": " ".join(words[ids]) + "."}) + "\n"
                fh.write(line)
                written += len(line)
        paths.append(path)
    return paths


def train_tokenizer(paths: list[str], vocab: int, out: str) -> str:
    """A byte-level BPE tokenizer.json trained on the first MB of each file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def sample():
        for path in paths:
            with open(path) as fh:
                yield json.loads(fh.readline())["text"]
                for line in fh.readlines(1_000_000):
                    yield json.loads(line)["text"]

    tok.train_from_iterator(sample(), trainer)
    path = os.path.join(out, "tokenizer.json")
    tok.save(path)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as fh:
        json.dump({"bos_token": "<s>", "eos_token": "</s>"}, fh)
    return path


def plain_loop(paths: list[str], tokenizer: str, batch: int = 1000) -> tuple[int, float]:
    """(tokens, seconds) of reading the files and ``encode_batch`` over their texts, one
    process."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    t0, tokens = time.perf_counter(), 0
    for path in paths:
        with open(path) as fh:
            texts = []
            for line in fh:
                texts.append(json.loads(line)["text"])
                if len(texts) == batch:
                    tokens += sum(len(e.ids) for e in tok.encode_batch(texts))
                    texts = []
            if texts:
                tokens += sum(len(e.ids) for e in tok.encode_batch(texts))
    return tokens, time.perf_counter() - t0


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its finished children (the workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=30.0, help="corpus size (MB of jsonl)")
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--workers", type=int, nargs="+", default=[2, 1])
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        paths = make_corpus(tmp, a.mb, a.files)
        size = sum(os.path.getsize(x) for x in paths)
        print(f"corpus: {len(paths)} jsonl files, {size / 1e6:.1f} MB "
              f"({time.perf_counter() - t0:.1f} s to write)")  # fmt: skip
        t0 = time.perf_counter()
        tokenizer = train_tokenizer(paths, a.vocab, tmp)
        print(f"tokenizer: BPE, vocab {a.vocab} ({time.perf_counter() - t0:.1f} s to train)")
        print(f"machine: {os.cpu_count()} CPUs (os.cpu_count)")
        rows = []
        for workers in a.workers:  # many workers first: forking after tokenizers' threads ran
            out = os.path.join(tmp, f"out_{workers}")  # makes tokenizers warn
            cpu = cpu_seconds()
            r = prep.prepare(
                prep.PrepareOptions(
                    inputs=tuple(paths),
                    tokenizer=tokenizer,
                    out=out,
                    workers=workers,
                    progress=False,
                )
            )
            total = sum(t["tokens"] for t in r.manifest["totals"].values())
            rows.append((f"prepare, {workers} worker{'s' if workers > 1 else ''}", total,
                         r.seconds, cpu_seconds() - cpu))  # fmt: skip
        cpu = cpu_seconds()
        tokens, seconds = plain_loop(paths, tokenizer)
        rows.append(("plain tokenizers encode_batch loop, 1 process", tokens, seconds,
                     cpu_seconds() - cpu))  # fmt: skip
        print(f"load average: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
        head = f"{'tokens':>12} {'seconds':>8} {'CPU s':>7} {'tokens/s':>12} {'MB/s':>6}"
        print(f"{'':48} {head}")
        for name, n, s, c in rows:
            print(f"{name:48} {n:>12,} {s:>8.2f} {c:>7.1f} {n / s:>12,.0f} {size / 1e6 / s:>6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
