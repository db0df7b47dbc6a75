"""Meshes, logical axis rules and the partition helpers built on them.

Every parameter of the model carries *logical* axis names (``("embed", "heads")`` for a query
projection, ``("mlp", "embed")`` for the FFN's down projection, ...), stored as Flax's
``out_sharding`` metadata. A table of *rules* maps logical names to the axes of a
``("data", "fsdp", "context", "tensor")`` mesh; :data:`DEFAULT_RULES` is MaxText's layout:

- batch over ``data`` and ``fsdp`` (data parallelism; FSDP is data parallelism whose
  parameters and optimizer state are sharded too);
- the sequence of the activations over ``context`` (sequence parallelism: attention runs as a
  ring or an all-gather over it, :mod:`diffjax.ops.context`; everything else is token-local);
- the model width (``embed``) of every weight over ``fsdp``;
- attention heads, MLP hidden units and the vocabulary over ``tensor`` (Megatron-style
  tensor parallelism).

Nothing here changes the math: the same program runs on any mesh (XLA's GSPMD inserts the
collectives), and on one device everything is a no-op.

**DIFF pairs stay whole.** The head axis that ``tensor`` shards is the DIFF head (V1: the
pair Q1/Q2 of raw heads ``2i, 2i+1``; V2: the query pair of output head ``i``), and the
projections are laid out pair-major (``[..., h, 2, d]``), so a shard of ``h / tensor`` heads
holds whole pairs, their kv groups (K1/K2, V1's ``2d``-wide V) and their lambdas.
:func:`check_model_mesh` refuses a tensor size that does not divide the heads, before any
compute.

Use::

    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    with jax.set_mesh(mesh), nnx.logical_axis_rules(DEFAULT_RULES):
        state = jax.jit(init, out_shardings=state_shardings(abstract_state, mesh))()
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from flax.linen import spmd as flax_spmd
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from diffjax.config import KERNEL_ORDERS, RUN_TOKEN_ORDER, TOKEN_ORDERS, ConfigError

MESH_AXES = ("data", "fsdp", "context", "tensor")
BATCH_AXES = ("data", "fsdp")

# logical name -> mesh axis (or axes, or None: replicated). Parameters use the plain names;
# activations the ``act_`` ones.
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", BATCH_AXES),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("norm", None),
    ("head_dim", None),
    ("layers", None),  # the leading axis of stacked (scanned) layers
    ("act_batch", BATCH_AXES),
    ("act_seq", "context"),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)


# ---------------------------------------------------------------------------- the mesh config
@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes. One of them may be ``-1``: it takes the devices the others leave.

    ``data``: pure data parallelism (parameters replicated). ``fsdp``: data parallelism with
    parameters and optimizer state sharded (ZeRO-3). ``tensor``: attention heads and MLP hidden
    units split across devices (keep it within a host: it communicates every layer).

    ``data=None`` (the default) means ``-1`` (all devices data-parallel) unless ``fsdp``,
    ``context`` or ``tensor`` is ``-1``, then 1: ``MeshConfig(fsdp=-1)`` is pure FSDP.

    ``context_order``: how the sequence is laid over the ``context`` devices. "zigzag" (the
    default) cuts it into ``2 x context`` chunks and gives device ``i`` chunks ``i`` and
    ``2 x context - 1 - i``, so every device does the same causal work; "striped" gives
    device ``i`` tokens ``i, i + context, ...`` (also balanced); "contiguous" gives
    each device one run of positions (the last device does the most work).
    """

    # data-parallel devices (parameters replicated); None: -1 (the rest), or 1 if fsdp,
    # context or tensor is -1
    data: int | None = None
    # data-parallel devices with parameters and optimizer state sharded (ZeRO-3); -1: the rest
    fsdp: int = 1
    # devices that split the sequence (long context; attention as a ring); -1: the rest
    context: int = 1
    # devices that split attention heads and MLP units (keep it within a host); -1: the rest
    tensor: int = 1
    # the sequence over the context devices: "zigzag" or "striped" (balanced causal work) or
    # "contiguous"
    context_order: str = RUN_TOKEN_ORDER

    def __post_init__(self):
        if self.context_order not in TOKEN_ORDERS:
            raise ConfigError(
                f"MeshConfig.context_order: unknown order {self.context_order!r}. Fix: set "
                f"mesh.context_order to one of {', '.join(TOKEN_ORDERS)}."
            )
        for name in MESH_AXES:
            v = getattr(self, name)
            if name == "data" and v is None:
                continue
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or (v < 1 and v != -1):
                raise ConfigError(
                    f"MeshConfig.{name}: must be a positive integer or -1 (fill), "
                    f"got {v!r}. Fix: set mesh.{name} to e.g. 1, 2, 8 or -1."
                )
        fills = [n for n in MESH_AXES if getattr(self, n) == -1]
        if len(fills) > 1:
            raise ConfigError(
                f"MeshConfig: {' and '.join('mesh.' + n for n in fills)} are both -1; "
                f"at most one axis can take the remaining devices. Fix: give all but "
                f"one of them a size."
            )

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """``(data, fsdp, context, tensor)`` as given, ``data=None`` resolved (``-1`` stays)."""
        data = self.data
        if data is None:
            data = 1 if -1 in (self.fsdp, self.context, self.tensor) else -1
        return data, self.fsdp, self.context, self.tensor

    def shape(self, num_devices: int) -> tuple[int, int, int, int]:
        """``(data, fsdp, context, tensor)`` for ``num_devices`` devices (``-1`` resolved)."""
        sizes = list(self.sizes)
        fixed = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % fixed:
                raise ConfigError(
                    f"MeshConfig: the fixed axes ({self._fmt()}) take {fixed} devices, which does "
                    f"not divide the {num_devices} devices available. Fix: choose sizes whose "
                    f"product divides {num_devices}."
                )
            sizes[sizes.index(-1)] = num_devices // fixed
        elif fixed != num_devices:
            raise ConfigError(
                f"MeshConfig: data x fsdp x context x tensor = {fixed} ({self._fmt()}), but {num_devices} "
                f"devices are available. Fix: make the product {num_devices}, or set one axis to "
                f"-1 to take the rest (e.g. mesh.data=-1)."
            )
        return tuple(sizes)  # type: ignore[return-value]

    def _fmt(self) -> str:
        return ", ".join(f"{n}={v}" for n, v in zip(MESH_AXES, self.sizes))


