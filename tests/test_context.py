"""diffjax.ops.context: sequence-parallel attention over a "context" mesh axis (ring and all-gather,
zigzag and contiguous orders) against the reference math on the unsharded input, outputs and
gradients; the flash block math; the token orders; the errors; the ring's O(T/N) backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from kernel_cases import assert_logit_max, logit_max_oracle

from diffjax.ops import context
from diffjax.config import ConfigError
from diffjax.kernels import reference

TOL = dict(rtol=1e-5, atol=1e-5)


def context_diff(q1, k1, q2, k2, v, lam, **options):
    """Differential attention over the context axis: the two-map case of context_attention."""
    return context.context_attention(q1, k1, v, second=(q2, k2, lam), **options)


def _mesh(n: int, name: str = "context"):
    return jax.make_mesh(
        (n,), (name,), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n]
    )


def _segments(b: int, t: int, kind: str | None, seed: int = 0):
    """Packed segment ids ``[B, T]`` (2-3 segments a row) and the keys' (``"orphan"``: some
    queries carry a segment no key has, so they see nothing and get a zero output)."""
    if kind is None:
        return None, None
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t), size=1 + i % 2, replace=False))
        rows.append(np.searchsorted(cuts, np.arange(t), side="right"))
    seg = np.stack(rows).astype(np.int32)
    if kind == "packed":
        return jnp.asarray(seg), None
    q_seg = seg.copy()
    q_seg[:, t // 2 : t // 2 + 3] = 99  # no key has segment 99
    return jnp.asarray(q_seg), jnp.asarray(seg)


def _inputs(kind, b, t, hq, hkv, d, seed=0):
    ks = jax.random.split(jax.random.key(seed), 8)
    dv = 2 * d if kind == "v1" else d
    q1 = jax.random.normal(ks[0], (b, t, hq, d))
    k1 = jax.random.normal(ks[1], (b, t, hkv, d))
    q2 = jax.random.normal(ks[2], (b, t, hq, d))
    k2 = jax.random.normal(ks[3], (b, t, hkv, d))
    v = jax.random.normal(ks[4], (b, t, hkv, dv))
    w = jax.random.normal(ks[5], (b, t, hq, dv))
    if kind == "v1":
        return dict(q1=q1, k1=k1, q2=q2, k2=k2, v=v, lam=jnp.float32(0.37)), w
    if kind == "v2":
        lam = jax.random.uniform(ks[6], (b, t, hq), minval=0.1, maxval=0.9)
        return dict(q1=q1, k1=k1, q2=q2, v=v, lam=lam), w
    return dict(q=q1, k=k1, v=v), w


# (kind, impl, order, n, (Hq, Hkv), segments, causal, the ring's block_k)
CASES = [
    ("v1", "ring", "zigzag", 4, (2, 2), None, True, 4),  # 8-key blocks in 2 chunks
    ("v1", "ring", "contiguous", 2, (4, 2), "orphan", True, 3),  # 16 keys: chunks of 2
    ("v1", "allgather", "contiguous", 2, (2, 2), "packed", True, None),
    ("v2", "ring", "zigzag", 8, (4, 2), "packed", True, None),
    ("v2", "allgather", "zigzag", 4, (4, 2), None, True, None),
    ("standard", "ring", "contiguous", 4, (4, 2), "packed", True, 4),
    ("standard", "allgather", "zigzag", 8, (2, 2), "orphan", True, None),
    ("v1", "ring", "zigzag", 2, (2, 2), "packed", False, None),
]


def _case_id(c):
    kind, impl, order, n, (hq, hkv), segments, causal, block_k = c
    return (
        f"{kind}-{impl}-{order}-n{n}-h{hq}kv{hkv}-{segments or 'noseg'}"
        f"-{'causal' if causal else 'full'}" + (f"-bk{block_k}" if block_k else "")
    )


# the ring with the fused Pallas kernels as its blocks (through the interpreters): the kernel
# module, then a case as above
KERNEL_CASES = [
    ("gpu", "v1", "ring", "zigzag", 4, (2, 2), "packed", True, None),
    ("gpu", "v2", "ring", "zigzag", 2, (4, 2), "orphan", True, None),
    ("gpu", "standard", "ring", "contiguous", 4, (4, 2), "packed", True, None),
    ("gpu", "v1", "ring", "contiguous", 2, (4, 2), None, False, None),
    ("tpu", "v1", "ring", "zigzag", 2, (4, 2), "packed", True, None),
    ("tpu", "v2", "ring", "contiguous", 4, (4, 2), None, True, None),
]


@pytest.mark.parametrize(
    "kind,impl,order,n,heads,segments,causal,block_k", CASES, ids=[_case_id(c) for c in CASES]
)
def test_matches_reference(kind, impl, order, n, heads, segments, causal, block_k):
    """Outputs and gradients (q1, k1, q2, k2, v, lam; q, k, v) equal the reference's on the
    unpermuted input, to 1e-5 in float32."""
    _check_against_reference(kind, impl, order, n, heads, segments, causal, block_k)


@pytest.mark.parametrize(
    "kernel,kind,impl,order,n,heads,segments,causal,block_k",
    KERNEL_CASES,
    ids=[f"{c[0]}-{_case_id(c[1:])}" for c in KERNEL_CASES],
)
def test_kernel_ring_matches_reference(
    kernel, kind, impl, order, n, heads, segments, causal, block_k
):
    """The ring on the Pallas kernels (``kernel="gpu"`` or ``"tpu"``, interpreted): each
    block's partial outputs and log-sum-exps from the kernels, its gradients from the kernels'
    backward with the merged statistics; outputs and gradients equal the reference's to 1e-5."""
    _check_against_reference(kind, impl, order, n, heads, segments, causal, block_k, kernel)


