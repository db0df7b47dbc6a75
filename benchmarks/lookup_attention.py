"""Where the first query of a needle or MQAR run looks: per model, layer, head and map, the
share of the answer-producing row's attention on each kind of position.

    python benchmarks/lookup_attention.py runs/needle [--examples 128] [--step best]

The first query is the one only the needles (pairs) can answer (later queries can copy an
earlier one: :func:`diffjax.data.query_kinds`). Its answer-producing row is the query's key
token. A model that looks the answer up with an induction head (a previous-token head in layer
0 that writes the key into the value's position, then a layer-1 head that matches it) puts most
of one layer-1 head's mass on the asked value. Columns, as signed shares of the row's absolute
mass (a softmax row's is 1; DIFF's differential map ``A1 - lambda A2`` is shown beside its two
softmax maps):

- ``answer``: the asked needle's (pair's) value, the token the model must output;
- ``key``: the asked needle's key, right before the value;
- ``after``: the position right after the value;
- ``other values``: the other needles' (pairs') values;
- ``digits in text``: (needle task) other digits of the haystack text;
- ``BOS``, ``self`` (the row's own position) and ``other context`` (everything else before the
  queries).

Attention shares are not the lookup's whole story: the values the weights multiply differ in
size, and DIFF normalises each head's output (its per-head RMSNorm), so a small weight can carry
the answer. The causal check beside them: swap the asked needle's (pair's) value in the context
for a value no needle (pair) of the example has, and count how often the first query's answer
follows the new value ("follows the swap") or keeps the old one (it cannot see the old one any
more, so that is a guess).

Reads ``RUN_DIR/config.json`` and every model's checkpoint (like ``python -m diffjax.evaluate``).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from diffjax.evaluate import (
    discover_models,
    layer_attention_maps,
    losses_and_predictions,  # noqa: E402
    query_correct,
    validation_examples,
)
from diffjax.evaluate.run import data_config, read_run_config  # noqa: E402
from diffjax.train import load_model  # noqa: E402

COLUMNS = (
    "answer",
    "key",
    "after",
    "other values",
    "digits in text",
    "BOS",
    "self",
    "other context",
)


def first_query_masks(batch: dict) -> tuple[np.ndarray, np.ndarray]:
    """``(rows [B], masks [C, B, T] bool)``: the first query's answer-producing position and,
    per column of :data:`COLUMNS`, the key positions in it (disjoint; the queries themselves,
    after ``self``, are in none). Pure numpy on a needle or MQAR batch."""
    inputs = np.asarray(batch["inputs"])
    b, t = inputs.shape
    rows = np.asarray(batch["answer_spans"])[:, 0, 0]
    if "needle_value_spans" in batch:
        values = np.asarray(batch["needle_value_spans"])[..., 0]  # [B, N] first value token
        asked = np.asarray(batch["query_needle"])[:, 0]
        q0 = np.asarray(batch["query_spans"])[:, 0, 0]
    else:
        values = np.asarray(batch["pair_spans"])[..., 0] + 1
        asked = np.asarray(batch["query_pair"])[:, 0]
        q0 = np.asarray(batch["pair_spans"])[:, -1, 1]
    pos = np.arange(t)[None]
    j = values[np.arange(b), asked][:, None]
    context = (pos > 0) & (pos < q0[:, None])
    out = {
        "answer": pos == j,
        "key": pos == j - 1,
        "after": (pos == j + 1) & context,
        "other values": np.zeros((b, t), bool),
        "BOS": pos == 0,
        "self": pos == rows[:, None],
    }
    for n in range(values.shape[1]):
        out["other values"] |= (pos == values[:, n : n + 1]) & (values[:, n : n + 1] != j)
    taken = np.zeros((b, t), bool)
    for m in out.values():
        taken |= m
    is_digit = (inputs >= ord("0")) & (inputs <= ord("9")) & ("needle_value_spans" in batch)
    out["digits in text"] = is_digit & context & ~taken
    out["other context"] = context & ~taken & ~out["digits in text"]
    return rows, np.stack([np.broadcast_to(out[c], (b, t)) for c in COLUMNS])


def swap_asked_value(batch: dict, num_values: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs, new)``: the batch's inputs with the first query's needle (pair) value replaced,
    in the context only, by a value that no needle (pair) of the example has, and the new values
    ``[B, V]``. Needle values are ``V`` decimal digits (no leading zero); MQAR values are the
    token ids ``128 .. 127 + num_values``. Pure numpy."""
    inputs = np.array(batch["inputs"])
    rng = np.random.default_rng(seed)
    b = inputs.shape[0]
    if "needle_value_spans" in batch:
        spans = np.asarray(batch["needle_value_spans"])
        asked = np.asarray(batch["query_needle"])[:, 0]
        width = int(spans[0, 0, 1] - spans[0, 0, 0])
    else:
        starts = np.asarray(batch["pair_spans"])[..., 0] + 1
        spans = np.stack([starts, starts + 1], -1)
        asked = np.asarray(batch["query_pair"])[:, 0]
        width = 1
    new = np.zeros((b, width), inputs.dtype)
    for i in range(b):
        used = {inputs[i, s:e].tobytes() for s, e in spans[i]}
        while True:
            if "needle_value_spans" in batch:
                v = np.concatenate([rng.integers(1, 10, 1), rng.integers(0, 10, width - 1)])
                v = (v + ord("0")).astype(inputs.dtype)
            else:
                v = np.array([128 + rng.integers(0, num_values)], inputs.dtype)
            if v.tobytes() not in used:
                break
        s, e = spans[i, asked[i]]
        inputs[i, s:e] = v
        new[i] = v
    return inputs, new


