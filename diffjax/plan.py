"""Will it fit? Compile the real train step for a machine that is not here, and read its memory.

    python -m diffjax.plan --config configs/diff_830m.py plan.target=v5e-8
    python -m diffjax.plan --config configs/diff_3b.py plan.target=h100-8 train.batch_size=64
    python -m diffjax.plan --config configs/diff_125m.py plan.target=v5p-8 plan.hbm_gib=4

For every model of the config's comparison (:class:`diffjax.compare.Comparison`: the DIFF model
and its standard twin, :func:`diffjax.config.twin`, unless ``compare.twins=``)
this builds the config's mesh (``mesh.data/fsdp/tensor``) over the target's devices, the train
state abstractly (shapes and shardings only: nothing is allocated) and lowers and compiles
:func:`diffjax.train.step.train_step`, with the shardings the loop uses and the model's attention
(the Pallas kernels on GPU/TPU), with the compiler the target would run: libtpu's for a TPU
topology (``jax.experimental.topologies``, as MaxText's ``train_compile.py`` does), XLA's CUDA
compiler for a deviceless GPU. Both come with the ``compile`` extra (``pip install -e
".[compile]"``), which belongs in a venv of its own (``.ci/run`` makes one; see
``benchmarks/compile_kernels.py``): run the planner with that venv's python.

Per device, per model, it prints the parameter and optimizer bytes (from the shardings), XLA's
temporaries and the total (``compiled.memory_analysis()``) against the target's HBM (on a GPU
the part JAX's allocator takes: 75% unless ``XLA_CLIENT_MEM_FRACTION`` says otherwise) with a
verdict, the FLOPs per step from XLA (``cost_analysis``: the Pallas kernels' work is not in it)
and from the formula (:func:`diffjax.infra.flops.train_flops_per_token`), and the step time and
tokens/s at a stated MFU (``plan.mfu``). When a model does not fit it compiles the settings that
trade compute for memory, cheapest first (``model.remat`` policies, ``train.grad_accum_steps``
doubled), and names the first that fits as the overrides to pass.

Exit status: 0 when every model fits as configured, 1 when one does not (the output names the
setting that fits, if one does), 2 for bad input or a missing compiler (refused before any
compile, with the fix).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import json
import math
import os
import re
import shutil
import sys
import time
from typing import Any

import jax
from flax import nnx

from diffjax import cli
from diffjax.infra import sharding, storage
from diffjax.infra import flops as flops_lib
from diffjax.config import ConfigError, KernelTarget, ModelConfig, check_fields, fail
from diffjax.kernels import cudnn
from diffjax.nn.param_count import count_params
from diffjax.infra.runtime import Runtime
from diffjax.train import setup as setup_lib
from diffjax.train import step as step_lib
from diffjax.train.config import ExperimentConfig, apply_overrides, experiment_keys_help
from diffjax.compare.config import as_comparison, default_comparison, load_comparison


GIB = 1024**3
COMPILE_EXTRA = "pip install -e '.[compile]' in a venv of its own (.ci/run makes one), and run the planner with that venv's python"

# ---------------------------------------------------------------------------- targets
# XLA's device description of a compile-only GPU (the fields the compiler reads), as
# benchmarks/compile_kernels.py has it. H100 SXM and H200: sm_90, 227 KiB of shared memory per
# block, 132 SMs; they differ in memory size and bandwidth.
_GPU_PROTO = """
gpu_device_info {{ threads_per_block_limit: 1024 threads_per_warp: 32
  shared_memory_per_block: 49152 shared_memory_per_core: 233472
  threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {bw} l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: {mem} shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 minor: 0 }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536 }}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 12 }}