def make_mesh(
    config: MeshConfig | None = None, devices: Sequence[Any] | None = None
) -> jax.sharding.Mesh:
    """A ``("data", "fsdp", "context", "tensor")`` mesh with Auto axes (GSPMD style) over ``devices``
    (default: every device of every process), in the order ``jax.make_mesh`` picks (it keeps
    ``tensor`` within a host and ``data`` across hosts where the topology allows)."""
    config = config or MeshConfig()
    devices = list(jax.devices() if devices is None else devices)
    shape = config.shape(len(devices))
    return jax.make_mesh(
        shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
    )


# ---------------------------------------------------------------------------- annotations
def param_init(initializer, *names: str | None):
    """``initializer`` whose parameter carries the logical axis ``names`` (one per dim).

    Flax's eager sharding is turned off for these parameters: a model is built the same way with
    or without a mesh, and the train loop places the state with ``jit(out_shardings=...)``."""
    return nnx.with_partitioning(initializer, tuple(names), eager_sharding=False)


def param(value: jax.Array, *names: str | None) -> nnx.Param:
    """``nnx.Param(value)`` carrying the logical axis ``names``."""
    return nnx.Param(value, out_sharding=tuple(names), eager_sharding=False)


def logical_axes(variable: Any) -> tuple[str | None, ...] | None:
    """The logical axis names of an ``nnx.Variable`` (None when it has none)."""
    if not isinstance(variable, nnx.Variable):
        return None
    meta = variable.get_metadata()
    for key in ("out_sharding", "sharding_names"):  # flax 0.12.8's name, 0.12.2's name
        if meta.get(key):
            return tuple(meta[key])
    return None


# ---------------------------------------------------------------------------- rules -> specs
def current_rules() -> tuple[tuple[str, Any], ...]:
    """The rules of the innermost ``nnx.logical_axis_rules(...)`` block, else
    :data:`DEFAULT_RULES`."""
    from flax.core import spmd as core_spmd

    return tuple(core_spmd.get_logical_axis_rules()) or DEFAULT_RULES


def _mesh_sizes(mesh) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.axis_sizes))


