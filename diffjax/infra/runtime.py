"""How a run executes, decided once: :class:`Runtime`.

A run's mesh, the platform its devices are (``"cpu"``, ``"gpu"``, ``"tpu"``: the devices' own,
so a compile-only mesh of a TPU slice says ``"tpu"`` on this machine), how attention runs
over a ``context`` mesh axis (:class:`diffjax.config.ContextSpec`: the implementation, the
tokens' order, the axis) and what computes the model's attention (``attention``: a
:class:`diffjax.ops.Resolved`, decided once for the run's calls) travel together from where the run is set up to every place that
lays out batches, builds the model or compiles its steps (:mod:`diffjax.train.loop`, the
throughput measurement, the planner), so none of them re-derives one from another setting.

    runtime = Runtime.of(model_cfg, exp.mesh)               # the mesh of these devices
    runtime = Runtime(mesh)                                  # a mesh built by hand
    with runtime.activate(): ...                             # jax.set_mesh + the axis rules

Evaluation (:func:`diffjax.evaluate.losses_and_predictions` and what builds on it) and
generation (:func:`diffjax.generate`) take one as ``runtime=``: the model is used as built for
it (:func:`diffjax.nn.model.for_runtime`) and the batches are laid out in its token order.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import jax
from flax import nnx

from diffjax.infra import sharding
from diffjax.config import PLATFORMS, ContextSpec, KernelTarget, ModelConfig


@dataclasses.dataclass(frozen=True)
class Runtime:
    """The mesh, its devices' platform (and a GPU's compute capability), and the
    sequence-parallel spec of a run.

    ``platform`` defaults to the platform of the mesh's devices (``"cuda"``/``"rocm"`` read as
    ``"gpu"``), ``compute_capability`` to a GPU device's own; a planner passes its target's.
    ``context`` defaults to the ring in the natural token order."""

    mesh: Any  # jax.sharding.Mesh (devices may be compile-only)
    context: ContextSpec = ContextSpec()
    platform: str | None = None
    compute_capability: tuple[int, int] | None = None
    # the model's attention decided for the run (diffjax.ops.Resolved: diffjax.train.setup.
    # run_runtime); None: decided for this target and mesh when a model is built for it
    attention: Any = None

    def __post_init__(self) -> None:
        if self.platform is None:
            device = self.mesh.devices.flat[0]
            platform = "gpu" if device.platform in ("cuda", "rocm") else device.platform
            object.__setattr__(self, "platform", platform)
        if self.platform not in PLATFORMS:
            raise ValueError(
                f"Runtime.platform: unknown platform {self.platform!r}. Fix: one of "
                f"{', '.join(map(repr, PLATFORMS))}"
            )
        if self.platform == "gpu" and self.compute_capability is None:
            cc = getattr(self.mesh.devices.flat[0], "compute_capability", None)
            if cc is not None:
                major, minor = str(cc).split(".")[:2]
                object.__setattr__(self, "compute_capability", (int(major), int(minor)))

    @property
    def kernel_target(self) -> KernelTarget:
        """What the model's attention is traced for: this platform (and GPU)."""
        return KernelTarget(self.platform, self.compute_capability)

    @classmethod
    def of(cls, model_cfg: ModelConfig, mesh_cfg: sharding.MeshConfig, mesh=None) -> Runtime:
        """The runtime of ``model_cfg`` on ``mesh_cfg``'s mesh (``mesh``: one built already,
        e.g. over compile-only devices): the tokens lie in ``mesh_cfg.context_order`` and
        attention runs over the ``context`` axis as ``model_cfg.context_attention`` says."""
        mesh = sharding.make_mesh(mesh_cfg) if mesh is None else mesh
        spec = ContextSpec(impl=model_cfg.context_attention, order=mesh_cfg.context_order)
        return cls(mesh, spec)

    @contextlib.contextmanager
    def activate(self) -> Iterator[Runtime]:
        """Run under this runtime's mesh (``jax.set_mesh``) and the logical-axis rules in force
        (:data:`diffjax.infra.sharding.DEFAULT_RULES` unless a caller set others)."""
        with jax.set_mesh(self.mesh), nnx.logical_axis_rules(sharding.current_rules()):
            yield self

    @property
    def split_context(self) -> ContextSpec | None:
        """The context spec when this mesh splits the sequence (sequence-parallel attention),
        else None."""
        return self.context if self.context_size > 1 else None

    @property
    def context_size(self) -> int:
        """Devices along the ``context`` axis (1: the sequence is not split)."""
        return int(dict(zip(self.mesh.axis_names, self.mesh.axis_sizes)).get(self.context.axis, 1))