runtime_version {{ major: 13 minor: 0 patch: 0 }}
device_description_str: "{name}"
"""


@dataclasses.dataclass(frozen=True)
class Target:
    """A machine to plan for: ``devices`` accelerators of ``hbm_gib`` each."""

    name: str
    platform: str  # "tpu" or "gpu" (what jax.default_backend() would say there)
    devices: int
    hbm_gib: float
    device_kind: str  # what jax.devices()[0].device_kind says on it
    peak_tflops: float  # dense bf16 per device (a fallback when diffjax.infra.flops lacks it)
    topology: str  # libtpu's topology name, or the CUDA topology "slices x hosts x devices"
    note: str = ""
    gpu_memory_bytes: int = 0
    gpu_bandwidth: int = 0
    compute_capability: tuple[int, int] = (9, 0)

    def describe(self) -> str:
        return f"{self.devices} x {self.device_kind}, {self.hbm_gib:g} GiB HBM each{self.note}"

    def budget_gib(self, env=None) -> float:
        """What one step may use per device: the HBM on a TPU; on a GPU the part JAX's
        allocator takes (:func:`gpu_mem_fraction`)."""
        if self.platform != "gpu":
            return self.hbm_gib
        return self.hbm_gib * gpu_mem_fraction(os.environ if env is None else env)


GPU_MEM_FRACTION_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
GPU_DEFAULT_MEM_FRACTION = 0.75  # JAX's GPU allocator takes 75% of each GPU unless told


def gpu_mem_fraction(env) -> float:
    """The fraction of each GPU's memory JAX's allocator takes: ``XLA_CLIENT_MEM_FRACTION``
    (or its older name ``XLA_PYTHON_CLIENT_MEM_FRACTION``) from ``env``, else JAX's default
    0.75. Run the planner with the value the training job will have."""
    for var in GPU_MEM_FRACTION_VARS:
        raw = env.get(var)
        if raw:
            try:
                value = float(raw)
            except ValueError:
                value = -1.0
            if not 0 < value <= 1:
                raise PlanError(f"{var}={raw!r}: must be a fraction in (0, 1]. Fix: e.g. {var}=.9")
            return value
    return GPU_DEFAULT_MEM_FRACTION


TARGETS = {
    t.name: t
    for t in (
        Target("v5e-8", "tpu", 8, 16, "TPU v5 lite", 197, "v5e:2x4"),
        Target("v6e-8", "tpu", 8, 32, "TPU v6 lite", 918, "v6e:2x4"),
        # Cloud TPU names v5p slices by TensorCores: v5p-8 is 4 chips (2 cores each, one device)
        Target("v5p-8", "tpu", 4, 95, "TPU v5", 459, "v5p:2x2x1", note=" (v5p-8: 8 cores)"),
        Target(
            "h100-8",
            "gpu",
            8,
            80,
            "NVIDIA H100 80GB HBM3",
            989,
            "1x1x8",
            gpu_memory_bytes=80 * GIB,
            gpu_bandwidth=3_350_000_000_000,
        ),
        Target(
            "h200-8",
            "gpu",
            8,
            141,
            "NVIDIA H200",
            989,
            "1x1x8",
            gpu_memory_bytes=141 * GIB,
            gpu_bandwidth=4_800_000_000_000,
        ),
    )
}

# what a remat policy costs in extra compute, as a fraction of a step without it (the search
# tries settings in this order of cost): "dots" recomputes the elementwise work, "minimal" the
# FFN and the attention core, "full" the whole forward pass of each block (1/3 of a step). Each
# doubling of grad_accum_steps is charged 5% (smaller matmuls, weights gathered per microbatch).
REMAT_COST = {"none": 0.0, "dots": 0.03, "minimal": 0.15, "full": 0.33}
ACCUM_COST = 0.05


class PlanError(Exception):
    """Bad input, refused before any compile (exit status 2); the message names the fix."""


# ---------------------------------------------------------------------------- compilers
def missing_compiler(target: Target) -> str | None:
    """Why this interpreter cannot compile for ``target`` (None: it can)."""

    def installed(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            return False

    if target.platform == "tpu":
        if not installed("libtpu"):
            return f"libtpu is not installed in {sys.executable}. Fix: {COMPILE_EXTRA}."
        return None
    if not (installed("jax_plugins.xla_cuda13") or installed("jax_plugins.xla_cuda12")):
        return f"the CUDA PJRT plugin is not installed in {sys.executable}. Fix: {COMPILE_EXTRA}."
    if _ptxas() is None:
        return (
            f"ptxas (nvidia-cuda-nvcc) is not installed in {sys.executable}. Fix: {COMPILE_EXTRA}."
        )
    return None


def _ptxas() -> str | None:
    try:
        import nvidia  # the namespace package of NVIDIA's wheels

        for p in nvidia.__path__:
            for sub in sorted(os.listdir(p)):
                cand = os.path.join(p, sub, "bin", "ptxas")
                if sub.startswith("cu1") and os.path.isfile(cand):
                    return cand
    except (ImportError, OSError):
        pass
    return shutil.which("ptxas")


def compile_only_env() -> None:
    """This process runs on CPU and compiles for compile-only devices: jax on the CPU (the
    compile extra's plugin and libtpu would each try to open a device), and libtpu without its
    one-process-per-host lock (nothing here touches a TPU; two plans may run at once)."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    jax.config.update("jax_platforms", "cpu")


def target_devices(target: Target) -> list:
    """The compile-only devices of ``target``."""
    from jax.experimental import topologies

    if target.platform == "tpu":
        topo = topologies.get_topology_desc(target.topology, platform="tpu")
    else:
        proto = _GPU_PROTO.format(
            bw=target.gpu_bandwidth, mem=target.gpu_memory_bytes, name=target.device_kind
        )
        topo = topologies.get_topology_desc(
            platform="cuda", target_config=proto, topology=target.topology
        )
    devices = list(topo.devices)
    if len(devices) != target.devices:
        raise PlanError(
            f"the {target.topology} topology has {len(devices)} devices, expected "
            f"{target.devices} for {target.name}"
        )
    return devices


# ---------------------------------------------------------------------------- one compile
@dataclasses.dataclass
class Measure:
    """One model compiled with one setting: bytes per device and FLOPs."""

    remat: str
    accum: int
    params_bytes: int
    opt_bytes: int
    args_bytes: int  # everything passed in (state, batch, the non-parameter state)
    temp_bytes: int  # XLA's temporaries: activations, gradients, collectives' buffers
    out_bytes: int  # outputs not aliased to a donated input
    code_bytes: int
    total_bytes: int
    xla_flops: float | None  # per device, XLA's count (no Pallas kernel in it)
    compile_s: float
    kernel_calls: int = 0  # Pallas kernels (Mosaic / Triton custom calls) in the compiled step
    permutes: int = 0  # collective-permutes in the program (a ring over `context`; XLA's own)
    cudnn_calls: int = 0  # cuDNN attention custom calls (forward and backward) in the step
    splash_calls: int = 0  # of the kernel calls, jax's Splash attention kernels
    compiler_oom: bool = False  # the compiler refused it (over HBM); total_bytes is its count

    def fits(self, hbm_bytes: float) -> bool:
        return not self.compiler_oom and self.total_bytes <= hbm_bytes


_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def _compiler_oom_bytes(message: str) -> int | None:
    """What a compiler that ran out of HBM says the program's temporaries or whole footprint
    need (libtpu: "the total memory required for HLO temporaries (91.16G) exceeds available HBM
    (15.75G)", or "Used 20.5G of 15.75G hbm"): bytes, -1 when it gives no number, None for
    another error."""
    for pattern in (
        r"HLO temporaries \(([0-9.]+)([KMGT]?)i?B?\)",
        r"Used ([0-9.]+)([KMGT]?)i?B? of [0-9.]+[KMGT]?i?B? hbm",
    ):
        m = re.search(pattern, message)
        if m:
            return int(float(m.group(1)) * _UNITS[m.group(2)])
    return -1 if "RESOURCE_EXHAUSTED" in message or "Ran out of memory" in message else None


def _concrete_rest(setup: setup_lib.ModelSetup):
    """The model's non-parameter state (DIFF V1's lambda_init per layer) as the loop holds it, a
    constant of the step (:func:`diffjax.train.setup.compile_steps`), computed here on the CPU
    (XLA drops the parameter initialisers this does not return)."""
    return jax.jit(lambda: setup.init(jax.random.key(0))[1])()


def target_runtime(exp: ExperimentConfig, model_cfg: ModelConfig, mesh, target: Target) -> Runtime:
    """The :class:`~diffjax.infra.runtime.Runtime` of ``model_cfg`` on ``target``: its platform and
    (a GPU's) compute capability as data, so the step is traced as it would be there, and the
    attention decided for them (:func:`diffjax.train.setup.run_runtime`)."""
    cc = target.compute_capability if target.platform == "gpu" else None
    return setup_lib.run_runtime(exp, model_cfg, mesh, KernelTarget(target.platform, cc))


def lower_train_step(
    exp: ExperimentConfig, model_cfg: ModelConfig, devices, target: Target
) -> tuple[setup_lib.ModelSetup, Any, float]:
    """The loop's own train step (:func:`diffjax.train.setup.jit_steps`) of ``model_cfg`` with
    ``exp``'s train config and mesh on ``devices`` (compile-only: nothing is allocated),
    lowered for ``target``: ``(setup, lowered, seconds to trace and lower)``."""
    tcfg = exp.train
    mesh = sharding.make_mesh(exp.mesh, devices)
    seq, batch = exp.data.seq_len, tcfg.batch_size
    with nnx.logical_axis_rules(sharding.DEFAULT_RULES):
        # shapes and shardings (jax.eval_shape; outside jax.set_mesh, whose compile-only devices
        # cannot hold the init key)
        setup = setup_lib.model_setup(model_cfg, tcfg, target_runtime(exp, model_cfg, mesh, target))
        rest = _concrete_rest(setup)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.DEFAULT_RULES):
        batch_sh = sharding.batch_sharding(mesh, 2)
        abstract_batch = {
            name: jax.ShapeDtypeStruct((batch, seq), dtype, sharding=batch_sh)
            for name, dtype in step_lib.step_inputs(exp.data, setup.runtime).items()
        }
        # the loop's own jitted step (its shardings, donation and compiler options)
        jitted, _ = setup_lib.jit_steps(setup, rest, {k: batch_sh for k in abstract_batch})
        t0 = time.time()
        with _compile_only_cudnn(target):
            lowered = jitted.trace(setup.abstract, abstract_batch).lower()
    return setup, lowered, time.time() - t0