def _check_against_reference(kind, impl, order, n, heads, segments, causal, block_k, kernel=None):
    b, t, d = 2, 32, 8
    args, w = _inputs(kind, b, t, *heads, d)
    seg, kv_seg = _segments(b, t, segments)
    perm = context.zigzag_order(t, n) if order == "zigzag" else np.arange(t)
    inv = context.inverse_order(perm)
    mesh = _mesh(n)
    names = list(args)

    def permuted(x, per_token):
        return None if x is None else (x[:, perm] if per_token else x)

    def reference_loss(*xs):
        kw = dict(zip(names, xs))
        opts = dict(causal=causal, segment_ids=seg, kv_segment_ids=kv_seg)
        if kind == "standard":
            out = reference.dot_product_attention(kw["q"], kw["k"], kw["v"], **opts)
        else:
            out = reference.differential_attention(
                kw["q1"], kw["k1"], kw["q2"], kw.get("k2"), kw["v"], kw["lam"], **opts
            )
        return jnp.sum(w * out), out

    def context_loss(*xs):
        kw = {k: permuted(x, jnp.ndim(x) > 1) for k, x in zip(names, xs)}
        opts = dict(
            mesh=mesh,
            impl=impl,
            order=order,
            causal=causal,
            segment_ids=permuted(seg, True),
            kv_segment_ids=permuted(kv_seg, True),
            block_k=block_k,
        )
        if kernel is not None:
            opts.update(kernel=kernel, interpret=True)
        if kind == "standard":
            out = context.context_attention(kw["q"], kw["k"], kw["v"], **opts)
        else:
            second = (kw["q2"], kw.get("k2"), kw["lam"])
            out = context.context_attention(kw["q1"], kw["k1"], kw["v"], second=second, **opts)
        out = out[:, inv]
        return jnp.sum(w * out), out

    argnums = tuple(range(len(names)))
    (_, want), want_grads = jax.value_and_grad(reference_loss, argnums, has_aux=True)(
        *args.values()
    )
    (_, got), grads = jax.jit(jax.value_and_grad(context_loss, argnums, has_aux=True))(
        *args.values()
    )
    np.testing.assert_allclose(got, want, **TOL)
    if segments == "orphan":
        assert np.all(np.asarray(got)[:, t // 2 : t // 2 + 3] == 0)
    for name, g, wg in zip(names, grads, want_grads):
        assert np.all(np.isfinite(g)), name
        # the scalar lam's gradient sums b*t*hq*dv products: its rounding grows with them
        np.testing.assert_allclose(g, wg, err_msg=name, **TOL)


# ---------------------------------------------------------------------------- block math
def _block_case(seed=0, t=16, hq=4, hkv=2, d=8):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (2, t, hq, d))
    k = jax.random.normal(ks[1], (2, t, hkv, d))
    v = jax.random.normal(ks[2], (2, t, hkv, 2 * d))
    return q, k, v


def test_block_attention_is_the_reference_and_merges():
    """One block over all keys is the reference; two halves merged by log-sum-exp are the
    whole, though under the causal mask the early queries see nothing in the second half
    (lse -inf, o 0, no NaN)."""
    q, k, v = _block_case()
    t = q.shape[1]
    pos = jnp.arange(t)
    o, lse = context.block_attention(q, k, v, q_pos=pos, k_pos=pos)
    np.testing.assert_allclose(o, reference.dot_product_attention(q, k, v), **TOL)
    logits, mask = reference.attention_logits(q, k)
    want_lse = jax.nn.logsumexp(jnp.where(mask[:, None], logits, -jnp.inf), axis=-1)
    np.testing.assert_allclose(lse, want_lse.transpose(0, 2, 1), **TOL)

    h = t // 2
    a = context.block_attention(q, k[:, :h], v[:, :h], q_pos=pos, k_pos=pos[:h])
    b = context.block_attention(q, k[:, h:], v[:, h:], q_pos=pos, k_pos=pos[h:])
    assert np.all(np.isneginf(b[1][:, :h])) and np.all(b[0][:, :h] == 0)
    assert not np.any(np.isnan(b[0]))
    merged = context.merge_partials(*a, *b)
    np.testing.assert_allclose(merged[0], o, **TOL)
    np.testing.assert_allclose(merged[1], lse, **TOL)
    again = context.merge_partials(*b, *a)  # order does not matter
    np.testing.assert_allclose(again[0], o, **TOL)


def test_block_attention_reads_global_positions():
    """The causal mask comes from the tokens' positions, so a permuted block is the reference
    permuted; a query that sees no key at all keeps a zero output and -inf lse when merged."""
    q, k, v = _block_case(seed=1)
    t = q.shape[1]
    perm = context.zigzag_order(t, 2)
    pos = jnp.asarray(perm)
    o, _ = context.block_attention(q[:, perm], k[:, perm], v[:, perm], q_pos=pos, k_pos=pos)
    np.testing.assert_allclose(o, reference.dot_product_attention(q, k, v)[:, perm], **TOL)

    seg = jnp.zeros((2, t), jnp.int32).at[:, 3].set(7)  # query 3 is alone in segment 7 ...
    kv_seg = jnp.zeros((2, t), jnp.int32)  # ... which no key has
    parts = [
        context.block_attention(
            q,
            k[:, s],
            v[:, s],
            q_pos=jnp.arange(t),
            k_pos=jnp.arange(t)[s],
            segment_ids=seg,
            kv_segment_ids=kv_seg[:, s],
        )
        for s in (slice(0, t // 2), slice(t // 2, t))
    ]
    o, lse = context.merge_partials(*parts[0], *parts[1])
    want = reference.dot_product_attention(q, k, v, segment_ids=seg, kv_segment_ids=kv_seg)
    np.testing.assert_allclose(o, want, **TOL)
    assert np.all(o[:, 3] == 0) and np.all(np.isneginf(lse[:, 3]))
    assert not np.any(np.isnan(o))


# ---------------------------------------------------------------------------- orders
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_zigzag_order_balances_causal_work(n):
    t = 64
    perm = context.zigzag_order(t, n)
    assert sorted(perm.tolist()) == list(range(t))
    c = t // (2 * n)
    blocks = perm.reshape(n, t // n)
    for i in range(n):
        want = np.concatenate(
            [np.arange(i * c, (i + 1) * c), np.arange((2 * n - 1 - i) * c, (2 * n - i) * c)]
        )
        np.testing.assert_array_equal(blocks[i], want)
    # every device's queries see the same number of keys under the causal mask
    work = [int(np.sum(blocks[i] + 1)) for i in range(n)]
    assert len(set(work)) == 1
    x = np.random.default_rng(0).normal(size=(2, t, 3))
    np.testing.assert_array_equal(x[:, perm][:, context.inverse_order(perm)], x)
    stripes = context.striped_order(t, n)
    assert sorted(stripes.tolist()) == list(range(t))
    assert stripes[: t // n].tolist() == list(range(0, t, n))


# ---------------------------------------------------------------------------- errors
def test_errors_name_the_field_and_the_fix():
    with pytest.raises(ConfigError, match=r"seq_len.*Fix"):
        context.zigzag_order(30, 4)
    q = jnp.zeros((1, 36, 2, 8))
    v = jnp.zeros((1, 36, 2, 16))
    mesh = _mesh(4)
    call = context_diff
    with pytest.raises(ConfigError, match=r"context\.seq_len.*2\*4.*Fix"):
        call(q, q, q, q, v, 0.5, mesh=mesh)  # 36 splits 4 ways, not 8
    with pytest.raises(ConfigError, match=r"context\.seq_len.*Fix"):
        call(
            q[:, :30],
            q[:, :30],
            q[:, :30],
            q[:, :30],
            v[:, :30],
            0.5,
            mesh=mesh,
            order="contiguous",
        )
    with pytest.raises(ConfigError, match=r"context\.impl.*'flash'.*Fix.*'ring'"):
        call(q, q, q, q, v, 0.5, mesh=mesh, impl="flash")
    with pytest.raises(ConfigError, match=r"context\.order.*'random'.*Fix.*'zigzag'"):
        context.context_attention(q, q, q, mesh=mesh, order="random")
    with pytest.raises(ConfigError, match=r"context\.axis.*'seq'.*Fix"):
        context.context_attention(q, q, q, mesh=mesh, axis="seq")
    with pytest.raises(ValueError, match="lam must be"):
        call(q, q, q, q, v, jnp.zeros((3,)), mesh=mesh)


# ---------------------------------------------------------------------------- the ring's backward
def _loss_fn(impl, mesh):
    def loss(q1, k1, q2, k2, v, lam):
        out = context_diff(q1, k1, q2, k2, v, lam, mesh=mesh, impl=impl, order="zigzag")
        return jnp.sum(out.astype(jnp.float32) ** 2)

    return jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5))


def test_ring_backward_is_a_custom_vjp_that_rotates():
    mesh = _mesh(2)
    args, _ = _inputs("v1", 1, 16, 2, 2, 8)
    fwd = jax.make_jaxpr(lambda *a: context_diff(*a, mesh=mesh, impl="ring"))(*args.values())
    assert "custom_vjp_call" in str(fwd)
    grad = str(jax.make_jaxpr(_loss_fn("ring", mesh))(*args.values()))
    assert "ppermute" in grad and "all_gather" not in grad
    assert "cond" in grad  # the chunks the causal mask hides are skipped


def test_ring_fwd_bwd_needs_less_memory_than_allgather():
    """At T=1024 on 4 devices the ring's fwd+bwd temporaries are O(T/N) per device, the
    all-gather's hold [T/N, T] maps."""
    mesh = _mesh(4)
    args, _ = _inputs("v1", 1, 1024, 2, 2, 8)
    temp = {}
    for impl in ("ring", "allgather"):
        compiled = jax.jit(_loss_fn(impl, mesh)).lower(*args.values()).compile()
        stats = compiled.memory_analysis()
        if stats is None:
            pytest.skip("this backend gives no memory analysis")
        temp[impl] = stats.temp_size_in_bytes
    assert temp["ring"] < temp["allgather"] / 2, temp


@pytest.mark.parametrize("impl", ["ring", "allgather"])
def test_per_row_positions_on_a_data_context_tensor_mesh(impl):
    """``positions [B, T]`` order each row its own way (zigzag, striped), with the batch over
    ``data`` and the heads over ``tensor``: outputs and gradients are the reference's."""
    mesh = jax.make_mesh(
        (2, 2, 2), ("data", "context", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3
    )
    b, t = 2, 16
    args, w = _inputs("v2", b, t, 4, 2, 8, seed=3)
    seg, _ = _segments(b, t, "packed", seed=1)
    perms = np.stack([context.zigzag_order(t, 2), context.striped_order(t, 2)])
    invs = np.stack([context.inverse_order(p) for p in perms])
    rows = np.arange(b)[:, None]

    def reference_loss(q1, k1, q2, v, lam):
        out = reference.differential_attention(q1, k1, q2, None, v, lam, segment_ids=seg)
        return jnp.sum(w * out), out

    def context_loss(q1, k1, q2, v, lam):
        q1, k1, q2, v, lam = (x[rows, perms] for x in (q1, k1, q2, v, lam))
        out = context_diff(
            q1,
            k1,
            q2,
            None,
            v,
            lam,
            mesh=mesh,
            impl=impl,
            positions=perms,
            batch_axes="data",
            head_axes="tensor",
            segment_ids=seg[rows, perms],
            block_k=4,
        )
        out = out[rows, invs]
        return jnp.sum(w * out), out

    argnums = (0, 1, 2, 3, 4)
    (_, want), want_grads = jax.value_and_grad(reference_loss, argnums, has_aux=True)(
        *args.values()
    )
    (_, got), grads = jax.jit(jax.value_and_grad(context_loss, argnums, has_aux=True))(
        *args.values()
    )
    np.testing.assert_allclose(got, want, **TOL)
    for name, g, wg in zip(args, grads, want_grads):
        np.testing.assert_allclose(g, wg, err_msg=name, **TOL)


# ---------------------------------------------------------------------------- logit maxes
# (kernel, kind, impl, order, n, (Hq, Hkv), segments, causal, block_k); order "striped": the
# XLA blocks masked by positions given in that order (any order works for them)
LOGIT_MAX_CASES = [
    (None, "v1", "ring", "zigzag", 4, (4, 2), "orphan", True, 2),  # 4-key blocks, 2 chunks
    (None, "standard", "ring", "striped", 2, (2, 1), "packed", True, None),
    (None, "v2", "allgather", "zigzag", 2, (4, 2), "orphan", True, None),
    ("gpu", "v1", "ring", "zigzag", 2, (4, 2), "orphan", True, None),
    ("tpu", "v2", "ring", "contiguous", 2, (2, 1), "packed", True, None),
    ("gpu", "standard", "ring", "contiguous", 2, (4, 2), "orphan", False, None),
]


@pytest.mark.parametrize(
    "kernel,kind,impl,order,n,heads,segments,causal,block_k",
    LOGIT_MAX_CASES,
    ids=[f"{c[0] or 'xla'}-{_case_id(c[1:])}" for c in LOGIT_MAX_CASES],
)
def test_logit_max_is_the_ring_running_max(
    kernel, kind, impl, order, n, heads, segments, causal, block_k
):
    """``logit_max=True``: each map's largest visible logit per row, from the ring's running
    max merged over the K/V blocks and chunks by max (XLA blocks in any order, or the
    kernels' row maxes), or from the all-gather's logits: numpy's on the unpermuted input
    (-inf for a row that sees no key), in the inputs' token order and sharded over the
    context axis like ``out``'s rows; ``out`` and every gradient are the call's without it,
    bit for bit."""
    b, t, d = 2, 16, 8
    args, w = _inputs(kind, b, t, *heads, d, seed=2)
    seg, kv_seg = _segments(b, t, segments, seed=3)
    if order == "striped":
        perm = context.striped_order(t, n)
    else:
        perm = context.zigzag_order(t, n) if order == "zigzag" else np.arange(t)
    mesh = _mesh(n)
    names = list(args)
    opts = dict(mesh=mesh, impl=impl, causal=causal, block_k=block_k)
    if order == "striped":
        opts["positions"] = jnp.asarray(perm)
    else:
        opts["order"] = order
    if kernel is not None:
        opts.update(kernel=kernel, interpret=True)
    for name, x in (("segment_ids", seg), ("kv_segment_ids", kv_seg)):
        opts[name] = None if x is None else x[:, perm]

    def loss(logit_max, *xs):
        kw = {k: x[:, perm] if jnp.ndim(x) > 1 else x for k, x in zip(names, xs)}
        if kind == "standard":
            res = context.context_attention(kw["q"], kw["k"], kw["v"], logit_max=logit_max, **opts)
        else:
            res = context_diff(
                kw["q1"],
                kw["k1"],
                kw["q2"],
                kw.get("k2"),
                kw["v"],
                kw["lam"],
                logit_max=logit_max,
                **opts,
            )
        out, maxes = res if logit_max else (res, None)
        return jnp.sum(w[:, perm] * out), (out, maxes)

    argnums = tuple(range(len(names)))
    grad = [
        jax.jit(jax.value_and_grad(lambda *xs, on=on: loss(on, *xs), argnums, has_aux=True))
        for on in (True, False)
    ]
    (_, (out, maxes)), grads = grad[0](*args.values())
    (_, (out0, none)), grads0 = grad[1](*args.values())
    assert none is None
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out0))
    for name, g, g0 in zip(names, grads, grads0):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(g0), err_msg=name)

    assert maxes.sharding.is_equivalent_to(NamedSharding(mesh, P(None, None, "context")), 4)
    q_k = (
        [("q", "k")]
        if kind == "standard"
        else [("q1", "k1"), ("q2", "k2" if kind == "v1" else "k1")]
    )
    want = np.stack(
        [
            logit_max_oracle(
                args[q],
                args[k],
                scale=d**-0.5,
                causal=causal,
                segment_ids=seg,
                kv_segment_ids=kv_seg,
            )
            for q, k in q_k
        ]
    )
    assert_logit_max(np.asarray(maxes)[:, :, context.inverse_order(perm)], want)
    if segments == "orphan":
        assert np.all(np.isneginf(want[:, :, t // 2 : t // 2 + 3]))
