"""Convert a training run's checkpoints between the two parameter layouts (``model.scan_layers``).

    python -m diffjax.train.convert runs/default/diff/seed_0 runs/scanned/diff/seed_0

Every committed checkpoint of the source run (parameters, both Adam moments, the data
iterator's position, the recorded validation loss) is written to the destination run with its
blocks stacked on a leading layer axis (unrolled source) or split into one entry per layer
(scanned source), and ``model.scan_layers`` flipped in the metadata; ``metrics.jsonl`` is copied
beside it. The source is only read, and a destination that already holds checkpoints is refused:
nothing saved is changed. Resuming the destination with the other ``model.scan_layers`` gives
the losses the source run would have given (the two layouts compute the same function).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

import numpy as np
import orbax.checkpoint as ocp

from diffjax.infra import storage
from diffjax.config import ModelConfig

from diffjax.train.checkpoint import Checkpointer, CheckpointError, committed_steps


def _convert_tree(tree: Any, stack: bool) -> Any:
    """``tree`` (nested dicts and lists of arrays, as Orbax restores them without a target) with
    every ``"layers"`` entry converted: ``{"0": block, "1": block, ...}`` stacked into one block
    of ``[L, ...]`` arrays (``stack``), or the reverse."""
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            if key == "layers" and stack:
                per_layer = [value[k] for k in sorted(value, key=int)]
                out[key] = _stack(per_layer)
            elif key == "layers":
                n = _num_layers(value)
                out[key] = {str(i): _slice(value, i) for i in range(n)}
            else:
                out[key] = _convert_tree(value, stack)
        return out
    if isinstance(tree, (list, tuple)):
        return type(tree)(_convert_tree(v, stack) for v in tree)
    return tree


def _stack(trees: list[Any]) -> Any:
    first = trees[0]
    if isinstance(first, dict):
        return {k: _stack([t[k] for t in trees]) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(_stack([t[i] for t in trees]) for i in range(len(first)))
    return np.stack([np.asarray(t) for t in trees])


def _slice(tree: Any, i: int) -> Any:
    if isinstance(tree, dict):
        return {k: _slice(v, i) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_slice(v, i) for v in tree)
    return np.asarray(tree)[i]


def _num_layers(tree: Any) -> int:
    while isinstance(tree, (dict, list, tuple)):
        tree = next(iter(tree.values())) if isinstance(tree, dict) else tree[0]
    return int(np.shape(tree)[0])


def convert_run(src: str, dst: str, *, log: Callable[[str], Any] = print) -> list[int]:
    """Write every committed checkpoint of the model run folder ``src`` (the one holding
    ``checkpoints/``) into ``dst`` in the other parameter layout; returns the steps converted.
    Raises :class:`CheckpointError` naming the problem and the fix, before anything is written."""
    storage.check_access(src, what="the source run folder", write=False)
    storage.check_access(dst, what="the new run folder", write=True)
    src, dst = str(storage.absolute(src)), str(storage.absolute(dst))
    src_ckpt = storage.join(src, "checkpoints")
    steps = committed_steps(src_ckpt)
    if not steps:
        raise CheckpointError(
            f"{src} holds no committed checkpoint (looked in {src_ckpt}). Fix: pass a model's "
            f"run folder, e.g. runs/default/diff/seed_0."
        )
    if committed_steps(storage.join(dst, "checkpoints")):
        raise CheckpointError(
            f"{dst} already holds checkpoints; nothing is overwritten. Fix: pass a new directory."
        )
    source = Checkpointer(src_ckpt, keep=len(steps) + 1, async_save=False)
    target = Checkpointer(storage.join(dst, "checkpoints"), keep=len(steps) + 1, async_save=False)
    try:
        for step in steps:
            out = source.manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(),
                    data=ocp.args.JsonRestore(),
                    meta=ocp.args.JsonRestore(),
                ),
            )
            meta = dict(out["meta"])
            config = ModelConfig(**meta["model"])
            stack = not config.scan_layers
            meta["model"] = config.replace(scan_layers=stack).to_dict()
            metrics = source.manager.metrics(step) or {}
            state = _convert_tree(dict(out["state"]), stack)
            target.save(step, state, out["data"], meta, metrics.get("val_loss"))
            target.wait()
            log(
                f"step {step}: {'unrolled -> scanned' if stack else 'scanned -> unrolled'} "
                f"({config.num_layers} layers)"
            )
    finally:
        source.close()
        target.close()
    metrics_file = storage.join(src, "metrics.jsonl")
    if storage.exists(metrics_file):
        storage.write_bytes(storage.join(dst, "metrics.jsonl"), storage.read_bytes(metrics_file))
    return steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m diffjax.train.convert",
        description="Copy a model run's checkpoints into a new folder in the other parameter "
        "layout (model.scan_layers), optimizer state and data position included.",
    )
    ap.add_argument("src", help="a model's run folder, the one holding checkpoints/")
    ap.add_argument("dst", help="a new folder for the converted run")
    args = ap.parse_args(argv)
    try:
        steps = convert_run(args.src, args.dst)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"converted {len(steps)} checkpoint(s) into {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