def _compile_only_cudnn(target: Target):
    """On a GPU target, jax's cuDNN attention traced for that GPU (its compute capability and a
    cuDNN 9.12, the version the compile-only device description declares) rather than for a
    device here: :func:`diffjax.kernels.cudnn.compile_only`."""
    if target.platform != "gpu":
        return contextlib.nullcontext()
    return cudnn.compile_only(91200, target.compute_capability)


def compile_train_step(
    exp: ExperimentConfig, model_cfg: ModelConfig, devices, target: Target, dump: str | None = None
) -> Measure:
    """Lower and compile the train step of ``model_cfg`` with ``exp``'s train config and mesh
    on ``devices`` (compile-only); nothing is allocated. ``dump``: a path prefix to write the
    compiled program (``PREFIX.hlo.txt``) and its memory breakdown (``PREFIX.memory.json``)."""
    tcfg = exp.train
    setup, lowered, lower_s = lower_train_step(exp, model_cfg, devices, target)
    mesh = setup.mesh
    t0 = time.time()
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001  (the TPU compiler refuses what exceeds HBM)
        used = _compiler_oom_bytes(str(e))
        if used is None:
            raise
        compiled = None
    compile_s = lower_s + time.time() - t0
    params_bytes, _ = sharding.bytes_per_device(setup.abstract["params"], mesh)
    opt_bytes, _ = sharding.bytes_per_device(setup.abstract["opt_state"], mesh)
    if compiled is None:  # what the compiler said it needed (at least: temporaries + state)
        return Measure(
            model_cfg.remat,
            tcfg.grad_accum_steps,
            params_bytes,
            opt_bytes,
            -1,
            used,  # the temporaries, or the whole footprint, as the compiler counted it
            0,
            0,
            used + params_bytes + opt_bytes if used > 0 else -1,
            None,
            compile_s,
            0,
            compiler_oom=True,
        )
    mem = compiled.memory_analysis()
    args = int(mem.argument_size_in_bytes)
    out = int(mem.output_size_in_bytes) - int(mem.alias_size_in_bytes)
    temp, code = int(mem.temp_size_in_bytes), int(mem.generated_code_size_in_bytes)
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    xla_flops = (cost or {}).get("flops")
    text = compiled.as_text() or ""
    kernels = text.count('custom_call_target="tpu_custom_call"') + text.count(
        'custom_call_target="__gpu$xla.gpu.triton"'
    )
    # the ring's K/V hops (sync or async form; counted once per op in the program text)
    permutes = len(re.findall(r" collective-permute(?:-start)?\(", text))
    cudnn_calls = len(re.findall(r'custom_call_target="__cudnn\$fmha', text))
    splash_calls = len(re.findall(r"^\s*%splash_\w*(?:\.\d+)? = [^\n]*custom-call\(", text, re.M))
    if dump is not None:
        write_dump(dump, text, mem, params_bytes, opt_bytes)
    return Measure(
        model_cfg.remat,
        tcfg.grad_accum_steps,
        params_bytes,
        opt_bytes,
        args,
        temp,
        max(out, 0),
        code,
        args + temp + max(out, 0) + code,
        None if xla_flops is None else float(xla_flops),
        compile_s,
        kernels,
        permutes,
        cudnn_calls,
        splash_calls,
    )


