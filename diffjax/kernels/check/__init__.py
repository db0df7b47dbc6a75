"""The kernels check themselves on the device they run on.

``python -m diffjax.kernels.check`` (or :func:`run_check`) runs the forward and backward of
:func:`diffjax.kernels.differential_flash_attention` and :func:`diffjax.kernels.flash_attention`
(on a GPU also their cuDNN compositions, :mod:`diffjax.kernels.cudnn`; on a TPU the Splash
ones, :mod:`diffjax.kernels.splash`; ``check.impl`` picks) on small shapes that cover what a run uses and compares the output and every gradient with the
reference math (:mod:`diffjax.kernels.reference`, float32, matmuls at full precision): DIFF V1
(separate K1/K2, V twice as wide, a scalar lambda), DIFF V2 (one shared key, lambda per token)
and standard attention, at head widths 64 and 128, in float32 and bfloat16, with GQA, causal
masking, packed segments and a length that is not a block multiple. It prints one line per case
with its error against the dtype's tolerance, the device kind and the jax/jaxlib versions, and a
verdict; the exit status is non-zero on any failure. ``check.interpret=true`` runs the kernels
through the interpreters (on CPU: the GPU kernel, or the TPU kernel with ``check.backend=tpu``).

:func:`ensure_checked` is what a run calls before it trains: it checks the cases of the run's
shapes that have not passed on this machine yet (the verdict is cached per device kind, backend,
jax and jaxlib versions and case, so a jax upgrade checks again) and raises
:class:`KernelCheckError` naming the failing cases.

Tolerances: ``max |kernel - reference| <= atol + rtol * max |reference|`` per array (lambda's
gradient, a sum over every output element, is scaled by the L1 norm of its terms). float32
allows for TF32 matmuls, which the GPU lowering may use for float32 inputs; bfloat16 for its
rounding of the inputs, of ``P`` before ``P V`` and of the output. The errors a broken kernel
makes (a wrong softmax scale, a dropped lambda, a causal mask off by one) are tens of times
larger.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import tempfile
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from diffjax import cli

from .. import attention as _kernels
from .. import cudnn, reference, splash

KINDS = ("v1", "v2", "standard")  # what each case runs: see Case
# what computes it: diffjax's fused kernels, or a vendor's attention composed into DIFF
# (diffjax.kernels.cudnn on a GPU, .splash on a TPU; on a CPU through XLA and the interpreter)
IMPLS = ("pallas", "cudnn", "splash")
VENDOR = {"gpu": "cudnn", "tpu": "splash"}  # the vendor's attention of each platform
# (atol, rtol) of the output and of the gradients; lambda's gradient by the L1 norm of its terms
TOLERANCES = {
    "float32": dict(value=(1e-5, 2e-3), grad=(1e-5, 5e-3), dlam=(1e-5, 5e-3)),
    "bfloat16": dict(value=(1e-3, 2e-2), grad=(1e-3, 4e-2), dlam=(1e-3, 2e-2)),
}
# the shapes every case runs: GQA (4 query heads over 2 kv heads), 2 packed segments per row,
# causal, a length that no block size divides
BATCH, SEQ, Q_HEADS, KV_HEADS = 2, 80, 4, 2
SPLASH_SEQ = 256  # Splash's blocks are multiples of 128 tokens


class KernelCheckError(RuntimeError):
    """A kernel disagreed with the reference math on this device. ``report`` holds every case."""

    def __init__(self, report: CheckReport):
        self.report = report
        failed = [r for r in report.results if not r.passed]
        super().__init__(
            f"the attention kernels disagree with the reference math on {report.device} in "
            f"{len(failed)} of {len(report.results)} cases: " + "; ".join(r.line() for r in failed)
        )


@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel configuration: ``kind`` "v1" (K1 and K2, V ``v_head_dim`` wide, a scalar
    lambda), "v2" (one key for both maps, lambda per token) or "standard" (flash_attention)."""

    kind: str
    head_dim: int
    v_head_dim: int
    dtype: str
    impl: str = "pallas"  # see IMPLS

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Case.kind: unknown {self.kind!r}; use one of {KINDS}")
        if self.dtype not in TOLERANCES:
            raise ValueError(f"Case.dtype: {self.dtype!r}; use one of {tuple(TOLERANCES)}")
        if self.impl not in IMPLS:
            raise ValueError(f"Case.impl: unknown {self.impl!r}; use one of {IMPLS}")

    @property
    def name(self) -> str:
        name = f"{self.kind} d={self.head_dim} dv={self.v_head_dim} {self.dtype}"
        return name if self.impl == "pallas" else f"{self.impl} {name}"

    @property
    def seq(self) -> int:
        return SPLASH_SEQ if self.impl == "splash" else SEQ


