"""Training-step time on CPU, per component and whole, DIFF V1 / V2 / their twins / PyTorch.

    python benchmarks/step_time.py                        # D=256, 4 layers, 4 DIFF heads, T=256, B=8
    python benchmarks/step_time.py --rounds 16 --markdown out.md
    python benchmarks/step_time.py --no-torch --components step
    taskset -c 0 python benchmarks/step_time.py      # one core for both frameworks

On a machine shared with other jobs, pin it to one core: torch's OpenMP threads wait for each
other at every op and stall badly when the cores are oversubscribed (XLA's pool less so), which
measures the load, not the code.

Every model is built from diffjax's public modules (``TransformerLM``, ``MultiheadDiffAttn``, ...,
``attention_impl="xla"``, float32) and trained by a step written as a user would write one:
``jax.value_and_grad`` of the mean cross-entropy, ``optax.adamw``, ``jax.jit`` with the state
donated and ``compiler_options=diffjax.cpu_compile_options()``. When torch is installed, the
same shapes are built in PyTorch below as the official modules compute them
(``multihead_diffattn.py``: explicit matmuls, softmax, ``A1 - lambda A2`` then one product with
V, per-head RMSNorm; pre-RMSNorm blocks, SwiGLU, untied head, ``torch.optim.AdamW``).

Components, each forward + backward (gradients of the parameters and the input) on
``[batch, seq, d_model]``: one attention layer, one SwiGLU FFN, one RMSNorm, embedding + final
norm + head + loss, the optimizer update of the whole model, and the whole train step.

Side by side: each round times ``--steps`` calls of every candidate of a component in turn, the
order reversed every other round, so whatever else the machine runs lands on all of them. The
table gives the median over rounds of the per-call time and its spread (min .. max over
rounds); the ratios are medians of the per-round ratios. ``DIFF V2 FLOP ratio`` is XLA's
cost-analysis FLOP count of the V2 step over its twin's.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from diffjax import ModelConfig, TransformerLM, twin

try:
    from diffjax import cpu_compile_options
except ImportError:  # a diffjax from before the helper (to time an older checkout)

    def cpu_compile_options(backend=None):
        return {}


COMPONENTS = ("attention", "ffn", "norm", "embed_head_loss", "optimizer", "step")


# ---------------------------------------------------------------------------- JAX candidates
def _configs(args) -> dict[str, ModelConfig]:
    common = dict(
        vocab_size=args.vocab,
        d_model=args.d_model,
        num_layers=args.layers,
        num_heads=args.heads,
        max_seq_len=max(args.seq, 16),
        attention_impl="xla",
    )
    v1 = ModelConfig(attention="diff_v1", **common)
    v2 = ModelConfig(attention="diff_v2", **common)
    return {"DIFF V1": v1, "twin V1": twin(v1), "DIFF V2": v2, "twin V2": twin(v2)}


def _jit(fn, options, **kw):
    return jax.jit(fn, compiler_options=options, **kw)


def _fwd_bwd(module, x, options):
    """jitted ``(params, x, g) -> grads of <module(x), g>`` for an NNX module."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def loss(p, x, g):
        return jnp.vdot(nnx.merge(graphdef, p, rest)(x), g)

    fn = _jit(jax.grad(loss, argnums=(0, 1)), options)
    g = jnp.ones_like(x)
    return fn, (params, x, g)