def _attention_row(m: Measure) -> str:
    """What computed the attention in the compiled step, from its custom calls."""
    if m.cudnn_calls:
        return f"cuDNN ({m.cudnn_calls} cuDNN attention calls in the step)"
    if m.splash_calls:
        return f"Splash ({m.splash_calls} Splash kernel calls in the step)"
    if m.kernel_calls:
        return f"Pallas ({m.kernel_calls} kernel calls in the step)"
    return "XLA (no Pallas kernel in the step)"


def write_dump(prefix: str, text: str, mem, params_bytes: int, opt_bytes: int) -> None:
    """``PREFIX.hlo.txt`` (the compiled step, as the compiler optimised it) and
    ``PREFIX.memory.json`` (its memory per device by kind, from ``memory_analysis()``)."""
    storage.write_text(f"{prefix}.hlo.txt", text)
    fields = [f for f in dir(mem) if f.endswith("_in_bytes")]
    breakdown = {f[: -len("_in_bytes")]: int(getattr(mem, f)) for f in sorted(fields)}
    breakdown.update(params=int(params_bytes), optimizer_state=int(opt_bytes))
    storage.write_text(f"{prefix}.memory.json", json.dumps(breakdown, indent=1) + "\n")


# ---------------------------------------------------------------------------- checks
def check_plan(exp: ExperimentConfig, target: Target) -> dict[str, ModelConfig]:
    """Refuse, before any compile, what cannot be compiled: a mesh that does not cover the
    target's devices, heads the ``tensor`` axis would split, a batch the data axes (times the
    accumulation) do not divide. Returns ``{label: model config}``."""
    try:
        shape = exp.mesh.shape(target.devices)
    except ConfigError as e:
        raise PlanError(f"{target.name} has {target.devices} devices: {e}") from None
    models = as_comparison(exp).models
    mesh = jax.sharding.AbstractMesh(shape, sharding.MESH_AXES)  # the target's axes, no devices
    for label, cfg in models.items():
        try:
            setup_lib.check_run(exp, mesh, [cfg])  # the rules train.py checks, in the same words
        except ConfigError as e:
            raise PlanError(f"[{label}] on {target.name} (mesh {_fmt_mesh(shape)}): {e}") from None
    return models