def _dtypes(impl: str, dtype: str) -> tuple[str, ...]:
    """A layer's compute dtype and float32 (the reference's); cuDNN takes no float32."""
    dtype = "bfloat16" if dtype == "float16" else dtype  # float16 runs like bfloat16 here
    return (dtype,) if impl == "cudnn" else tuple(dict.fromkeys(("float32", dtype)))


def standard_cases(impls: Sequence[str] = ("pallas",)) -> list[Case]:
    """The standard set: V1 (V 2d wide), V2 and standard attention at d 64 and 128, in float32
    and bfloat16, for each of ``impls``."""
    return [
        Case(kind, d, 2 * d if kind == "v1" else d, dtype, impl)
        for impl in impls
        for d in (64, 128)
        for kind in KINDS
        for dtype in _dtypes(impl, "bfloat16")
    ]


def cases_for(
    kind: str, head_dim: int, v_head_dim: int, dtype: str, impl: str = "pallas"
) -> list[Case]:
    """The cases of one layer's shapes: its compute dtype, and float32 (the reference's; not for
    cuDNN, which takes none)."""
    return [Case(kind, head_dim, v_head_dim, dt, impl) for dt in _dtypes(impl, dtype)]


@dataclasses.dataclass(frozen=True)
class CaseResult:
    case: Case
    errors: dict[str, float]  # per array: max |kernel - reference| / (atol + rtol * scale)
    worst: str  # the array with the largest ratio
    abs_error: float  # its max |kernel - reference|
    bound: float  # its atol + rtol * scale
    message: str = ""  # an exception the case raised instead of a result

    @property
    def passed(self) -> bool:
        return not self.message and all(e <= 1.0 for e in self.errors.values())

    def line(self) -> str:
        verdict = "ok  " if self.passed else "FAIL"
        if self.message:
            return f"{verdict} {self.case.name:31s} raised {self.message}"
        return (
            f"{verdict} {self.case.name:31s} worst {self.worst:4s} error {self.abs_error:.2e} "
            f"(tolerance {self.bound:.2e}, {max(self.errors.values()):.2f} of it)"
        )


@dataclasses.dataclass(frozen=True)
class CheckReport:
    device: str  # e.g. "NVIDIA H200 (gpu)" or "cpu, interpreted gpu kernel"
    versions: str  # "jax 0.10.2, jaxlib 0.10.2"
    results: tuple[CaseResult, ...]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def lines(self) -> list[str]:
        verdict = "PASS" if self.passed else "FAIL"
        n_ok = sum(r.passed for r in self.results)
        return (
            [f"kernel check on {self.device}, {self.versions}"]
            + [r.line() for r in self.results]
            + [f"{verdict}: {n_ok} of {len(self.results)} cases agree with the reference"]
        )


