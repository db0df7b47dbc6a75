"""Compile the Pallas attention kernels for real GPUs and TPUs on a machine without one.

jax's deviceless AOT gives compile-only devices: a CUDA topology built from a device
description (needs the CUDA PJRT plugin matching jaxlib, ``pip install -e ".[compile]"``) and
libtpu's TPU topologies. ``jit(grad(loss)).trace(...).lower(...).compile()`` then runs the
compiler the chip would run: XLA's Triton for :mod:`diffjax.kernels.gpu` (it enforces the
shared-memory limit), Mosaic for :mod:`diffjax.kernels.tpu` (it enforces VMEM).

For each kernel (forward, dK/dV, dQ) and target this prints: compiles or the compiler's reason;
on GPUs the registers and spills (``ptxas -v`` on the PTX XLA dumped), dynamic shared memory and
threads per block (XLA's thunk sequence), and the tensor-core multiply-adds issued per visible
(query, key) pair and head (the ``wgmma``/``mma`` instructions in the PTX, their shapes, and how
many warps or warpgroups issue them, divided by the tile, times the programs per tile: 2 for
a forward split per branch); on TPUs the scoped VMEM the kernel asks for.

  python benchmarks/compile_kernels.py                       # all cases, all targets, T=8192
  python benchmarks/compile_kernels.py --targets h100 --cases v1_d128 --seq 1024
  python benchmarks/compile_kernels.py --blocks 128,64,64,128,128,64 --warps 8 --targets h100
  python benchmarks/compile_kernels.py --targets h100 --cases v1_d128 --split no   # fused
  python benchmarks/compile_kernels.py --dtype float32      # float32 inputs (bf16 by default)

``--blocks`` replaces the six tiles of the target's defaults, ``--warps`` every kernel's warps,
``--split`` the GPU forward's layout; the rest stays the target's default.

Each GPU target compiles in a child process (XLA reads its dump flag once per process), of
``$DIFFJAX_COMPILE_PYTHON`` where set: a venv holding the ``compile`` extra, so that the CUDA
plugin and libtpu stay out of the environment everything else runs in (``.ci/run`` does this).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---------------------------------------------------------------------------- targets
# Compile-only GPUs: XLA's device description (the fields the compiler reads). Limits from
# NVIDIA's CUDA C programming guide (compute capabilities table): shared memory per block with
# opt-in 227 KiB (sm_90), 163 KiB (sm_80), 99 KiB (sm_89); 64K registers per SM.
_GPU_PROTO = """
gpu_device_info {{ threads_per_block_limit: 1024 threads_per_warp: 32
  shared_memory_per_block: 49152 shared_memory_per_core: {smem_core}
  threads_per_core_limit: {threads_core} core_count: {sms} fpus_per_core: {fpus}
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {bw} l2_cache_size: {l2} clock_rate_ghz: {clock}
  device_memory_size: {mem} shared_memory_per_block_optin: {smem_block}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536 }}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 12 }}