def _fmt_mesh(shape) -> str:
    return " ".join(f"{n}={s}" for n, s in zip(sharding.MESH_AXES, shape))


# ---------------------------------------------------------------------------- flops
def formula_flops_per_step(cfg: ModelConfig, seq: int, batch: int) -> float:
    return float(flops_lib.train_flops_per_token(cfg, seq)) * seq * batch


def peak_tflops(target: Target, override: float | None) -> float:
    if override is not None:
        return override
    try:
        got = flops_lib.peak_tflops(target.device_kind, None)
    except (KeyError, ValueError, TypeError):
        got = None
    return float(got) if got else target.peak_tflops


# ---------------------------------------------------------------------------- search
def candidates(
    remat: str, accum: int, batch: int, dp: int, search: str = "all", max_accum: int = 64
):
    """Settings that trade compute for memory, beyond ``(remat, accum)``, cheapest first:
    ``search`` "all", "remat" (the remat policies only) or "accum" (accumulation only)."""
    out = []
    a = accum
    while a <= max_accum and batch % a == 0 and (batch // a) % dp == 0:
        for r, c in REMAT_COST.items():
            cost = c + ACCUM_COST * math.log2(a / accum)
            if (r, a) == (remat, accum) or c < REMAT_COST.get(remat, 0.0):
                continue
            if (search == "remat" and a != accum) or (search == "accum" and r != remat):
                continue
            out.append((cost, r, a))
        a *= 2
    return [(r, a) for _, r, a in sorted(out)]


def _keeps_more(remat: str, accum: int, tried_remat: str, tried_accum: int) -> bool:
    """Whether ``(remat, accum)`` keeps at least the activations of a setting tried (which did
    not fit): a policy that saves as much or more (none > dots > minimal > full) over
    microbatches as large or larger."""
    return REMAT_COST[remat] <= REMAT_COST[tried_remat] and accum <= tried_accum


def overrides_for(remat: str, accum: int, base: ExperimentConfig) -> list[str]:
    out = []
    if remat != base.model.remat:
        out.append(f"model.remat={remat}")
    if accum != base.train.grad_accum_steps:
        out.append(f"train.grad_accum_steps={accum}")
    return out


def with_setting(exp: ExperimentConfig, remat: str, accum: int) -> ExperimentConfig:
    return dataclasses.replace(
        exp,
        model=exp.model.replace(remat=remat),
        train=dataclasses.replace(exp.train, grad_accum_steps=accum),
    )


# ---------------------------------------------------------------------------- output
def _gib(n: float) -> str:
    if abs(n) < GIB / 10:
        return f"{n / 1024**2:.1f} MiB"
    return f"{n / GIB:.2f} GiB"


def _seconds(s: float) -> str:
    if s >= 1:
        return f"{s:,.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.1f} us"


def _flops(x: float | None) -> str:
    if x is None:
        return "n/a"
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.3g} FLOP"