# ---------------------------------------------------------------------------- one case
def _inputs(case: Case, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    b, t, hq, hkv = BATCH, case.seq, Q_HEADS, KV_HEADS

    def normal(*shape, dt=case.dtype):
        return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(jnp.dtype(dt))

    seg = np.zeros((b, t), np.int32)
    seg[:, t // 3 :] = 1  # two packed sequences per row
    lam = (
        jnp.float32(rng.uniform(0.2, 0.8))
        if case.kind == "v1"
        else jnp.asarray(rng.uniform(0, 1, (b, t, hq)), jnp.float32)
    )
    return dict(
        q1=normal(b, t, hq, case.head_dim),
        k1=normal(b, t, hkv, case.head_dim),
        q2=normal(b, t, hq, case.head_dim),
        k2=normal(b, t, hkv, case.head_dim),
        v=normal(b, t, hkv, case.v_head_dim),
        lam=lam,
        segment_ids=jnp.asarray(seg),
        ct=normal(b, t, hq, case.v_head_dim, dt="float32"),
    )


def _value_and_grads(fn: Callable, args: tuple, ct) -> tuple[np.ndarray, tuple]:
    """``fn(*args)`` and the gradients of ``sum(fn(*args) * ct)``, in one compiled call."""

    def run(args, ct):
        out, vjp = jax.vjp(lambda *a: fn(*a).astype(jnp.float32), *args)
        return out, vjp(ct)

    out, grads = jax.jit(run)(args, ct)
    return np.asarray(out, np.float64), tuple(np.asarray(g, np.float64) for g in grads)


def _implementation(case: Case, interpret, backend: str | None) -> Callable:
    """The case's implementation, ``attend(q, k, v, *, second, ...)``, with its options."""
    if case.impl == "cudnn":
        return functools.partial(cudnn.attention, implementation="xla" if interpret else "cudnn")
    if case.impl == "splash":
        return functools.partial(splash.attention, interpret=interpret)
    return functools.partial(_kernels, interpret=interpret, backend=backend)


def _functions(case: Case, x: dict, interpret, backend: str | None):
    """``(names, implementation fn, reference fn, args)`` for one case."""
    masks = dict(causal=True, segment_ids=x["segment_ids"])
    attend = functools.partial(_implementation(case, interpret, backend), **masks)
    ref = functools.partial(reference.attention, scale=case.head_dim**-0.5, **masks)
    if case.kind == "standard":
        return ("out", "dq", "dk", "dv"), attend, ref, (x["q1"], x["k1"], x["v"])
    shared = case.kind == "v2"

    def two_maps(fn):
        def run(q1, k1, q2, k2, v, lam):
            return fn(q1, k1, v, second=(q2, None if shared else k2, lam))

        return run

    args = tuple(x[n] for n in ("q1", "k1", "q2", "k2", "v", "lam"))
    names = ("out", "dq1", "dk1", "dq2", "dk2", "dv", "dlam")
    return names, two_maps(attend), two_maps(ref), args


def check_case(case: Case, *, interpret=False, backend: str | None = None) -> CaseResult:
    """Run one case's kernel and the float32 reference; the errors against the tolerances."""
    x = _inputs(case)
    try:
        names, kernel, ref, args = _functions(case, x, interpret, backend)
        out, grads = _value_and_grads(kernel, args, x["ct"])
        with jax.default_matmul_precision("highest"):
            f32 = tuple(a.astype(jnp.float32) for a in args)
            ref_out, ref_grads = _value_and_grads(ref, f32, x["ct"])
            o2 = None
            if case.kind != "standard":  # dlam's terms: dO * O2
                k2 = f32[1] if case.kind == "v2" else f32[3]
                o2 = reference.dot_product_attention(
                    f32[2],
                    k2,
                    f32[4],
                    causal=True,
                    segment_ids=x["segment_ids"],
                    scale=case.head_dim**-0.5,
                )
    except Exception as e:  # a kernel that fails to lower or run fails its case
        return CaseResult(case, {}, "", 0.0, 0.0, message=f"{type(e).__name__}: {e}")
    tol = TOLERANCES[case.dtype]
    errors, worst = {}, ("", 0.0, 0.0)
    for name, got, want in zip(names, (out, *grads), (ref_out, *ref_grads)):
        atol, rtol = tol["dlam" if name == "dlam" else ("value" if name == "out" else "grad")]
        if name == "dlam":
            terms = np.sum(np.abs(np.asarray(x["ct"], np.float64) * np.asarray(o2)), axis=-1)
            scale = float(np.sum(terms) if case.kind == "v1" else np.max(terms))
        else:
            scale = max(float(np.max(np.abs(want))), 1e-6)
        err = float(np.max(np.abs(got - want))) if np.all(np.isfinite(got)) else float("inf")
        bound = atol + rtol * scale
        errors[name] = err / bound
        if errors[name] >= max(errors.values()):
            worst = (name, err, bound)
    return CaseResult(case, errors, *worst)


def run_check(
    cases: Sequence[Case] | None = None,
    *,
    interpret=False,
    backend: str | None = None,
    log: Callable[[str], None] | None = None,
) -> CheckReport:
    """Every case (default :func:`standard_cases`) on the default device; ``log`` gets each
    case's line as it finishes."""
    results = []
    for case in standard_cases() if cases is None else cases:
        results.append(check_case(case, interpret=interpret, backend=backend))
        if log is not None:
            log(results[-1].line())
    return CheckReport(device_name(interpret, backend), versions(), tuple(results))


def device_name(interpret=False, backend: str | None = None) -> str:
    platform = jax.default_backend()
    if interpret:
        return f"{platform}, interpreted {backend or ('gpu' if platform == 'cpu' else platform)} kernel"
    return f"{jax.devices()[0].device_kind} ({platform})"


def versions() -> str:
    return f"jax {jax.__version__}, jaxlib {jax.lib.__version__}"


# ---------------------------------------------------------------------------- the cache
_PASSED: set[str] = set()  # the keys passed in this process (the file is read once per shape)


def cache_path() -> str:
    """Where passed cases are remembered: ``$DIFFJAX_CACHE_DIR`` or ``~/.cache/diffjax``."""
    root = os.environ.get("DIFFJAX_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "diffjax"
    )
    return os.path.join(root, "kernel_check.json")


def cache_key(case: Case, *, interpret=False, backend: str | None = None) -> str:
    """Device kind, backend and jax/jaxlib versions, and the case: a new device, a jax upgrade or
    a new shape checks again."""
    return f"{device_name(interpret, backend)} | {versions()} | {case.name}"


def _read_cache(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _record(path: str, keys: Sequence[str]) -> None:
    """Add ``keys`` to the cache file (written whole, atomically; unwritable: not cached)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = _read_cache(path)
        data.update(dict.fromkeys(keys, "pass"))
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass


def ensure_checked(
    cases: Sequence[Case],
    *,
    interpret=False,
    backend: str | None = None,
    log: Callable[[str], None] | None = None,
) -> CheckReport | None:
    """Check the ``cases`` not yet passed on this device kind and jax version (None when every
    one had); record the passes; raise :class:`KernelCheckError` on a failure."""
    keys = {c: cache_key(c, interpret=interpret, backend=backend) for c in cases}
    if all(k in _PASSED for k in keys.values()):  # checked in this process: no file read
        return None
    path = cache_path()
    done = _read_cache(path)
    todo = [c for c in cases if keys[c] not in done]
    _PASSED.update(k for c, k in keys.items() if c not in todo)
    if not todo:
        return None
    if log is not None:
        log(f"checking the Pallas kernels on {device_name(interpret, backend)} ({len(todo)} cases)")
    report = run_check(todo, interpret=interpret, backend=backend, log=log)
    passed = [keys[r.case] for r in report.results if r.passed]
    _PASSED.update(passed)
    _record(path, passed)
    if not report.passed:
        raise KernelCheckError(report)
    return report


# ---------------------------------------------------------------------------- command line
# The command line is the one piece of the kernels that imports diffjax: diffjax.cli, the
# convention every program follows (pyproject.toml's kernels contract names this exception).
@dataclasses.dataclass(frozen=True)
class CheckSettings:
    """What ``python -m diffjax.kernels.check`` runs (``check.*``); checked at construction."""

    # run the kernels through the interpreters (on CPU: the GPU kernel, or the TPU kernel with
    # check.backend=tpu)
    interpret: bool = False
    backend: str | None = None  # which kernel (None: the device's)
    head_dim: tuple[int, ...] = ()  # only these q/k widths, comma-separated (empty: 64 and 128)
    kind: tuple[str, ...] = ()  # only these kinds, comma-separated (empty: every kind)
    dtype: tuple[str, ...] = ()  # only these dtypes, comma-separated (empty: every dtype)
    # these implementations, comma-separated (empty: the fused kernels, and on a GPU or TPU the
    # vendor's attention too: cudnn, splash)
    impl: tuple[str, ...] = ()

    def __post_init__(self):
        cli.check_fields(self)
        allowed = {"kind": KINDS, "dtype": tuple(TOLERANCES), "impl": IMPLS}
        for name, values in allowed.items():
            for value in getattr(self, name):
                if value not in values:
                    cli.fail(
                        "CheckSettings",
                        name,
                        f"unknown {name} {value!r}",
                        f"use some of {', '.join(map(repr, values))}",
                    )
        if self.backend is not None and self.backend not in BACKENDS:
            cli.fail(
                "CheckSettings",
                "backend",
                f"unknown backend {self.backend!r}",
                f"use one of {', '.join(map(repr, BACKENDS))}, or none for the device's",
            )

    def impls(self) -> tuple[str, ...]:
        """The implementations checked: as given, else the kernels and the device's vendor."""
        if self.impl:
            return self.impl
        vendor = VENDOR.get(jax.default_backend())
        return ("pallas",) if self.interpret or vendor is None else ("pallas", vendor)

    def cases(self) -> list[Case]:
        """The standard cases these settings keep."""
        return [
            c
            for c in standard_cases(self.impls())
            if (not self.head_dim or c.head_dim in self.head_dim)
            and (not self.kind or c.kind in self.kind)
            and (not self.dtype or c.dtype in self.dtype)
        ]


BACKENDS = ("gpu", "tpu")
PROG = "python -m diffjax.kernels.check"
SECTIONS = (
    cli.Section(
        "check",
        CheckSettings(),
        {"backend": BACKENDS, "kind": KINDS, "dtype": tuple(TOLERANCES), "impl": IMPLS},
    ),
)
# each old flag and what replaced it (refused with the new spelling)
RENAMED = {
    "--interpret": cli.Renamed("check.interpret=true", values="none"),
    "--backend": cli.Renamed("check.backend={}"),
    "--head-dim": cli.Renamed("check.head_dim={}", values="many"),
    "--kind": cli.Renamed("check.kind={}", values="many"),
    "--dtype": cli.Renamed("check.dtype={}", values="many"),
}


def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser(
        PROG,
        "Check the Pallas kernels against the reference math on this device.",
        SECTIONS,
        example=f"{PROG} check.interpret=true check.head_dim=64 check.dtype=float32",
    )
    try:
        _, settings = cli.parse(p, argv, SECTIONS, RENAMED)
    except cli.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    opts: CheckSettings = settings["check"]
    report = run_check(opts.cases(), interpret=opts.interpret, backend=opts.backend)
    print("\n".join(report.lines()))
    return 0 if report.passed else 1