runtime_version {{ major: 13 minor: 0 patch: 0 }}
device_description_str: "{name}"
"""


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    name: str
    arch: str  # ptxas -arch
    major: int
    minor: int
    smem_block: int  # opt-in shared memory per block, bytes
    smem_core: int
    sms: int
    fpus: int
    threads_core: int
    bw: int
    l2: int
    clock: float
    mem: int

    def proto(self) -> str:
        return _GPU_PROTO.format(**dataclasses.asdict(self))


GPU_TARGETS = {
    # H100 and H200 are the same chip for the compiler (sm_90a, 227 KiB); H200's description.
    "h100": GpuTarget(
        "NVIDIA H200",
        "sm_90a",
        9,
        0,
        232448,
        233472,
        132,
        128,
        2048,
        4_800_000_000_000,
        52428800,
        1.98,
        150754820096,
    ),
    "a100": GpuTarget(
        "NVIDIA A100-SXM4-80GB",
        "sm_80",
        8,
        0,
        166912,
        167936,
        108,
        64,
        2048,
        2_039_000_000_000,
        41943040,
        1.41,
        85899345920,
    ),
    "l4": GpuTarget(
        "NVIDIA L4",
        "sm_89",
        8,
        9,
        101376,
        102400,
        58,
        128,
        1536,
        300_000_000_000,
        50331648,
        2.04,
        24152899584,
    ),
}
TPU_TARGETS = {"v5e": "v5e:2x2", "v6e": "v6e:2x2", "v5p": "v5p:2x2x1"}  # one host; chip 0 used
TARGETS = tuple(GPU_TARGETS) + tuple(TPU_TARGETS)


# ---------------------------------------------------------------------------- cases
@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "v1" (separate k1/k2, scalar lambda), "v2" (shared K, per-token lambda), "std"
    d: int
    dv: int

    def macs_per_pair(self) -> dict[str, int]:
        """One-pass multiply-adds per visible (query, key) pair and head, per kernel."""
        d, dv, n = self.d, self.dv, 1 if self.kind == "std" else 2
        return {
            "fwd": n * d + n * dv,  # S_i = Q_i K_i^T, O_i += P_i V
            "dkv": n * d + dv + n * d + dv,  # S_i again, dP = dO V^T, dK_i, dV (one P.dO)
            "dq": n * d + dv + n * d,
        }  # S_i again, dP, dQ_i


CASES = {
    "v1_d64": Case("v1_d64", "v1", 64, 128),
    "v1_d128": Case("v1_d128", "v1", 128, 256),
    "v2_d128": Case("v2_d128", "v2", 128, 128),
    "std_d128": Case("std_d128", "std", 128, 128),
}


def _kernel_role(name: str) -> str:
    return "dkv" if "dkv" in name else "dq" if "dq" in name else "fwd"


# ---------------------------------------------------------------------------- compile (child)
def _loss_fn(module, case: Case, block_sizes):
    import jax.numpy as jnp

    def loss(q1, k1, q2, k2, v, lam):
        if case.kind == "std":
            o = module.flash_attention(q1, k1, v, causal=True, block_sizes=block_sizes)
        else:
            k2_ = None if case.kind == "v2" else k2
            o = module.differential_flash_attention(
                q1, k1, q2, k2_, v, lam, causal=True, block_sizes=block_sizes
            )
        return jnp.sum(o.astype(jnp.float32))

    loss.__name__ = f"compile_{case.name}"
    return loss


def _compile(
    module, device, platform: str, case: Case, seq: int, heads: int, block_sizes, dtype="bfloat16"
):
    """Compile forward + backward; returns None or the compiler's first line of complaint."""
    import jax
    import jax.numpy as jnp

    sh = jax.sharding.SingleDeviceSharding(device)
    q = jax.ShapeDtypeStruct((1, seq, heads, case.d), jnp.dtype(dtype), sharding=sh)
    v = jax.ShapeDtypeStruct((1, seq, heads, case.dv), jnp.dtype(dtype), sharding=sh)
    lam_shape = (1, seq, heads) if case.kind == "v2" else ()
    lam = jax.ShapeDtypeStruct(lam_shape, jnp.float32, sharding=sh)
    loss = _loss_fn(module, case, block_sizes)
    f = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))
    try:
        f.trace(q, q, q, q, v, lam).lower(lowering_platforms=(platform,)).compile()
    except Exception as e:  # noqa: BLE001  (the compiler's reason is the result)
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        reason = next(
            (ln for ln in lines if "RESOURCE_EXHAUSTED" in ln or "exceed" in ln),
            lines[0] if lines else type(e).__name__,
        )
        return f"{type(e).__name__}: {reason.strip()[:300]}"
    return None


def _ptxas() -> str | None:
    try:
        import nvidia

        for p in nvidia.__path__:
            for c in glob.glob(os.path.join(p, "cu1*", "bin", "ptxas")):
                return c
    except ImportError:
        pass
    return shutil.which("ptxas")


_MMA = re.compile(
    r"(wgmma\.mma_async\S*\.m(\d+)n(\d+)k(\d+)"
    r"|mma\.sync\.aligned\.m(\d+)n(\d+)k(\d+))"
)