def model_table(
    label: str,
    cfg: ModelConfig,
    m: Measure,
    exp: ExperimentConfig,
    target: Target,
    hbm: float,
    mfu: float,
    peak: float,
) -> tuple[list[tuple[str, str]], dict]:
    seq, batch = exp.data.seq_len, exp.train.batch_size
    tokens = seq * batch
    formula = formula_flops_per_step(cfg, seq, batch)
    free = hbm - m.total_bytes
    if m.compiler_oom:
        free = min(free, -1)
        verdict = "DOES NOT FIT (the compiler ran out of HBM" + (
            f": at least {_gib(m.total_bytes)})" if m.total_bytes > 0 else ")"
        )
    else:
        verdict = (
            f"FITS ({_gib(free)} free)" if free >= 0 else f"DOES NOT FIT (over by {_gib(-free)})"
        )
    unknown = "n/a (the compiler refused the program)"
    rows = [
        ("parameters", f"{count_params_total(cfg):,}"),
        ("remat / grad accumulation", f"{m.remat} / {m.accum}"),
        (
            "attention",
            "? (not compiled)"
            if m.compiler_oom
            else _attention_row(m)
            + (f"; {m.permutes} collective-permutes in the program" if m.permutes else ""),
        ),
        ("parameters per device", _gib(m.params_bytes)),
        ("optimizer state per device", _gib(m.opt_bytes)),
        (
            "other inputs (batch, ...)",
            unknown
            if m.compiler_oom
            else _gib(max(m.args_bytes - m.params_bytes - m.opt_bytes, 0)),
        ),
        (
            "XLA temporaries",
            (f"{_gib(m.temp_bytes)} (the compiler's count)" if m.temp_bytes > 0 else unknown)
            if m.compiler_oom
            else _gib(m.temp_bytes),
        ),
        (
            "outputs not donated + code",
            unknown if m.compiler_oom else _gib(m.out_bytes + m.code_bytes),
        ),
        (
            "total per device",
            f"{_gib(m.total_bytes) if m.total_bytes > 0 else '?'} of {hbm / GIB:g} GiB",
        ),
        ("verdict", verdict),
        (
            "FLOPs/step, XLA",
            "n/a (this compiler reports no cost analysis)"
            if m.xla_flops is None
            else f"{_flops(m.xla_flops * target.devices)} ({_flops(m.xla_flops)}/device, "
            f"no Pallas kernel counted"
            + (", a scanned loop's body counted once)" if cfg.scan_layers else ")"),
        ),
        ("FLOPs/step, formula", _flops(formula)),
    ]
    step_s = tok_s = None
    if formula:
        step_s = formula / (target.devices * peak * 1e12 * mfu)
        tok_s = tokens / step_s
        rows += [
            (f"step time at MFU {mfu:g}", f"{_seconds(step_s)} ({peak:g} TFLOP/s peak/device)"),
            (
                f"tokens/s at MFU {mfu:g}",
                f"{tok_s:,.0f} ({tok_s / target.devices:,.0f} per device)",
            ),
        ]
    rows.append(("compile time", f"{m.compile_s:.0f} s"))
    record = dict(
        label=label,
        params=count_params_total(cfg),
        **dataclasses.asdict(m),
        hbm_bytes=hbm,
        fits=m.fits(hbm),
        formula_flops=formula,
        step_s=step_s,
        tokens_per_s=tok_s,
    )
    return rows, record


@functools.lru_cache(maxsize=16)
def count_params_total(cfg: ModelConfig) -> int:
    return int(count_params(cfg).total)


def print_table(title: str, rows: list[tuple[str, str]], out) -> None:
    w = max(len(k) for k, _ in rows)
    print(title, file=out)
    print("  " + "-" * (w + 2 + max(len(v) for _, v in rows)), file=out)
    for k, v in rows:
        print(f"  {k:<{w}}  {v}", file=out)