def _jax_candidates(cfg: ModelConfig, args, options) -> dict[str, tuple]:
    """component -> (jitted fn, args, donated?) for one model config."""
    model = TransformerLM(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (args.batch, args.seq)), jnp.int32)
    targets = jnp.asarray(rng.integers(0, cfg.vocab_size, (args.batch, args.seq)), jnp.int32)
    x = jnp.asarray(rng.standard_normal((args.batch, args.seq, cfg.d_model)), jnp.float32)
    out = {
        "attention": _fwd_bwd(model.layers[0].attn, x, options),
        "ffn": _fwd_bwd(model.layers[0].ffn, x, options),
        "norm": _fwd_bwd(model.layers[0].attn_norm, x, options),
    }
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def head_loss(p, tokens, targets):
        m = nnx.merge(graphdef, p, rest)
        logits = m._logits(m._embed(tokens))
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    out["embed_head_loss"] = (_jit(jax.grad(head_loss), options), (params, tokens, targets))

    def loss(p, tokens, targets):
        logits = nnx.merge(graphdef, p, rest)(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    tx = optax.adamw(1e-3, weight_decay=0.1)

    def update(state, grads):
        p, opt = state
        updates, opt = tx.update(grads, opt, p)
        return optax.apply_updates(p, updates), opt

    def step(state, tokens, targets):
        p, opt = state
        value, grads = jax.value_and_grad(loss)(p, tokens, targets)
        return update((p, opt), grads), value

    grads = jax.tree.map(jnp.ones_like, params)
    opt_state = jax.tree.map(jnp.copy, (params, tx.init(params)))  # donated: not the model's
    out["optimizer"] = (_jit(update, options, donate_argnums=0), (opt_state, grads), True)
    state = jax.tree.map(jnp.copy, (params, tx.init(params)))
    out["step"] = (_jit(step, options, donate_argnums=0), (state, tokens, targets), True)
    return out


def _flops(fn, fargs) -> float | None:
    try:
        cost = fn.lower(*fargs).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return float(cost["flops"])
    except Exception:  # noqa: BLE001 - not every backend/version reports it
        return None


# ---------------------------------------------------------------------------- PyTorch model
def _torch_candidates(cfg: ModelConfig, args) -> dict[str, Callable]:
    """The same shapes in PyTorch (``diff_v1`` as multihead_diffattn.py, or ``standard``)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    d_model, vocab, eps = cfg.d_model, cfg.vocab_size, cfg.norm_eps

    class RMSNorm(nn.Module):  # the official rms_norm.py
        def __init__(self, dim, eps=1e-5):
            super().__init__()
            self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

        def forward(self, x):
            y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
            return y.type_as(x) * self.weight

    def rotary(x, cos, sin):  # interleaved pairs, as apply_rotary_emb(interleaved=True)
        x0, x1 = x[..., 0::2], x[..., 1::2]
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2)

    def angles(t, dim):
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        a = torch.arange(t, dtype=torch.float32)[:, None] * inv
        return a.cos(), a.sin()

    class Attention(nn.Module):
        def __init__(self, depth):
            super().__init__()
            self.diff = cfg.attention == "diff_v1"
            self.h = cfg.num_heads  # DIFF heads (V1) or heads (standard)
            self.d = cfg.resolved_head_dim
            width = (2 if self.diff else 1) * self.h * self.d
            self.q_proj = nn.Linear(d_model, width, bias=False)
            self.k_proj = nn.Linear(d_model, width, bias=False)
            self.v_proj = nn.Linear(d_model, width, bias=False)
            self.out_proj = nn.Linear(width, d_model, bias=False)
            if self.diff:
                self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * depth)
                self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
                    nn.Parameter(torch.randn(self.d) * 0.1) for _ in range(4)
                )
                self.subln = RMSNorm(2 * self.d, eps=1e-5)

        def forward(self, x, cos, sin, mask):
            b, t, _ = x.shape
            nq = 2 * self.h if self.diff else self.h
            q = rotary(self.q_proj(x).view(b, t, nq, self.d), cos, sin).transpose(1, 2)
            k = rotary(self.k_proj(x).view(b, t, nq, self.d), cos, sin).transpose(1, 2)
            vd = 2 * self.d if self.diff else self.d
            v = self.v_proj(x).view(b, t, self.h, vd).transpose(1, 2)
            w = torch.matmul(q * self.d**-0.5, k.transpose(-1, -2))
            w = torch.nan_to_num(w) + mask
            w = F.softmax(w, dim=-1, dtype=torch.float32).type_as(w)
            if self.diff:
                lam = (
                    torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1).float())
                    - torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2).float())
                    + self.lambda_init
                ).type_as(q)
                w = w.view(b, self.h, 2, t, t)
                w = w[:, :, 0] - lam * w[:, :, 1]
            o = torch.matmul(w, v)
            if self.diff:
                o = self.subln(o) * (1 - self.lambda_init)
            return self.out_proj(o.transpose(1, 2).reshape(b, t, self.h * vd))

    class SwiGLU(nn.Module):
        def __init__(self):
            super().__init__()
            f = cfg.resolved_ffn_dim
            self.w1 = nn.Linear(d_model, f, bias=False)
            self.w3 = nn.Linear(d_model, f, bias=False)
            self.w2 = nn.Linear(f, d_model, bias=False)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self, depth):
            super().__init__()
            self.attn_norm, self.ffn_norm = RMSNorm(d_model, eps), RMSNorm(d_model, eps)
            self.attn, self.ffn = Attention(depth), SwiGLU()

        def forward(self, x, cos, sin, mask):
            x = x + self.attn(self.attn_norm(x), cos, sin, mask)
            return x + self.ffn(self.ffn_norm(x))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d_model)
            self.layers = nn.ModuleList([Block(i) for i in range(cfg.num_layers)])
            self.norm = RMSNorm(d_model, eps)
            self.lm_head = nn.Linear(d_model, vocab, bias=False)

        def forward(self, tokens):
            t = tokens.shape[1]
            cos, sin = angles(t, self.layers[0].attn.d)
            mask = torch.triu(torch.full((t, t), float("-inf")), 1)
            x = self.embed(tokens)
            for block in self.layers:
                x = block(x, cos, sin, mask)
            return self.lm_head(self.norm(x)).float()

    model = LM()
    rng = np.random.default_rng(0)
    tokens = torch.from_numpy(rng.integers(0, vocab, (args.batch, args.seq)))
    targets = torch.from_numpy(rng.integers(0, vocab, (args.batch, args.seq)))
    x = torch.from_numpy(rng.standard_normal((args.batch, args.seq, d_model)).astype(np.float32))
    t = args.seq
    cos, sin = angles(t, model.layers[0].attn.d)
    mask = torch.triu(torch.full((t, t), float("-inf")), 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    def fwd_bwd(fn):
        def run():
            xi = x.detach().requires_grad_(True)
            fn(xi).sum().backward()
            return xi.grad

        return run

    def head_loss():
        logits = model.lm_head(model.norm(model.embed(tokens))).float()
        F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1)).backward()

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(tokens)
        F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1)).backward()
        opt.step()

    step()  # gradients exist and the optimizer state is allocated for the "optimizer" timing
    block = model.layers[0]
    return {
        "attention": fwd_bwd(lambda xi: block.attn(xi, cos, sin, mask)),
        "ffn": fwd_bwd(block.ffn),
        "norm": fwd_bwd(block.attn_norm),
        "embed_head_loss": head_loss,
        "optimizer": opt.step,
        "step": step,
    }


# ---------------------------------------------------------------------------- timing
class _Runner:
    """One candidate: ``call()`` runs once and waits; JAX donated state is threaded through."""

    def __init__(self, fn, fargs=(), donated=False, jax_fn=True):
        self.fn, self.args, self.donated, self.jax_fn = fn, fargs, donated, jax_fn

    def call(self):
        if not self.jax_fn:
            self.fn()
            return
        out = self.fn(*self.args)
        if self.donated:  # the new state replaces the donated one
            new_state = out[0] if isinstance(out, tuple) and len(self.args) == 3 else out
            self.args = (new_state,) + tuple(self.args[1:])
        jax.block_until_ready(out)


def side_by_side(runners: dict[str, _Runner], rounds: int, steps: int) -> dict[str, list[float]]:
    """Per candidate, the per-call time (s) of each round; alternating order."""
    for r in runners.values():  # compile / warm up
        r.call()
        r.call()
    times = {name: [] for name in runners}
    names = list(runners)
    for i in range(rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            for _ in range(steps):
                runners[name].call()
            times[name].append((time.perf_counter() - t0) / steps)
    return times


def _fmt(ts: list[float]) -> str:
    return f"{1e3 * statistics.median(ts):7.1f} ms ({1e3 * min(ts):.1f} .. {1e3 * max(ts):.1f})"


def _ratio(times, a, b) -> str:
    rs = [x / y for x, y in zip(times[a], times[b])]
    return f"{statistics.median(rs):.2f}x ({min(rs):.2f} .. {max(rs):.2f})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4, help="DIFF heads (the twin of V1 has twice)")
    p.add_argument("--vocab", type=int, default=259)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=2, help="calls per candidate per round")
    p.add_argument("--components", nargs="+", default=list(COMPONENTS), choices=COMPONENTS)
    p.add_argument(
        "--models",
        nargs="+",
        default=None,
        help="subset of: DIFF V1, twin V1, DIFF V2, twin V2, torch DIFF V1, "
        "torch twin V1, DIFF V1 (YNNPACK on)",
    )
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--markdown", default=None, help="also write the table to this file")
    args = p.parse_args(argv)

    options = cpu_compile_options()
    configs = _configs(args)
    cands: dict[str, dict] = {}

    def wanted(name):
        return not args.models or name in args.models

    for name, cfg in configs.items():
        if wanted(name):
            cands[name] = {c: _Runner(*v) for c, v in _jax_candidates(cfg, args, options).items()}
    if options and wanted("DIFF V1 (YNNPACK on)"):  # the step with YNNPACK's fusions, to compare
        on = _jax_candidates(configs["DIFF V1"], args, {})
        cands["DIFF V1 (YNNPACK on)"] = {"step": _Runner(*on["step"])}
    if not args.no_torch and importlib.util.find_spec("torch") is not None:
        import torch

        for name, key in (("torch DIFF V1", "DIFF V1"), ("torch twin V1", "twin V1")):
            if wanted(name):
                tc = _torch_candidates(configs[key], args)
                cands[name] = {c: _Runner(fn, jax_fn=False) for c, fn in tc.items()}
        torch_line = f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    elif not args.no_torch:
        torch_line = "torch not installed: no PyTorch rows"
    else:
        torch_line = "PyTorch rows skipped (--no-torch)"
    flops = {
        n: _flops(cands[n]["step"].fn, cands[n]["step"].args)
        for n in ("DIFF V2", "twin V2")
        if n in cands
    }

    load0 = os.getloadavg()
    t_start = time.time()
    results: dict[str, dict[str, list[float]]] = {}
    for comp in args.components:
        runners = {n: c[comp] for n, c in cands.items() if comp in c}
        results[comp] = side_by_side(runners, args.rounds, args.steps)
        print(
            f"{comp}: " + "; ".join(f"{n} {_fmt(ts)}" for n, ts in results[comp].items()),
            flush=True,
        )
    load1 = os.getloadavg()

    names = list(cands)
    lines = [
        f"Step time, {datetime.date.today().isoformat()}, {platform.machine()} "
        f"{os.cpu_count()} CPUs ({len(os.sched_getaffinity(0))} usable here; "
        f"{platform.processor() or platform.platform()}), jax "
        f"{jax.__version__} ({jax.default_backend()}), {torch_line}; "
        f"compiler_options={options}",
        f"Shape: d_model={args.d_model}, {args.layers} layers, {args.heads} DIFF heads, "
        f"seq {args.seq}, batch {args.batch}, vocab {args.vocab}, float32, AdamW. "
        f"Median per call over {args.rounds} alternating rounds of {args.steps} calls "
        f"(min .. max over rounds); {time.time() - t_start:.0f} s; load average "
        f"{load0[0]:.1f} at the start, {load1[0]:.1f} at the end.",
        "",
        "| component | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for comp in args.components:
        row = [(_fmt(results[comp][n]).strip() if n in results[comp] else "") for n in names]
        lines.append(f"| {comp} | " + " | ".join(row) + " |")
    lines.append("")
    st = results.get("step", {})
    pairs = [
        ("DIFF V1", "torch DIFF V1"),
        ("twin V1", "torch twin V1"),
        ("DIFF V1", "twin V1"),
        ("DIFF V2", "twin V2"),
        ("DIFF V1 (YNNPACK on)", "DIFF V1"),
    ]
    for a, b in pairs:
        if a in st and b in st:
            lines.append(f"- step {a} / {b}: {_ratio(st, a, b)}")
    if len(flops) == 2 and all(flops.values()) and "DIFF V2" in st:
        lines.append(
            f"- DIFF V2 / twin V2 FLOP ratio (XLA cost analysis of the step): "
            f"{flops['DIFF V2'] / flops['twin V2']:.2f}"
        )
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
