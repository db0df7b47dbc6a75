"""Generation with a KV cache: :func:`generate`, and the pieces it is built from.

The cache holds, per layer, the keys and values each attention kind needs (``cache_layout()``
of the layer): the twin its ``H_kv`` key and value heads of width d; DIFF V1 its raw key heads
K1 = 2g and K2 = 2g+1 of every kv group g (width d) and the group's value, 2d wide; DIFF V2 one
key and one value per kv head, which both query heads of a pair read (the fused kernel loads each
key tile once for both maps). :func:`cache_bytes_per_token` counts it; docs/generation.md gives
the figures (a DIFF model's cache is exactly its twin's size).

**Batches of prompts of different lengths are left-padded.** Row ``b`` of a prompt ``[B, P]``
holds its ``prompt_lengths[b]`` tokens at the right end; the padding before them is never
attended to, and rotary positions count from each row's first real token (position 0), so a
row gives the same tokens whatever the other rows are. Every row then writes its next token to
the same cache slot, so one decode step serves the whole batch with a scalar slot index.

**Compiled once.** Prompt lengths and cache lengths are rounded up to ``length_bucket``, so
:func:`generate` compiles one prefill and one decode loop per (batch size, bucket, sampling
mode), and reuses them for every prompt in the bucket and every token (the loop runs inside one
compiled program; its trip count is a traced value). :data:`TRACE_COUNTS` counts the traces.

**Sharding.** Under a mesh (``jax.set_mesh``) the cache is constrained like the activations:
batch rows over ``data``/``fsdp``, kv heads over ``tensor``; a model loaded with
``load_model(..., mesh=mesh)`` decodes sharded with the same results.

**Kernels.** The attention goes through :mod:`diffjax.ops` with the layer's ``attention_impl``:
on GPU/TPU the fused Pallas kernels (``"auto"`` picks them) take the prefill (causal, with the
left padding as segment ids) and each decode step (one query against the whole cache, the
filled slots marked by ``kv_segment_ids``); on CPU the XLA path.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from diffjax import ops
from diffjax.nn.attention import CACHE_AXES
from diffjax.infra.compile_options import lazy_jit
from diffjax.config import NATURAL_ORDER, ModelConfig
from diffjax.nn.model import TransformerLM, for_runtime, make_attention
from diffjax.infra.runtime import Runtime
from diffjax.infra.sharding import constrain

# Number of times each compiled piece was traced (a trace precedes each compilation): what a
# test or a user checks to see that decoding is not recompiled per token or per prompt.
TRACE_COUNTS: collections.Counter = collections.Counter()


@struct.dataclass
class KVCache:
    """The keys and values of every layer, for a left-padded batch.

    ``layers``: one dict per layer, ``{name: [B, L, kv_heads, width]}`` (names and widths from
    the layer's ``cache_layout()``); for a model with scanned layers one dict of stacked
    arrays ``[num_layers, B, L, kv_heads, width]``. ``start`` ``[B]`` int32: the slot of each row's first real
    token (the slots before it are padding). ``index`` int32 scalar: the next slot to write, the
    same for every row. The token in slot ``s`` of row ``b`` has rotary position
    ``s - start[b]``.
    """

    layers: tuple[dict[str, jax.Array], ...]
    start: jax.Array
    index: jax.Array

    @property
    def batch_size(self) -> int:
        return self.start.shape[0]

    @property
    def max_length(self) -> int:
        """L, the number of slots."""
        return next(iter(self.layers[0].values())).shape[-3]

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for layer in self.layers for a in layer.values())


# ---------------------------------------------------------------------------- cache sizes
def cache_layout(model_or_config) -> list[dict[str, tuple[int, int]]]:
    """Per layer, the cache entries ``{name: (kv heads, width)}`` (one token, one row), as each
    attention layer's ``cache_layout()`` says (for a config, read from one abstract layer)."""
    if isinstance(model_or_config, TransformerLM) and not model_or_config.config.scan_layers:
        return [block.attn.cache_layout() for block in model_or_config.layers]
    model_or_config = getattr(model_or_config, "config", model_or_config)
    if isinstance(model_or_config, ModelConfig):
        layer = nnx.eval_shape(lambda: make_attention(model_or_config, 0, rngs=nnx.Rngs(0)))
        return [layer.cache_layout()] * model_or_config.num_layers  # the same at every depth
    raise TypeError(
        f"expected a TransformerLM or a ModelConfig, got {type(model_or_config).__name__}"
    )


def cache_bytes_per_token(model_or_config, dtype: Any = None) -> int:
    """Bytes of KV cache one token of one sequence takes, all layers (``dtype``: default the
    model's activation dtype, which the cache uses)."""
    config = getattr(model_or_config, "config", model_or_config)
    itemsize = jnp.dtype(dtype or config.dtype).itemsize
    values = sum(h * w for layer in cache_layout(model_or_config) for h, w in layer.values())
    return values * itemsize


def init_cache(
    model: TransformerLM, batch_size: int, max_length: int, start: jax.Array | None = None
) -> KVCache:
    """An empty cache of ``max_length`` slots (zeros, in the model's activation dtype), sharded
    under a mesh. ``start``: each row's first real slot (default 0)."""
    dtype = jnp.dtype(model.config.dtype)

    def zeros(layout, *lead):
        axes = (None,) * len(lead) + CACHE_AXES
        shapes = {n: (*lead, batch_size, max_length, h, w) for n, (h, w) in layout.items()}
        return {n: constrain(jnp.zeros(shape, dtype), *axes) for n, shape in shapes.items()}

    layouts = cache_layout(model)
    if model.config.scan_layers:  # one stacked cache, scanned with the layers
        layers = (zeros(layouts[0], model.config.num_layers),)
    else:
        layers = tuple(zeros(layout) for layout in layouts)
    start = jnp.zeros((batch_size,), jnp.int32) if start is None else jnp.asarray(start, jnp.int32)
    return KVCache(layers=layers, start=start, index=jnp.zeros((), jnp.int32))


# ---------------------------------------------------------------------------- prefill / step
def prefill(
    model: TransformerLM, tokens: jax.Array, max_length: int, start: jax.Array | None = None
) -> tuple[jax.Array, KVCache]:
    """Run the left-padded prompt ``tokens`` ``[B, P]`` (row ``b``'s prompt starts at slot
    ``start[b]``, default 0) into a new cache of ``max_length`` slots. Returns the logits
    ``[B, P, vocab]`` (float32; those at padded slots are meaningless) and the cache.

    Traceable (call it inside ``jax.jit``/``nnx.jit``); :func:`generate` checks its arguments.
    """
    b, p = tokens.shape
    start = jnp.zeros((b,), jnp.int32) if start is None else jnp.asarray(start, jnp.int32)
    cache = init_cache(model, b, max_length, start)
    slots = jnp.arange(p, dtype=jnp.int32)[None, :]
    positions = jnp.maximum(slots - start[:, None], 0)
    real = (slots >= start[:, None]).astype(jnp.int32)  # the segment ids: 0 pad, 1 prompt
    logits, layers = model.extend(
        tokens,
        positions,
        cache.layers,
        index=0,
        segment_ids=real,
        kv_segment_ids=_filled(start, max_length, p),
    )
    return logits, KVCache(layers=layers, start=start, index=jnp.asarray(p, jnp.int32))


def _filled(start: jax.Array, max_length: int, end) -> jax.Array:
    """``[B, L]`` int32: 1 on the slots ``start[b] <= s < end`` that hold row ``b``'s tokens."""
    slots = jnp.arange(max_length, dtype=jnp.int32)[None, :]
    return ((slots >= start[:, None]) & (slots < end)).astype(jnp.int32)


def decode_step(
    model: TransformerLM, tokens: jax.Array, cache: KVCache
) -> tuple[jax.Array, KVCache]:
    """Append one token per row (``tokens`` ``[B]``) at slot ``cache.index``: returns the next
    token's logits ``[B, vocab]`` (float32) and the cache advanced by one slot.

    Traceable. The caller keeps ``cache.index < cache.max_length`` (:func:`generate` checks the
    whole request before any compute); a full cache would overwrite its last slot.
    """
    index = cache.index
    positions = (index - cache.start)[:, None]
    ones = jnp.ones((tokens.shape[0], 1), jnp.int32)
    logits, layers = model.extend(
        tokens[:, None],
        positions,
        cache.layers,
        index=index,
        segment_ids=ones,
        kv_segment_ids=_filled(cache.start, cache.max_length, index + 1),
    )
    return logits[:, 0], cache.replace(layers=layers, index=index + 1)


# ---------------------------------------------------------------------------- sampling
def sample_logits(
    logits: jax.Array,
    rng: jax.Array | None,
    *,
    temperature: Any = 0.0,
    top_k: int | None = None,
    greedy: bool | None = None,
) -> jax.Array:
    """Next tokens ``[B]`` (int32) from logits ``[B, vocab]``: argmax when greedy
    (``temperature == 0``), else a draw from ``softmax(logits / temperature)`` restricted to the
    ``top_k`` largest logits when ``top_k`` is set. ``greedy`` overrides the test on
    ``temperature`` (which may then be traced)."""
    if greedy is None:
        greedy = float(temperature) == 0.0
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


# ---------------------------------------------------------------------------- compiled pieces
@functools.partial(lazy_jit, static_argnames=("graphdef", "max_length"))
def _prefill_jit(graphdef, state, tokens, start, *, max_length):
    TRACE_COUNTS["prefill"] += 1
    model = nnx.merge(graphdef, state)
    logits, cache = prefill(model, tokens, max_length, start)
    return logits[:, -1], cache


@functools.partial(
    lazy_jit,
    static_argnames=("graphdef", "num_slots", "greedy", "top_k"),
    donate_argnames=("cache",),
)
def _decode_jit(
    graphdef, state, cache, logits, rng, num_new, temperature, eos_id, *, num_slots, greedy, top_k
):
    """Up to ``num_new`` (traced, <= ``num_slots``) tokens from the prefill's last ``logits``:
    the first is sampled from them, each next one after a decode step. A row that has produced
    ``eos_id`` (traced; -1 for none) gets ``eos_id`` from then on, and the loop ends early once
    every row has. Returns ``[B, num_slots]`` (the first ``num_new`` columns are the tokens) and
    the cache."""
    TRACE_COUNTS["decode"] += 1
    model = nnx.merge(graphdef, state)

    def sample(i, logits):
        key = None if greedy else jax.random.fold_in(rng, i)
        return sample_logits(logits, key, temperature=temperature, top_k=top_k, greedy=greedy)

    first = sample(0, logits)
    fill = jnp.maximum(eos_id, 0)
    out = jnp.full((first.shape[0], num_slots), fill, jnp.int32).at[:, 0].set(first)

    def running(carry):
        i, _, _, done, _ = carry
        return (i < num_new) & ~jnp.all(done)

    def body(carry):
        i, out, prev, done, cache = carry
        logits, cache = decode_step(model, prev, cache)
        token = jnp.where(done, eos_id, sample(i, logits))
        return i + 1, out.at[:, i].set(token), token, done | (token == eos_id), cache

    carry = (jnp.int32(1), out, first, first == eos_id, cache)
    _, out, _, _, cache = jax.lax.while_loop(running, body, carry)
    return out, cache


# ---------------------------------------------------------------------------- generate
def _as_key(rng):
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
        return jax.random.key(int(rng))
    if isinstance(rng, jax.Array) and (
        jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
        or (rng.dtype == jnp.uint32 and rng.shape == (2,))
    ):
        return rng
    raise TypeError(
        f"rng must be a jax.random.key (or an int seed), got {type(rng).__name__} "
        f"{getattr(rng, 'dtype', '')}"
    )


def generate(
    model: TransformerLM,
    prompt,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    rng=None,
    prompt_lengths=None,
    eos_id: int | None = None,
    length_bucket: int = 64,
    runtime: Runtime | None = None,
) -> jax.Array:
    """Continue ``prompt`` ``[B, P]`` (int tokens) by ``max_new_tokens`` tokens with a KV cache.

    Returns ``[B, P + max_new_tokens]`` int32: the prompt as given, then the new tokens.
    ``temperature`` 0 is greedy (argmax; ``top_k`` and ``rng`` are then unused); above 0 each
    token is drawn from ``softmax(logits / temperature)``, over the ``top_k`` most likely tokens
    when ``top_k`` is set, with ``rng`` (a ``jax.random.key`` or an int seed; required) — the
    same ``rng`` gives the same tokens.

    ``eos_id``: once a row produces this token, the rest of its row is ``eos_id`` (and decoding
    stops when every row has); None (default) generates all ``max_new_tokens``.

    ``prompt_lengths`` ``[B]`` (default: all ``P``): rows of different lengths are **left
    padded**: row ``b``'s prompt is its last ``prompt_lengths[b]`` tokens, the columns before are
    ignored (any value), and its positions start at 0 on its first real token (see
    :func:`pad_prompts`). A request whose longest prompt plus ``max_new_tokens`` exceeds
    ``model.config.max_seq_len`` is refused before any compute.

    Lengths are rounded up to ``length_bucket`` slots, so prompts within a bucket reuse the same
    compiled prefill and decode loop. ``runtime`` (:class:`diffjax.infra.runtime.Runtime`): decode on
    its mesh, the model built for its kernel target, the batch and the cache sharded like the
    activations; where the mesh splits the sequence, the prompt's prefill runs over the
    ``context`` axis with the prompt in its natural order (whatever order the runtime's training
    batches take). None: the mesh set by the caller (``jax.set_mesh``), if any, and the model
    as built (a model built by hand runs whole sequences).
    """
    if not isinstance(model, TransformerLM):
        raise TypeError(f"generate() takes a diffjax.TransformerLM, got {type(model).__name__}")
    if runtime is not None:  # the prompt goes in as given: the natural order
        spec = dataclasses.replace(runtime.context, order=NATURAL_ORDER)
        runtime = dataclasses.replace(runtime, context=spec)
        args = dict(temperature=temperature, top_k=top_k, rng=rng, prompt_lengths=prompt_lengths)
        args.update(eos_id=eos_id, length_bucket=length_bucket)
        with runtime.activate():
            return generate(for_runtime(model, runtime), prompt, max_new_tokens, **args)
    cfg = model.config
    tokens, lengths = _check_prompt(prompt, prompt_lengths, cfg.vocab_size)
    max_new_tokens = _check_int("max_new_tokens", max_new_tokens, 0, None, "an int >= 0")
    longest = int(lengths.max())
    if longest + max_new_tokens > cfg.max_seq_len:
        raise ValueError(
            f"generate(): the longest prompt ({longest} tokens) plus max_new_tokens="
            f"{max_new_tokens} is {longest + max_new_tokens} tokens, more than the model's "
            f"max_seq_len={cfg.max_seq_len}. Fix: shorten the prompt or ask for at most "
            f"{max(cfg.max_seq_len - longest, 0)} new tokens."
        )
    greedy, temperature, key = _check_sampling(temperature, top_k, rng, cfg.vocab_size)
    if eos_id is not None:
        what = f"None or a token id in [0, {cfg.vocab_size})"
        eos_id = _check_int("eos_id", eos_id, 0, cfg.vocab_size, what)
    if not isinstance(length_bucket, int) or length_bucket < 1:
        raise ValueError(f"generate(): length_bucket must be an int >= 1, got {length_bucket!r}")
    if max_new_tokens == 0:
        return jnp.asarray(tokens, jnp.int32)
    ops.check_kernels(cfg)  # with the kernels: checked on this device first (once, cached)

    padded, start, slots = _bucketed(
        tokens, lengths, max_new_tokens, length_bucket, cfg.max_seq_len
    )
    graphdef, state = nnx.split(model)
    logits, cache = _prefill_jit(
        graphdef, state, jnp.asarray(padded), jnp.asarray(start), max_length=slots
    )
    new, _ = _decode_jit(
        graphdef,
        state,
        cache,
        logits,
        key,
        jnp.int32(max_new_tokens),
        jnp.float32(temperature),
        jnp.int32(-1 if eos_id is None else eos_id),
        num_slots=slots - padded.shape[1],
        greedy=greedy,
        top_k=None if greedy or top_k is None else int(top_k),
    )
    return jnp.concatenate([jnp.asarray(tokens, jnp.int32), new[:, :max_new_tokens]], axis=1)


def _check_prompt(prompt, prompt_lengths, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`generate`'s prompt ``[B, P]`` and each row's real length ``[B]`` (int64), checked:
    2-D integer tokens, lengths in ``[1, P]``, every real token in the vocabulary."""
    tokens = np.asarray(prompt)
    if tokens.ndim != 2 or tokens.shape[1] < 1 or tokens.shape[0] < 1:
        raise ValueError(
            f"generate(): prompt must be [batch, prompt length] with at least one "
            f"token per row, got shape {tokens.shape}. Fix: pass a 2-D int array "
            f"(one prompt: prompt[None, :])."
        )
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"generate(): prompt must hold integer tokens, got dtype {tokens.dtype}")
    b, p = tokens.shape
    if prompt_lengths is None:
        lengths = np.full((b,), p, np.int64)
    else:
        lengths = np.asarray(prompt_lengths)
        if lengths.shape != (b,) or not np.issubdtype(lengths.dtype, np.integer):
            raise ValueError(
                f"generate(): prompt_lengths must be {b} ints (one per row), got {lengths!r}"
            )
        lengths = lengths.astype(np.int64)
    if lengths.min() < 1 or lengths.max() > p:
        raise ValueError(
            f"generate(): prompt_lengths must be in [1, {p}] (each row has at least "
            f"one real token, at most the prompt's width), got {lengths.tolist()}"
        )
    real = np.arange(p)[None, :] >= (p - lengths)[:, None]
    bad = real & ((tokens < 0) | (tokens >= vocab_size))
    if bad.any():
        r, c = map(int, np.argwhere(bad)[0])
        raise ValueError(
            f"generate(): prompt token {int(tokens[r, c])} at row {r}, column {c} is "
            f"outside the vocabulary [0, {vocab_size})"
        )
    return tokens, lengths


def _check_int(name: str, value, low: int, high: int | None, what: str) -> int:
    """``value`` as an int in ``[low, high)`` (no upper bound when ``high`` is None), else a
    ValueError saying :func:`generate`'s argument ``name`` must be ``what``."""
    if (
        isinstance(value, (int, np.integer))
        and not isinstance(value, bool)
        and low <= value
        and (high is None or value < high)
    ):
        return int(value)
    raise ValueError(f"generate(): {name} must be {what}, got {value!r}")


def _check_sampling(temperature, top_k, rng, vocab_size: int):
    """(greedy, temperature as a float, the sampling key) from :func:`generate`'s arguments,
    checked: a finite temperature >= 0 (0: greedy, no key needed), ``top_k`` None or in
    ``[1, vocab_size]``, an ``rng`` when sampling."""
    temperature = float(temperature)
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(
            f"generate(): temperature must be a finite number >= 0 (0 is greedy), got {temperature}"
        )
    if top_k is not None:
        _check_int("top_k", top_k, 1, vocab_size + 1, f"None or an int in [1, {vocab_size}]")
    greedy = temperature == 0.0
    if greedy:
        return greedy, temperature, jax.random.key(0)  # unused
    if rng is None:
        raise ValueError(
            "generate(): sampling (temperature > 0) needs rng, e.g. "
            "rng=jax.random.key(0) (the same key gives the same tokens); "
            "temperature=0 is greedy and needs none"
        )
    return greedy, temperature, _as_key(rng)


def _bucketed(tokens, lengths, max_new_tokens: int, bucket: int, max_seq_len: int):
    """The prompts left-padded to a length bucket: ``(padded [B, slots_p], each row's first
    real slot [B], the cache's slots)``. The columns that are padding in every row are dropped,
    then the prompts padded again up to a bucket boundary (never past what ``max_seq_len``
    allows with ``max_new_tokens`` after them)."""
    b, p = tokens.shape
    longest = int(lengths.max())
    slots_p = min(math.ceil(longest / bucket) * bucket, max_seq_len - max_new_tokens)
    slots = min(math.ceil((slots_p + max_new_tokens) / bucket) * bucket, max_seq_len)
    padded = np.zeros((b, slots_p), np.int32)
    padded[:, slots_p - longest :] = tokens[:, p - longest :]
    start = (slots_p - lengths).astype(np.int32)
    return padded, start, slots


def pad_prompts(prompts, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens [B, P], lengths [B])`` from token sequences of different lengths, left padded
    with ``pad_id`` to the longest, as :func:`generate` takes them (``prompt_lengths=lengths``).
    """
    prompts = [np.asarray(t).reshape(-1) for t in prompts]
    if not prompts or any(t.size == 0 for t in prompts):
        raise ValueError("pad_prompts(): give at least one prompt, each with at least one token")
    width = max(t.size for t in prompts)
    out = np.full((len(prompts), width), pad_id, np.int32)
    for row, t in zip(out, prompts):
        row[width - t.size :] = t
    return out, np.array([t.size for t in prompts], np.int32)


__all__ = [
    "KVCache",
    "TRACE_COUNTS",
    "cache_bytes_per_token",
    "cache_layout",
    "decode_step",
    "generate",
    "init_cache",
    "pad_prompts",
    "prefill",
    "sample_logits",
]