# ---------------------------------------------------------------------------- main
def search_fix(
    label: str, one: ExperimentConfig, devices, target: Target, hbm: float, dp: int, search, out
) -> tuple[list[dict], list[str] | None]:
    """For a model that does not fit: compile it with each remat and accumulation setting of
    :func:`candidates` (skipping any that keeps at least what a failed one kept) until one
    fits in ``hbm`` bytes; ``(what was tried, the overrides that fit or None)``, each said on
    ``out``."""
    tried, fix = [], None
    for r, a in candidates(
        one.model.remat, one.train.grad_accum_steps, one.train.batch_size, dp, search
    ):
        if any(_keeps_more(r, a, t["remat"], t["accum"]) for t in tried):
            continue  # keeps at least what a setting that did not fit kept
        trial = with_setting(one, r, a)
        tm = compile_train_step(trial, trial.model, devices, target)
        ok = tm.fits(hbm)
        tried.append(dict(remat=r, accum=a, total_bytes=tm.total_bytes, fits=ok))
        print(
            f"  try model.remat={r} train.grad_accum_steps={a}: "
            f"{_gib(tm.total_bytes) if tm.total_bytes > 0 else '?'}"
            f"{' (compiler: out of HBM)' if tm.compiler_oom else ''} -> "
            f"{'fits' if ok else 'does not fit'} "
            f"({tm.compile_s:.0f} s)",
            file=out,
        )
        if ok:
            fix = overrides_for(r, a, one)
            break
    if fix:
        print(f"  FIX [{label}]: pass {' '.join(fix)}", file=out)
    else:
        print(
            f"  [{label}] nothing tried fits: use more devices (a larger target or "
            f"mesh.fsdp), a smaller train.batch_size or a smaller model",
            file=out,
        )
    return tried, fix


def plan(
    exp: ExperimentConfig,
    target: Target,
    *,
    hbm_gib: float | None = None,
    mfu: float = 0.4,
    peak: float | None = None,
    search: str = "all",
    only: str | None = None,
    dump: str | None = None,
    out=sys.stdout,
) -> tuple[int, list[dict]]:
    """Plan ``exp`` on ``target``; ``(exit status, one record per model)``. ``dump``: a
    folder for each model's compiled step and memory breakdown (``LABEL.hlo.txt``,
    ``LABEL.memory.json``)."""
    models = check_plan(exp, target)
    if only is not None:
        if only not in models:
            raise PlanError(
                f"plan.model: {only!r} is not a model of this config. Fix: use one of "
                f"{', '.join(models)}"
            )
        models = {only: models[only]}
    hbm = (target.budget_gib() if hbm_gib is None else hbm_gib) * GIB
    why = missing_compiler(target)
    if why:
        raise PlanError(f"cannot compile for {target.name}: {why}")
    devices = target_devices(target)
    pk = peak_tflops(target, peak)
    shape = exp.mesh.shape(target.devices)
    print(
        f"target {target.name}: {target.describe()}; mesh {_fmt_mesh(shape)}; global batch "
        f"{exp.train.batch_size} x {exp.data.seq_len} tokens; jax {jax.__version__}",
        file=out,
    )
    if hbm_gib is None and target.platform == "gpu":
        print(
            f"budget per GPU: {hbm / GIB:.4g} GiB, the {hbm / GIB / target.hbm_gib:.0%} of its "
            f"memory JAX's allocator takes (XLA_CLIENT_MEM_FRACTION, default "
            f"{GPU_DEFAULT_MEM_FRACTION}: set it here and on the machine to plan for more)",
            file=out,
        )
    records, status = [], 0
    if dump is not None:
        storage.makedirs(dump)
    for label, cfg in models.items():
        one = as_comparison(exp).experiment(cfg)
        prefix = None if dump is None else storage.join(dump, label)
        m = compile_train_step(one, cfg, devices, target, prefix)
        rows, rec = model_table(label, cfg, m, exp, target, hbm, mfu, pk)
        if prefix is not None and not m.compiler_oom:
            print(f"[{label}] the compiled step: {prefix}.hlo.txt, {prefix}.memory.json", file=out)
        print("", file=out)
        print_table(
            f"[{label}] {cfg.attention}, {cfg.num_layers} layers, d_model {cfg.d_model}, "
            f"{cfg.num_heads} heads, attention_impl {cfg.attention_impl}",
            rows,
            out,
        )
        rec["fix"] = None
        if not rec["fits"]:
            status = 1
            whole = 0.95 * target.hbm_gib * GIB  # what a raised allocator fraction could give
            if hbm_gib is None and target.platform == "gpu" and 0 < m.total_bytes <= whole:
                print(
                    f"  [{label}] fits in 95% of the GPU's memory: XLA_CLIENT_MEM_FRACTION=.95 "
                    f"(here and on the machine) is a fix that costs no compute",
                    file=out,
                )
            if search != "none":
                rec["tried"], rec["fix"] = search_fix(
                    label, one, devices, target, hbm, shape[0] * shape[1], search, out
                )
        records.append(rec)
    fixes = [r for r in records if not r["fits"]]
    print("", file=out)
    if not fixes:
        print(f"plan: every model fits on {target.name}", file=out)
    else:
        for r in fixes:
            fix = " ".join(r["fix"]) if r.get("fix") else "none found"
            print(f"plan: [{r['label']}] does not fit on {target.name}; fits with: {fix}", file=out)
    return status, records


