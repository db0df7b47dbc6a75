"""docs/scaling.md's table of the paper-size configs on TPU slices and a GPU node, from
``python -m diffjax.plan``'s compiles (run with the ``compile`` extra's python).

For each config (830M, 1.4B, 3B), target (v5e-8, h100-8, v5p-8) and model (DIFF, twin), at
4096-token sequences, mesh fsdp over every device:

1. the per-device memory of the compiled train step with one sequence per device, for
   ``model.remat`` none, full and dots;
2. the largest global batch that fits with remat full (``largest_batch``): compiled at 1 and
   4 sequences per device, then at the batch where the line through the nearest batch that
   fits and the nearest that does not meets the HBM size, until a batch that fits and one
   more sequence per device that does not are both compiled.

Every compile is appended to ``--out`` (JSON lines) as it finishes, so a run that is stopped
keeps what it did and a rerun skips it (a record made for another memory budget is compiled
again); ``--render`` prints the markdown table of what is there. The records behind
docs/scaling.md's table are benchmarks/plan_table.jsonl (the default ``--out``; a test checks
that the table is their rendering): to remake them, start from an empty file.

    $DIFFJAX_COMPILE_PYTHON benchmarks/plan_table.py --out /tmp/plan_table.jsonl
    python benchmarks/plan_table.py --out /tmp/plan_table.jsonl --render
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {"830M": "diff_830m.py", "1.4B": "diff_1_4b.py", "3B": "diff_3b.py"}
TARGETS = ("v5e-8", "h100-8", "v5p-8")
LABELS = ("diff", "standard")
SEQ = 4096
GIB = 1024**3


def _key(size, target, label, remat, batch):
    return f"{size}|{target}|{label}|{remat}|{batch}"


def _load(path):
    done = {}
    if os.path.exists(path):
        for line in open(path):
            if line.strip():
                r = json.loads(line)
                if r.get("accum", 1) != 1:  # the table's cells are without accumulation
                    continue
                done[_key(r["size"], r["target"], r["label"], r["remat"], r["batch"])] = r
    return done


def run(out: str, sizes, targets, labels, steps) -> None:
    import jax

    from diffjax import plan

    plan.compile_only_env()
    from diffjax.compare import load_comparison
    from diffjax.train.config import apply_overrides

    done = _load(out)
    for size in sizes:
        for tname in targets:
            target = plan.TARGETS[tname]
            devices = plan.target_devices(target)
            hbm = target.budget_gib() * GIB  # on a GPU: the part JAX's allocator takes
            for label in labels:
                exp = apply_overrides(
                    load_comparison(os.path.join(ROOT, "configs", CONFIGS[size])),
                    [f"data.seq_len={SEQ}", "mesh.fsdp=-1"],
                )
                cfg = exp.models[label]
                n = target.devices

                def measure(remat, batch):
                    k = _key(size, tname, label, remat, batch)
                    if k in done and done[k]["hbm_bytes"] == hbm:
                        return done[k]
                    e = dataclasses.replace(
                        exp.experiment(),
                        model=cfg.replace(remat=remat),
                        train=dataclasses.replace(exp.train, batch_size=batch, grad_accum_steps=1),
                    )
                    t0 = time.time()
                    try:
                        m = plan.compile_train_step(e, e.model, devices, target)
                        rec = dict(dataclasses.asdict(m), fits=m.fits(hbm))
                    except Exception as exc:  # noqa: BLE001  (recorded, the table says so)
                        rec = dict(error=f"{type(exc).__name__}: {str(exc)[:300]}", fits=False)
                    rec.update(
                        size=size,
                        target=tname,
                        label=label,
                        remat=remat,
                        batch=batch,
                        hbm_bytes=hbm,
                        seconds=round(time.time() - t0, 1),
                        jax=jax.__version__,
                    )
                    with open(out, "a") as f:
                        f.write(json.dumps(rec) + "\n")
                    done[k] = rec
                    print(
                        f"{size} {tname} {label} remat={remat} batch={batch}: "
                        f"{rec.get('total_bytes', -1) / GIB:.2f} GiB fits={rec['fits']} "
                        f"({rec['seconds']} s)",
                        flush=True,
                    )
                    return rec

                if "full1" in steps:  # remat full, one sequence per device
                    measure("full", n)
                if "mem" in steps:
                    for remat in ("full", "none"):
                        measure(remat, n)
                if "batch" in steps:
                    largest_batch(lambda b: measure("full", b), n, hbm)
                if "dots" in steps:
                    measure("dots", n)


def largest_batch(measure, n: int, hbm: float) -> int | None:
    """The largest multiple of ``n`` (sequences per device times devices) whose compiled step
    fits, from ``measure(batch) -> record`` (``fits``, ``total_bytes``).

    Starts from n and 4n, extrapolates the line through the two largest fitting batches until
    one fails, then interpolates between the largest that fits and the smallest that fails
    (false position with the Illinois rule: the end that stays twice running counts half as
    far from the HBM size, so a curved memory profile does not stall the search; bisection
    where a record has no byte count). Stops when a fitting batch and that batch plus ``n``
    (not fitting) are both compiled. None when n does not fit."""
    recs = {n: measure(n)}
    if not recs[n]["fits"]:
        return None
    recs[4 * n] = measure(4 * n)
    excess = lambda b: recs[b].get("total_bytes", -1) - hbm  # noqa: E731
    weight = {True: 1.0, False: 1.0}  # the Illinois weights of the fitting and failing end
    last = None
    while True:
        fit = sorted(b for b, r in recs.items() if r["fits"])
        lo = fit[-1]
        above = [b for b, r in recs.items() if not r["fits"] and b > lo]
        hi = min(above) if above else None
        if hi is not None and hi - lo <= n:
            return lo
        b0, b1 = (fit[-2], lo) if hi is None else (lo, hi)
        m0, m1 = excess(b0), excess(b1)
        if hi is not None:
            m0, m1 = m0 * weight[True], m1 * weight[False]
        known = recs[b0].get("total_bytes", -1) > 0 and recs[b1].get("total_bytes", -1) > 0
        if known and m1 > m0:
            guess = int(b0 + (0 - m0) * (b1 - b0) / (m1 - m0)) // n * n
        else:
            guess = (lo + hi) // 2 // n * n if hi is not None else 2 * lo
        guess = max(guess, lo + n)
        if hi is not None:
            guess = min(guess, hi - n)
        recs[guess] = measure(guess)
        side = recs[guess]["fits"]
        if hi is not None:  # the other end stayed: halve its weight, if it stayed before too
            weight[not side] = weight[not side] / 2 if last == side else 1.0
            weight[side] = 1.0
        last = side


def _gib(r):
    if r is None:
        return "not run"
    if "error" in r:
        return "error"
    if r.get("compiler_oom"):
        return f"> HBM ({r['total_bytes'] / GIB:.1f})" if r["total_bytes"] > 0 else "> HBM"
    return f"{r['total_bytes'] / GIB:.1f}"


def render(out: str) -> str:
    from diffjax import plan

    done = _load(out)
    lines = [
        "| model | target | HBM | params + Adam / device | remat none | remat dots | remat full "
        "| largest batch (remat full) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size in CONFIGS:
        for tname in TARGETS:
            for label in LABELS:
                recs = {
                    (r["remat"], r["batch"]): r
                    for r in done.values()
                    if (r["size"], r["target"], r["label"]) == (size, tname, label)
                }
                if not recs:
                    continue
                n = 4 if tname == "v5p-8" else 8
                hbm = next(iter(recs.values()))["hbm_bytes"] / GIB
                whole = plan.TARGETS[tname].hbm_gib
                hbm_cell = f"{whole:g} GiB" + (f" ({hbm:g} for JAX)" if hbm != whole else "")
                state = next(
                    (r for r in recs.values() if "params_bytes" in r),
                    None,
                )
                st = (
                    "?"
                    if state is None
                    else f"{(state['params_bytes'] + state['opt_bytes']) / GIB:.2f}"
                )
                fits_full = [b for (rm, b), r in recs.items() if rm == "full" and r["fits"]]
                fails_full = [b for (rm, b), r in recs.items() if rm == "full" and not r["fits"]]
                if (("full", 4 * n) not in recs) and fits_full:
                    largest = "not searched"
                elif fits_full:
                    best = max(fits_full)
                    above = [b for b in fails_full if b > best]
                    largest = f"{best}" + (
                        f" ({min(above)} does not fit)" if above else " (larger not compiled)"
                    )
                else:
                    largest = "none fits" if fails_full else "not run"
                name = f"{size} {'DIFF' if label == 'diff' else 'twin'}"
                lines.append(
                    f"| {name} | {tname} | {hbm_cell} | {st} GiB | {_gib(recs.get(('none', n)))} | "
                    f"{_gib(recs.get(('dots', n)))} | {_gib(recs.get(('full', n)))} | {largest} |"
                )
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "plan_table.jsonl"))
    p.add_argument("--render", action="store_true", help="print the table of what --out holds")
    p.add_argument("--sizes", default=",".join(CONFIGS))
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--labels", default=",".join(LABELS))
    p.add_argument(
        "--steps",
        default="mem,batch,dots",
        help="full1 (remat full), mem (full and none), batch, dots: one sequence per device "
        "except batch",
    )
    a = p.parse_args(argv)
    sys.path.insert(0, ROOT)
    if a.render:
        print(render(a.out))
        return 0
    run(a.out, a.sizes.split(","), a.targets.split(","), a.labels.split(","), a.steps.split(","))
    return 0


if __name__ == "__main__":
    sys.exit(main())