def row_shares(maps: np.ndarray, rows: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """``[H, C]``: for maps ``[B, H, T, S]``, rows ``[B]`` and masks ``[C, B, S]``, each head's
    weight on each column as a signed share of the row's absolute mass, averaged over B."""
    b = maps.shape[0]
    w = maps[np.arange(b), :, rows]  # [B, H, S]
    mass = np.abs(w).sum(-1, keepdims=True)
    shares = np.einsum("bhs,cbs->bhc", w / np.where(mass > 0, mass, 1.0), masks.astype(w.dtype))
    return shares.mean(0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--examples", type=int, default=128, help="validation examples (default 128)")
    p.add_argument("--step", default="best", help="checkpoint: best, latest or a step number")
    args = p.parse_args(argv)
    data = data_config(read_run_config(args.run_dir))
    if data.source not in ("needle", "mqar"):
        print(
            f"{args.run_dir} trained on data.source={data.source!r}: this probe is for the "
            f"needle and MQAR tasks",
            file=sys.stderr,
        )
        return 2
    val = validation_examples(data, args.examples)
    rows, masks = first_query_masks(val)
    print(
        f"{len(rows)} validation examples; the first query's row; signed shares of the row's "
        f"absolute mass\n"
    )
    swapped = dict(val)
    swapped["inputs"], new = swap_asked_value(val, data.mqar.num_values)
    first = np.asarray(val["answer_spans"])[:, 0]
    old = np.stack([np.asarray(val["targets"])[i, s:e] for i, (s, e) in enumerate(first)])
    table = []
    for entry in discover_models(args.run_dir):
        model = load_model(entry.path, args.step)
        _, preds = losses_and_predictions(model, val)
        acc = float(query_correct(preds, val)[:, 0].mean())
        _, preds = losses_and_predictions(model, swapped)
        answer = np.stack([preds[i, s:e] for i, (s, e) in enumerate(first)])
        follows = float(np.all(answer == new, -1).mean())
        keeps = float(np.all(answer == old, -1).mean())
        print(
            f"{entry.label} seed {entry.seed}: first query {acc:.3f}; with the asked value "
            f"swapped in the context it follows the swap {follows:.3f}, keeps the old value "
            f"{keeps:.3f}"
        )
        table.append((entry, acc, model))
    print(
        "\n| model | seed | first-query accuracy | layer | map | head | "
        + " | ".join(COLUMNS)
        + " |"
    )
    print("|---|---:|---:|---:|---|---:|" + "---:|" * len(COLUMNS))
    for entry, acc, model in table:
        for layer in range(len(model.layers)):
            maps = layer_attention_maps(model, val["inputs"], layer)
            for name in ("diff", "a1", "a2") if "diff" in maps else ("a",):
                for h, row in enumerate(row_shares(maps[name], rows, masks)):
                    print(
                        f"| {entry.label} | {entry.seed} | {acc:.3f} | {layer} | {name} | {h} | "
                        + " | ".join(f"{x:+.2f}" for x in row)
                        + " |"
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