SEARCHES = ("all", "remat", "accum", "none")


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """What ``python -m diffjax.plan`` plans for (``plan.*``); checked at construction."""

    target: str | None = None  # required: the machine to compile for
    # the memory budget per device in GiB (None: the target's HBM; on a GPU the part JAX's
    # allocator takes, XLA_CLIENT_MEM_FRACTION, default 0.75)
    hbm_gib: float | None = None
    mfu: float = 0.4  # the MFU (model FLOPs utilisation) the step time and tokens/s assume
    peak_tflops: float | None = None  # the peak TFLOP/s per device (None: the target's)
    model: str | None = None  # plan only this model, diff or standard (None: every model)
    # when a model does not fit, try the remat policies and gradient accumulation (all), only
    # one of them, or nothing
    search: str = "all"
    json: str | None = None  # also write the records to this JSON file
    # also write each model's compiled step (LABEL.hlo.txt) and its memory per device by kind
    # (LABEL.memory.json) to this folder (local or gs://)
    dump: str | None = None

    def __post_init__(self):
        check_fields(self)
        c = "PlanSettings"
        if self.target is not None and self.target not in TARGETS:
            fail(c, "target", f"unknown target {self.target!r}", f"use one of {', '.join(TARGETS)}")
        if not 0 < self.mfu <= 1:
            fail(c, "mfu", f"must be in (0, 1], got {self.mfu:g}", "e.g. plan.mfu=0.4")
        for name in ("hbm_gib", "peak_tflops"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                fail(c, name, f"must be > 0, got {getattr(self, name):g}", "or none")
        if self.search not in SEARCHES:
            fail(
                c,
                "search",
                f"unknown search {self.search!r}",
                f"use one of {', '.join(map(repr, SEARCHES))}",
            )


PROG = "python -m diffjax.plan"
SECTIONS = (cli.Section("plan", PlanSettings(), {"target": tuple(TARGETS), "search": SEARCHES}),)
# each old flag and what replaced it (refused with the new spelling)
RENAMED = {
    "--target": cli.Renamed("plan.target={}"),
    "--hbm-gib": cli.Renamed("plan.hbm_gib={}"),
    "--mfu": cli.Renamed("plan.mfu={}"),
    "--peak-tflops": cli.Renamed("plan.peak_tflops={}"),
    "--model": cli.Renamed("plan.model={}"),
    "--search": cli.Renamed("plan.search={}"),
    "--json": cli.Renamed("plan.json={}"),
}


def main(argv=None) -> int:
    p = cli.parser(
        PROG,
        __doc__.split("\n\n")[0],
        SECTIONS,
        epilog="The config's keys (set as key=value, as train.py takes them) follow the "
        "planner's own.",
        example=f"{PROG} --config configs/diff_3b.py plan.target=h100-8 train.batch_size=64",
    )
    p.epilog += "\n\n" + experiment_keys_help(default_comparison())
    p.add_argument("--config", default=None, help="a config file (default: the defaults)")
    try:
        a, settings = cli.parse(p, argv, SECTIONS, RENAMED, others=True)
        opts: PlanSettings = settings["plan"]
        if opts.target is None:
            fail("plan", "target", "is required", f"give one of {', '.join(TARGETS)}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    compile_only_env()
    try:
        exp = apply_overrides(load_comparison(a.config), a.others)
        status, records = plan(
            exp,
            TARGETS[opts.target],
            hbm_gib=opts.hbm_gib,
            mfu=opts.mfu,
            peak=opts.peak_tflops,
            search=opts.search,
            only=opts.model,
            dump=opts.dump,
        )
    except (PlanError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(
                dict(target=opts.target, config=a.config, overrides=a.others, models=records),
                f,
                indent=1,
            )
    return status


if __name__ == "__main__":
    sys.exit(main())
