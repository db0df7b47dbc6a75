"""Sharding memory: per-device bytes of a config's train state on a few meshes, from shapes.

    python benchmarks/sharding_memory.py                                  # configs/diff_125m.py, 8 devices
    python benchmarks/sharding_memory.py --config configs/diff_350m.py --devices 16

For the config's DIFF model and its standard twin (``exp.models``) it builds the abstract train
state ``{"step", "params", "opt_state"}`` with ``jax.eval_shape(make_state_init(...))`` (nothing
is allocated), places it by its logical axis names (:mod:`diffjax.infra.sharding`, ``DEFAULT_RULES``)
and prints, per mesh, the bytes one device holds of the parameters and of the optimizer state
(AdamW: mu and nu shaped like the parameters, plus scalar step counts), their total, the
unsharded total and the ratio of the two. The meshes over N devices (N = 8 by default):

  data=N                pure data parallelism: everything replicated (ratio 1)
  fsdp=N                FSDP / ZeRO-3: every weight's model width (embed) split N ways
  fsdp=N/2 x tensor=2   FSDP and 2-way tensor parallelism (heads, MLP units, vocabulary)
  fsdp=N/4 x tensor=4   ... 4-way; refused (and skipped, with the reason) where tensor does not
                        divide the DIFF heads or kv heads: a DIFF pair is never split

The ratio is not exactly 1/N because some parameters are not split over every device: the
norm scales, the DIFF lambda vectors and the per-head sub-layer norm (replicated everywhere),
and a vocabulary that ``tensor`` does not divide. The script lists them with their bytes.

The devices are only counted, never used: ``JAX_NUM_CPU_DEVICES`` is set to N before JAX is
imported, and where JAX already runs with another device count the meshes are abstract
(``jax.sharding.AbstractMesh``: same shapes, same numbers), and the script says so.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from typing import Any

DEFAULT_CONFIG = "configs/diff_125m.py"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1024**2


# ---------------------------------------------------------------------------- devices
def _prepare_devices(devices: int) -> None:
    """Make JAX see ``devices`` CPU devices, if it has not been imported yet. Where it has been
    (a test, a notebook), its device count is left alone: :func:`_build_mesh` then uses an
    abstract mesh if the count differs, and says so."""
    if "jax" not in sys.modules:
        os.environ["JAX_NUM_CPU_DEVICES"] = str(devices)


def _meshes(devices: int) -> list[tuple[str, dict[str, int]]]:
    """(name, sizes) of the meshes the table compares, over ``devices`` devices."""
    out = [
        (f"data={devices}", dict(data=devices, fsdp=1, tensor=1)),
        (f"fsdp={devices}", dict(data=1, fsdp=devices, tensor=1)),
    ]
    for t in (2, 4):
        if devices % t == 0 and devices > t:
            out.append(
                (f"fsdp={devices // t} x tensor={t}", dict(data=1, fsdp=devices // t, tensor=t))
            )
    return out


def _build_mesh(sizes: dict[str, int], devices: int):
    """A real mesh over ``devices`` of JAX's devices when it has exactly that many (the default
    backend's, else the CPU backend's), else an abstract mesh of the same shape."""
    import jax
    from jax.sharding import AbstractMesh, AxisType

    from diffjax.infra import sharding

    config = sharding.MeshConfig(**sizes)
    for backend in (None, "cpu"):
        try:
            devs = jax.devices(backend) if backend else jax.devices()
        except RuntimeError:
            continue
        if len(devs) == devices:
            return sharding.make_mesh(config, devs), None
    have = jax.device_count()
    note = (
        f"note: JAX was imported before this script could set JAX_NUM_CPU_DEVICES={devices} "
        f"and has {have} device{'s' * (have != 1)}, not {devices}; the meshes are abstract "
        f"(jax.sharding.AbstractMesh of the same shapes), which gives the same per-device "
        f"bytes: they depend only on the mesh shape"
    )
    shape = config.shape(devices)
    return AbstractMesh(
        shape, sharding.MESH_AXES, axis_types=(AxisType.Auto,) * len(sharding.MESH_AXES)
    ), note


# ---------------------------------------------------------------------------- the state
def abstract_states(exp) -> dict[str, Any]:
    """``{label: abstract train state}`` of every model of ``exp`` (``jax.eval_shape``)."""
    import jax

    from diffjax.train.setup import make_state_init

    out = {}
    for label, model_cfg in exp.models.items():
        state, _ = jax.eval_shape(make_state_init(model_cfg, exp.train))
        out[label] = state
    return out


def _path_name(path) -> str:
    import jax

    name = jax.tree_util.keystr(path, simple=True, separator=".")
    return re.sub(r"(^|\.)\d+(\.|$)", r"\1*\2", name)


def not_fully_sharded(params, mesh) -> list[dict[str, Any]]:
    """The parameters one device holds more than ``1 / mesh.size`` of, grouped by name (layer
    index as ``*``): ``{"name", "logical", "spec", "leaves", "values", "bytes" (unsharded),
    "device_bytes", "copies"}``; ``copies`` is how many devices hold each element."""
    import math

    import jax
    import numpy as np
    from flax import nnx

    from diffjax.infra import sharding

    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    specs = jax.tree.leaves(sharding.tree_specs(params, mesh), is_leaf=is_var)
    leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=is_var)
    sizes = dict(mesh.shape)
    n = math.prod(sizes.values())
    groups: dict[str, dict[str, Any]] = {}
    for (path, var), spec_var in zip(leaves, specs):
        value = var.get_value()
        spec = spec_var.get_value()
        used = [
            a
            for entry in spec
            if entry is not None
            for a in ((entry,) if isinstance(entry, str) else entry)
        ]
        split = math.prod(sizes[a] for a in used)
        if split == n:
            continue
        size = math.prod(value.shape)
        nbytes = size * np.dtype(value.dtype).itemsize
        name = _path_name(path)
        g = groups.setdefault(
            name,
            {
                "name": name,
                "logical": sharding.logical_axes(var),
                "spec": str(spec),
                "leaves": 0,
                "values": 0,
                "bytes": 0,
                "device_bytes": 0,
                "copies": n // split,
            },
        )
        g["leaves"] += 1
        g["values"] += size
        g["bytes"] += nbytes
        g["device_bytes"] += nbytes // split
    return list(groups.values())


# ---------------------------------------------------------------------------- the report
def report(config_path: str = DEFAULT_CONFIG, devices: int = 8) -> list[dict[str, Any]]:
    """One row per (model, mesh): ``model`` (label), ``attention``, ``mesh`` (name), ``sizes``,
    ``params`` (count), per-device and unsharded bytes of ``params``, ``opt_state`` and their
    ``total`` (``*_bytes`` / ``unsharded_*_bytes``), ``ratio`` (per-device total / unsharded
    total), ``replicated`` (:func:`not_fully_sharded` of the parameters), ``replicated_bytes``
    (unsharded bytes of the parameters no axis splits) and ``skipped`` (the reason
    ``check_model_mesh`` gave, the byte fields then None). ``note``: set when the meshes had to be
    abstract."""
    _prepare_devices(devices)
    note = None
    from diffjax.infra import sharding
    from diffjax.config import ConfigError
    from diffjax.nn.param_count import count_params
    from diffjax.compare import load_comparison

    if not os.path.isfile(config_path) and os.path.isfile(os.path.join(ROOT, config_path)):
        config_path = os.path.join(ROOT, config_path)  # relative to the repository
    exp = load_comparison(config_path)
    states = abstract_states(exp)
    counts = {label: count_params(cfg).total for label, cfg in exp.models.items()}
    rows = []
    for name, sizes in _meshes(devices):
        mesh, mesh_note = _build_mesh(sizes, devices)
        note = note or mesh_note
        for label, model_cfg in exp.models.items():
            state = states[label]
            row: dict[str, Any] = {
                "model": label,
                "attention": model_cfg.attention,
                "mesh": name,
                "sizes": dict(sizes),
                "devices": devices,
                "params": counts[label],
                "param_dtype": model_cfg.param_dtype,
                "skipped": None,
                "note": None,
            }
            p_dev, p_all = sharding.bytes_per_device(state["params"], mesh)
            o_dev, o_all = sharding.bytes_per_device(state["opt_state"], mesh)
            row.update(
                unsharded_params_bytes=p_all,
                unsharded_opt_state_bytes=o_all,
                unsharded_total_bytes=p_all + o_all,
            )
            try:
                sharding.check_model_mesh(model_cfg, mesh)
            except ConfigError as e:
                row.update(
                    skipped=str(e),
                    params_bytes=None,
                    opt_state_bytes=None,
                    total_bytes=None,
                    ratio=None,
                    replicated=[],
                    replicated_bytes=None,
                )
                rows.append(row)
                continue
            replicated = not_fully_sharded(state["params"], mesh)
            row.update(
                params_bytes=p_dev,
                opt_state_bytes=o_dev,
                total_bytes=p_dev + o_dev,
                ratio=(p_dev + o_dev) / (p_all + o_all),
                replicated=replicated,
                replicated_bytes=sum(g["bytes"] for g in replicated if g["copies"] == devices),
            )
            rows.append(row)
    for row in rows:
        row["note"] = note
    return rows


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:,.1f}"


def _human(n: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", MIB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n} B"


HEADER = (
    f"{'model':<9} {'mesh':<20} {'params MiB':>11} {'opt MiB':>10} {'total MiB':>10} "
    f"{'unsharded MiB':>14} {'ratio':>8}  {'ideal':>6}"
)


def format_table(rows: list[dict[str, Any]]) -> str:
    """The table, and per model and mesh the parameters that are not split over every device."""
    lines = [HEADER, "-" * len(HEADER)]
    labels = list(dict.fromkeys(r["model"] for r in rows))
    for label in labels:
        mine = [r for r in rows if r["model"] == label]
        first = mine[0]
        lines.append(
            f"{label:<9} {'none (1 device)':<20} "
            f"{_mib(first['unsharded_params_bytes']):>11} "
            f"{_mib(first['unsharded_opt_state_bytes']):>10} "
            f"{_mib(first['unsharded_total_bytes']):>10} "
            f"{_mib(first['unsharded_total_bytes']):>14} {1:>8.4f}  {'1':>6}"
        )
        for r in mine:
            d = r["devices"]
            ideal = "1" if r["sizes"]["data"] == d else f"1/{d}"
            if r["skipped"]:
                reason = r["skipped"].split(". Fix:")[0]
                lines.append(f"{label:<9} {r['mesh']:<20} skipped: {reason}")
                continue
            lines.append(
                f"{label:<9} {r['mesh']:<20} {_mib(r['params_bytes']):>11} "
                f"{_mib(r['opt_state_bytes']):>10} {_mib(r['total_bytes']):>10} "
                f"{_mib(r['unsharded_total_bytes']):>14} {r['ratio']:>8.4f}  {ideal:>6}"
            )
        lines.append("")
    lines.append(
        "Parameters not split over every device (each has an Adam mu and nu of its size "
        "and sharding: 3x these bytes with the moments):"
    )
    for label in labels:
        # meshes with the same list are printed once
        merged: dict[str, tuple[list[str], dict[str, Any]]] = {}
        for r in rows:
            if r["model"] != label or r["skipped"] or r["sizes"]["data"] == r["devices"]:
                continue
            key = repr([(g["name"], g["copies"], g["bytes"]) for g in r["replicated"]])
            merged.setdefault(key, ([], r))[0].append(r["mesh"])
        for meshes, r in merged.values():
            groups = r["replicated"]
            n = r["devices"]
            total = sum(g["bytes"] for g in groups)
            extra = sum(g["device_bytes"] - g["bytes"] // n for g in groups)
            lines.append(
                f"  {label}, {' / '.join(meshes)}: {_human(total)} of parameters in "
                f"{sum(g['leaves'] for g in groups)} arrays; one device holds "
                f"{_human(extra)} of parameters more than 1/{n} of them"
            )
            for g in sorted(groups, key=lambda g: (-g["bytes"], g["name"])):
                where = (
                    "replicated on every device"
                    if g["copies"] == n
                    else f"split {n // g['copies']} ways, {g['copies']} copies"
                )
                axes = "(" + ", ".join(str(a) for a in g["logical"] or ()) + ")"
                lines.append(
                    f"    {g['name']:<27} {axes:<16} x{g['leaves']:<3} "
                    f"{g['values']:>9,} values {_human(g['bytes']):>10}  {where}"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config", default=DEFAULT_CONFIG, help=f"config file (default {DEFAULT_CONFIG})"
    )
    p.add_argument("--devices", type=int, default=8, help="number of devices (default 8)")
    args = p.parse_args(argv)
    if args.devices < 1:
        p.error("--devices must be >= 1")
    start = time.perf_counter()
    _prepare_devices(args.devices)  # before anything imports jax
    from diffjax.config import ConfigError

    try:
        rows = report(args.config, args.devices)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import jax

    first = rows[0]
    print(
        f"sharding memory: {args.config}, {args.devices} devices, JAX {jax.__version__}; "
        f"abstract train state (jax.eval_shape, nothing allocated), bytes from shapes"
    )
    print(
        f"parameters {first['param_dtype']}; optimizer state: AdamW mu and nu (the parameters' "
        f"dtype) and two int32 step counts; total = parameters + optimizer state"
    )
    if first["note"]:
        print(first["note"])
    for label in dict.fromkeys(r["model"] for r in rows):
        r = next(r for r in rows if r["model"] == label)
        print(f"  {label}: {r['attention']}, {r['params']:,} parameters")
    print()
    print(format_table(rows))
    print(f"\n({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