def _ptx_stats(ptx: str, arch: str, ptxas: str | None, threads: int | None) -> dict:
    """Registers/spills (ptxas) and the MMA multiply-adds the kernel's PTX issues (once per
    tile-loop iteration): every instruction runs on every warp (mma.sync) or warpgroup (wgmma)."""
    src = open(ptx).read()
    out: dict = {}
    if ptxas:
        log = subprocess.run(
            [ptxas, "-v", f"-arch={arch}", ptx, "-o", os.devnull], capture_output=True, text=True
        ).stderr
        regs = re.search(r"Used (\d+) registers", log)
        sp = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        out["regs"] = regs and int(regs.group(1))
        out["spill"] = sp and int(sp.group(1)) + int(sp.group(2))
        if regs is None:
            out["ptxas"] = log.strip().splitlines()[-1:]
    warps = (threads or 128) // 32
    macs = wg = sync = 0
    for m in _MMA.finditer(src):
        if m.group(2):
            wg += 1
            macs += int(m.group(2)) * int(m.group(3)) * int(m.group(4)) * max(1, warps // 4)
        else:
            sync += 1
            macs += int(m.group(5)) * int(m.group(6)) * int(m.group(7)) * warps
    out.update(wgmma=wg, mma_sync=sync, macs=macs)
    return out


BLOCK_FIELDS = ("block_q", "block_k", "block_q_dkv", "block_k_dkv", "block_q_dq", "block_k_dq")


def _gpu_child(
    target_key: str,
    cases: list[str],
    seq: int,
    heads: int,
    blocks,
    warps,
    dump: str,
    split: bool | None = None,
    dtype: str = "bfloat16",
):
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_platforms", "cpu")
    from jax.experimental import topologies

    from diffjax.kernels import gpu

    tgt = GPU_TARGETS[target_key]
    topo = topologies.get_topology_desc(
        platform="cuda", target_config=tgt.proto(), topology="1x1x1"
    )
    ptxas = _ptxas()
    rows = []
    for name in cases:
        case = CASES[name]
        # The blocks a user gets on this target, with the given tiles and --warps applied (the
        # rest, warps and split_forward, stays this target's: no GPU here to pick them).
        bs = gpu.default_block_sizes(
            case.d,
            case.dv,
            differential=case.kind != "std",
            shared_keys=case.kind == "v2",
            compute_capability=(tgt.major, tgt.minor),
            itemsize=jnp.dtype(dtype).itemsize,
        )
        if blocks:
            bs = dataclasses.replace(bs, **dict(zip(BLOCK_FIELDS, blocks)))
        if split is not None:  # the forward's warps then default for that layout
            bs = dataclasses.replace(bs, split_forward=split, num_warps=None)
        if warps is not None:
            bs = dataclasses.replace(bs, num_warps=warps, num_warps_dkv=warps, num_warps_dq=warps)
        tiles = {
            "fwd": (bs.block_q, bs.block_k),
            "dkv": (bs.block_q_dkv, bs.block_k_dkv),
            "dq": (bs.block_q_dq, bs.block_k_dq),
        }
        before = set(glob.glob(os.path.join(dump, "*")))
        t0 = time.time()
        err = _compile(gpu, topo.devices[0], "cuda", case, seq, heads, bs, dtype)
        new = sorted(set(glob.glob(os.path.join(dump, "*"))) - before)
        thunks = "\n".join(open(p).read() for p in new if p.endswith("thunk_sequence.txt"))
        base = dict(target=target_key, case=name, seconds=round(time.time() - t0, 1))
        if err:
            rows.append(dict(base, kernel="(all)", error=err))
            continue
        for ptx in (p for p in new if p.endswith(".ptx")):
            m = re.search(r"\.entry (\w+)", open(ptx).read())
            if not m or "flash" not in m.group(1):
                continue
            k = m.group(1)
            tm = re.search(
                rf"\] {k} grid: (\[[^\]]*\]) threads: \[([^\]]*)\]\s+"
                rf"shared_memory: (\d+)",
                thunks,
            )
            threads = tm and math.prod(int(x) for x in tm.group(2).split(","))  # [x, y, z]
            row = dict(
                base,
                kernel=k,
                role=_kernel_role(k),
                grid=tm and tm.group(1),
                blocks="x".join(map(str, tiles[_kernel_role(k)])),
                threads=threads,
                smem=tm and int(tm.group(3)),
            )
            row.update(_ptx_stats(ptx, tgt.arch, ptxas, threads))
            # Each kernel runs its tile loop in two copies (masked and mask-free); every
            # iteration covers a (block_q x block_k) tile of (query, key) pairs. Programs per
            # tile and head: 1, or 2 where a split forward runs one branch per program.
            bq, bk = (min(x, max(16, seq)) for x in tiles[row["role"]])
            owned = bk if row["role"] == "dkv" else bq  # the block a program owns
            programs = tm and math.prod(int(x) for x in tm.group(1)[1:-1].split(","))
            per_tile = programs / (math.ceil(seq / owned) * heads) if programs else 1
            row["programs_per_tile"] = per_tile
            row["macs_per_pair"] = row["macs"] * per_tile / (2 * bq * bk)
            rows.append(row)
    return rows


def _tpu_child(
    target_key: str, cases: list[str], seq: int, heads: int, blocks, dtype: str = "bfloat16"
):
    import jax

    jax.config.update("jax_platforms", "cpu")
    from jax.experimental import topologies

    from diffjax.kernels import tpu

    topo = topologies.get_topology_desc(TPU_TARGETS[target_key], platform="tpu")
    bs = tpu.BlockSizes(*blocks) if blocks else None
    rows = []
    for name in cases:
        t0 = time.time()
        with tpu.vmem_requests() as calls:  # each kernel's VMEM estimate and scoped-VMEM request
            err = _compile(tpu, topo.devices[0], "tpu", CASES[name], seq, heads, bs, dtype)
        base = dict(target=target_key, case=name, seconds=round(time.time() - t0, 1))
        if err:
            rows.append(dict(base, kernel="(all)", error=err))
            continue
        vmem = {c.kernel: (c.estimate, c.limit) for c in calls}  # the last call of each kernel
        for k, (est, limit) in vmem.items():
            rows.append(
                dict(base, kernel=k, role=_kernel_role(k), vmem_estimate=est, vmem_limit=limit)
            )
    return rows


# ---------------------------------------------------------------------------- driver
PYTHON_ENV = "DIFFJAX_COMPILE_PYTHON"


def compiler_python() -> str:
    """The interpreter the compiles run in: ``$DIFFJAX_COMPILE_PYTHON`` (a venv holding the
    ``compile`` extra, as ``.ci/run`` makes), else this one."""
    return os.environ.get(PYTHON_ENV) or sys.executable


def _availability() -> dict[str, str | None]:
    """Why each backend cannot be compiled for by this interpreter (None: it can)."""
    import importlib.util

    def installed(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a parent package (jax_plugins) is absent
            return False

    fix = "pip install -e '.[compile]'"
    why: dict[str, str | None] = {}
    if not (installed("jax_plugins.xla_cuda13") or installed("jax_plugins.xla_cuda12")):
        why["gpu"] = f"the CUDA PJRT plugin is not installed ({fix})"
    elif _ptxas() is None:  # XLA needs it (or nvJitLink) to finish any GPU compile
        why["gpu"] = f"ptxas is not installed (nvidia-cuda-nvcc, in {fix})"
    else:
        why["gpu"] = None
    why["tpu"] = None if installed("libtpu") else f"libtpu is not installed ({fix})"
    return why


def available(python: str | None = None) -> dict[str, str | None]:
    """Why each backend cannot be compiled for by ``python`` (default: :func:`compiler_python`;
    None: it can)."""
    python = python or compiler_python()
    if python == sys.executable:  # (a venv's python links to the same binary: not realpath)
        return _availability()
    probe = (
        f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
        f"import compile_kernels; print(json.dumps(compile_kernels._availability()))"
    )
    try:
        r = subprocess.run([python, "-c", probe], capture_output=True, text=True)
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
    except OSError as e:
        r, tail = None, str(e)
    if r is None or r.returncode != 0:
        return dict.fromkeys(("gpu", "tpu"), f"{PYTHON_ENV}={python} does not run: {tail}")
    return {k: v and f"{v} in {python}" for k, v in json.loads(r.stdout).items()}


def run(
    targets,
    cases,
    seq: int,
    heads: int = 2,
    blocks=None,
    warps=None,
    keep_dumps: str | None = None,
    python: str | None = None,
    split: bool | None = None,
    dtype: str = "bfloat16",
) -> list[dict]:
    """Compile every case for every target (each target in a child process of ``python``,
    default :func:`compiler_python`); rows of results."""
    python = python or compiler_python()
    rows = []
    for t in targets:
        dump = keep_dumps and os.path.join(keep_dumps, t) or tempfile.mkdtemp(prefix=f"ck_{t}_")
        os.makedirs(dump, exist_ok=True)
        args = dict(
            target=t,
            cases=list(cases),
            seq=seq,
            heads=heads,
            blocks=blocks,
            warps=warps,
            dump=dump,
            split=split,
            dtype=dtype,
        )
        env = dict(
            os.environ,
            PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
            XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}",
            TF_CPP_MIN_LOG_LEVEL="3",
        )
        r = subprocess.run(
            [python, os.path.abspath(__file__), "--_child", json.dumps(args)],
            env=env,
            capture_output=True,
            text=True,
        )
        got = [
            json.loads(ln[len("ROW ") :]) for ln in r.stdout.splitlines() if ln.startswith("ROW ")
        ]
        if r.returncode != 0 or not got:
            tail = (r.stderr.strip().splitlines() or ["no output"])[-1][:300]
            got = [
                dict(target=t, case=c, kernel="(all)", error=f"child failed: {tail}") for c in cases
            ]
        rows += got
        if not keep_dumps:
            shutil.rmtree(dump, ignore_errors=True)
    return rows


def _fmt_row(r: dict) -> str:
    case = CASES[r["case"]]
    if r.get("error"):
        return f"| {r['target']} | {r['case']} | {r['kernel']} | FAILS: {r['error']} |||||| "
    if r["target"] in TPU_TARGETS:
        lim, est = r.get("vmem_limit"), r.get("vmem_estimate")
        return (
            f"| {r['target']} | {r['case']} | {r['kernel']} | ok | | | "
            f"{'?' if est is None else est // 1024} KiB est. (scoped limit "
            f"{'default' if lim is None else f'{lim // 1024} KiB'}) | | | |"
        )
    ideal = case.macs_per_pair()[r["role"]]
    return (
        f"| {r['target']} | {r['case']} | {r['kernel']} {r.get('blocks', '')} | ok | "
        f"{r.get('regs')} | "
        f"{r.get('spill')} | {r['smem'] // 1024 if r.get('smem') is not None else '?'} KiB | "
        f"{r.get('threads')} | {r['wgmma']} wgmma / {r['mma_sync']} mma.sync | "
        f"{r['macs_per_pair']:.0f} (one pass {ideal}) |"
    )


HEADER = (
    "| target | case | kernel | compiles | regs | spill B | smem / VMEM | threads | "
    "MMA instructions | MACs issued per visible pair |\n" + "|---" * 10 + "|"
)


def table(rows: list[dict]) -> str:
    order = {"fwd": 0, "dkv": 1, "dq": 2}
    rows = sorted(
        rows,
        key=lambda r: (
            TARGETS.index(r["target"]),
            list(CASES).index(r["case"]),
            order.get(r.get("role"), -1),
        ),
    )
    return "\n".join([HEADER] + [_fmt_row(r) for r in rows])


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--targets", default=",".join(TARGETS), help=f"comma-separated, from {', '.join(TARGETS)}"
    )
    p.add_argument("--cases", default=",".join(CASES), help=f"from {', '.join(CASES)}")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument(
        "--blocks",
        default=None,
        help="bq,bk,bq_dkv,bk_dkv,bq_dq,bk_dq (default: the kernels' defaults)",
    )
    p.add_argument("--warps", type=int, default=None, help="GPU num_warps (default: the kernel's)")
    p.add_argument(
        "--split",
        choices=("yes", "no"),
        default=None,
        help="GPU DIFF forward as one program per branch (default: the target's)",
    )
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--markdown", default=None, help="also write the table here")
    p.add_argument("--dumps", default=None, help="keep XLA's dumps (PTX, thunks) under this dir")
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._child:
        c = json.loads(a._child)
        blocks = c["blocks"]
        if c["target"] in GPU_TARGETS:
            rows = _gpu_child(
                c["target"],
                c["cases"],
                c["seq"],
                c["heads"],
                blocks,
                c["warps"],
                c["dump"],
                c["split"],
                c["dtype"],
            )
        else:
            rows = _tpu_child(c["target"], c["cases"], c["seq"], c["heads"], blocks, c["dtype"])
        for r in rows:
            print("ROW " + json.dumps(r), flush=True)
        return 0

    targets = [t for t in a.targets.split(",") if t]
    cases = [c for c in a.cases.split(",") if c]
    bad = [t for t in targets if t not in TARGETS] + [c for c in cases if c not in CASES]
    if bad:
        p.error(f"unknown target/case {bad}; targets: {TARGETS}, cases: {tuple(CASES)}")
    why = available()
    runnable = []
    for t in targets:
        reason = why["gpu" if t in GPU_TARGETS else "tpu"]
        if reason:
            print(f"skipping {t}: {reason}")
        else:
            runnable.append(t)
    blocks = [int(x) for x in a.blocks.split(",")] if a.blocks else None
    t0 = time.time()
    split = None if a.split is None else a.split == "yes"
    rows = run(
        runnable, cases, a.seq, a.heads, blocks, a.warps, a.dumps, split=split, dtype=a.dtype
    )
    text = (
        f"{a.dtype}, causal, T={a.seq}, forward+backward; blocks {a.blocks or 'default'}, "
        f"warps {a.warps or 'default'}, split forward {a.split or 'default'}\n\n" + table(rows)
    )
    print(text)
    print(f"\n{time.time() - t0:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text + "\n")
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