def logical_to_spec(
    names: Sequence[str | None],
    shape: Sequence[int] | None,
    mesh,
    rules: Sequence[tuple[str, Any]] | None = None,
) -> PartitionSpec:
    """The ``PartitionSpec`` of an array with logical axis ``names`` on ``mesh``.

    Flax's ``logical_to_mesh_axes`` maps the names through ``rules`` (in order; a mesh axis is
    used at most once per array); then the axes the mesh lacks are dropped and, with ``shape``
    given, an axis is only kept while the product of the axes kept divides the dimension (the
    rest of that dimension is replicated: the byte tokenizer's 259-entry vocabulary is
    replicated, not split unevenly)."""
    rules = tuple(current_rules() if rules is None else rules)
    known = {name for name, _ in rules}
    for name in names:
        if name is not None and name not in known:
            raise ValueError(
                f"logical axis {name!r} has no rule. Fix: add ({name!r}, mesh axis or "
                f"None) to the logical axis rules (see diffjax.infra.sharding.DEFAULT_RULES)"
            )
    sizes = _mesh_sizes(mesh)
    # a name repeated in one array is mapped at its first place only (flax refuses repeats)
    unique = tuple(n if n not in names[:i] else None for i, n in enumerate(names))
    spec = []
    for i, target in enumerate(flax_spmd.logical_to_mesh_axes(unique, rules)):
        kept: list[str] = []
        for ax in (target,) if isinstance(target, str) else tuple(target or ()):
            if ax not in sizes or (
                shape is not None and shape[i] % (math.prod(sizes[a] for a in kept) * sizes[ax])
            ):
                break
            kept.append(ax)
        spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def _leaf_spec(x, mesh, rules) -> PartitionSpec:
    names = logical_axes(x) if isinstance(x, nnx.Variable) else None
    value = x.get_value() if isinstance(x, nnx.Variable) else x
    shape = getattr(value, "shape", None)
    if names is None or shape is None:
        return PartitionSpec()
    if len(names) != len(shape):
        raise ValueError(
            f"a parameter of shape {tuple(shape)} is annotated with {len(names)} "
            f"logical axes {names}; give one name per dimension"
        )
    return logical_to_spec(names, shape, mesh, rules)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _map_vars(fn, tree):
    """``fn`` on every leaf, a ``nnx.Variable`` counted as one leaf and kept as a Variable
    around the result (so the output has ``tree``'s structure, as ``jit`` and Orbax want)."""

    def one(x):
        out = fn(x)
        return x.replace(out) if isinstance(x, nnx.Variable) else out

    return jax.tree.map(one, tree, is_leaf=_is_var)


def tree_specs(tree: Any, mesh, rules: Sequence[tuple[str, Any]] | None = None) -> Any:
    """``PartitionSpec`` per leaf of ``tree`` (params, optimizer state, whole train state): a
    ``nnx.Variable`` leaf by its logical names, anything else replicated. Optax's moments are
    built with ``tree.map`` over the parameters, so they keep the parameters' annotations and
    are sharded like them."""
    return _map_vars(lambda x: _leaf_spec(x, mesh, rules), tree)


def tree_shardings(tree: Any, mesh, rules: Sequence[tuple[str, Any]] | None = None) -> Any:
    """``NamedSharding`` per leaf (see :func:`tree_specs`), with ``tree``'s structure: ``jit``
    in/out shardings, and the target for restoring a checkpoint onto ``mesh``."""
    return _map_vars(lambda x: NamedSharding(mesh, _leaf_spec(x, mesh, rules)), tree)


# ---------------------------------------------------------------------------- activations
def context_mesh():
    """The mesh set with ``jax.set_mesh`` (abstract inside ``jit``), or None."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty else mesh


def constrain(x: jax.Array, *names: str | None) -> jax.Array:
    """``with_sharding_constraint`` by logical names under a mesh (``jax.set_mesh``); the
    identity without one."""
    mesh = context_mesh()
    if mesh is None or mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names, x.shape, mesh))


# ---------------------------------------------------------------------------- batches
def batch_sharding(mesh, ndim: int = 2, rules=None) -> NamedSharding:
    """Batch arrays ``[B, T, ...]``: rows over the batch axes, the rest replicated."""
    return NamedSharding(
        mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), None, mesh, rules)
    )


def process_batch_share(mesh, global_batch: int, rules=None) -> tuple[int, int]:
    """``(share index, number of shares)``: this process feeds rows ``[i * b, (i + 1) * b)`` of
    every global batch, ``b = global_batch / shares``. Processes whose devices hold the same
    rows (a ``tensor`` axis across hosts) get the same share."""
    sharding = batch_sharding(mesh, 2, rules)
    rows = sorted(
        {
            (s[0].start or 0, global_batch if s[0].stop is None else s[0].stop)
            for s in sharding.addressable_devices_indices_map((global_batch, 1)).values()
        }
    )
    start, stop = rows[0][0], rows[-1][1]
    if (
        any(b[0] != a[1] for a, b in zip(rows, rows[1:]))
        or (stop - start) == 0
        or global_batch % (stop - start)
        or start % (stop - start)
    ):
        raise ValueError(
            f"this process's devices hold rows {rows} of the batch, which are not "
            f"one contiguous block. Fix: order the mesh so each process's devices are "
            f"adjacent along the batch axes (jax.make_mesh does this)"
        )
    local = stop - start
    return start // local, global_batch // local


def global_batch(
    local: dict[str, np.ndarray], mesh, global_rows: int, rules=None
) -> dict[str, jax.Array]:
    """Global arrays from this process's rows of the batch (every process calls it)."""
    out = {}
    for k, v in local.items():
        v = np.asarray(v)
        sharding = batch_sharding(mesh, v.ndim, rules)
        out[k] = jax.make_array_from_process_local_data(sharding, v, (global_rows,) + v.shape[1:])
    return out


# ---------------------------------------------------------------------------- model checks
def check_model_mesh(
    model_cfg, mesh, global_batch_size: int | None = None, context_order: str = RUN_TOKEN_ORDER
) -> None:
    """Refuse, before any compute, a mesh the model cannot be split over: a ``tensor`` size
    that does not divide the (DIFF) heads or kv heads (it would split a DIFF pair or a kv group),
    a batch the data axes cannot divide, or the Pallas kernels on a ``context`` axis where
    they cannot run as the ring's blocks (the all-gather, the striped order)."""
    sizes = _mesh_sizes(mesh)
    n_ctx = sizes.get("context", 1)
    impl = model_cfg.attention_impl  # "auto" takes the XLA blocks where the kernels cannot
    if n_ctx > 1 and impl in ("cudnn", "splash"):
        raise ConfigError(
            f"model.attention_impl={impl} with mesh.context={n_ctx}: the sequence-parallel ring "
            f"merges its blocks by their log-sum-exp, which {impl} does not return. Fix: "
            f"model.attention_impl=pallas or auto (the fused kernels as the ring's blocks)"
        )
    if n_ctx > 1 and impl == "pallas":
        why = None
        if model_cfg.context_attention != "ring":
            why = "the all-gather path runs the XLA math. Fix: model.context_attention=ring"
        elif context_order not in KERNEL_ORDERS:
            why = (
                f"their ring masks by index and takes its blocks' layout from the zigzag or "
                f"contiguous order, not {context_order}. Fix: mesh.context_order=zigzag"
            )
        if why is not None:
            raise ConfigError(
                f"model.attention_impl=pallas with mesh.context={n_ctx}: {why}, or "
                f"model.attention_impl=auto (the XLA blocks where the kernels cannot run)"
            )
    t = sizes.get("tensor", 1)
    if t > 1:
        heads, kv = model_cfg.num_heads, model_cfg.kv_heads
        ok = [d for d in range(1, kv + 1) if kv % d == 0 and heads % d == 0]
        what = "DIFF heads (pairs)" if model_cfg.is_diff else "heads"
        for n, label in ((heads, f"model.num_heads={heads} {what}"), (kv, f"{kv} kv heads")):
            if n % t:
                raise ConfigError(
                    f"mesh.tensor={t} does not divide the {label}: tensor parallelism shards "
                    f"whole heads{' and never splits a DIFF pair' if model_cfg.is_diff else ''}. "
                    f"Fix: use mesh.tensor in {ok} "
                    f"and put the other devices on mesh.fsdp or mesh.data."
                )
    if global_batch_size is not None:
        dp = sizes.get("data", 1) * sizes.get("fsdp", 1)
        if global_batch_size % dp:
            raise ConfigError(
                f"train.batch_size={global_batch_size} is not divisible by data x fsdp = {dp} "
                f"(mesh {dict(sizes)}). Fix: use a batch size that is a multiple of {dp}, or "
                f"move devices to mesh.tensor."
            )


def bytes_per_device(tree: Any, mesh, rules=None) -> tuple[int, int]:
    """``(bytes on one device, unsharded bytes)`` of ``tree`` (arrays or ``ShapeDtypeStruct``s)
    placed by its annotations on ``mesh``; computed from shapes, nothing is allocated (shards
    are even: :func:`logical_to_spec` only splits dimensions that divide)."""
    shardings = jax.tree.leaves(tree_shardings(tree, mesh, rules))
    per_device = total = 0
    for x, sh in zip(jax.tree.leaves(tree), shardings):
        size = np.dtype(x.dtype).itemsize
        total += math.prod(x.shape) * size
        per_device += math.prod(sh.shard_shape(tuple(x.shape))) * size
    return per_device, total


def local_rows(x: jax.Array) -> np.ndarray:
    """This process's rows of a batch-sharded global array, in order (host numpy)."""
    shards = {}
    for s in x.addressable_shards:
        shards.setdefault(s.index[0].start or 0, s)
    return np.concatenate([np.asarray(shards[k].data) for k in sorted(shards)], axis=0)


__all__ = [
    "BATCH_AXES",
    "DEFAULT_RULES",
    "MESH_AXES",
    "MeshConfig",
    "batch_sharding",
    "bytes_per_device",
    "check_model_mesh",
    "constrain",
    "context_mesh",
    "current_rules",
    "global_batch",
    "local_rows",
    "logical_axes",
    "logical_to_spec",
    "make_mesh",
    "param",
    "param_init",
    "process_batch_share",
    "tree_shardings",
    "tree_specs",
]
