"""Model configuration: one typed dataclass, validated at construction, and `twin()`.

Head conventions (the paper's and the official code's):

- ``attention="standard"``: ``num_heads`` heads of width ``head_dim`` (default
  ``d_model // num_heads``) over ``num_kv_heads`` key/value heads.
- ``attention="diff_v1"``: ``num_heads`` = h DIFF heads. Each has two query/key halves of
  width ``head_dim`` = d = ``d_model // (2 h)`` and a value 2d wide. The projections have the
  shapes of a standard layer with 2h heads, so the matching baseline is ``twin(config)``:
  2h heads, 2h_kv kv heads, width d, same ``d_model``.
- ``attention="diff_v2"``: ``num_heads`` = h output heads over 2h query heads of width
  ``head_dim`` = d (default ``d_model // num_heads``); query heads 2i and 2i+1 form DIFF
  pair i and share one kv group. Its twin has the same h, h_kv and d.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import math
import numbers
import textwrap
import tokenize
import types
import typing
from typing import Any, NoReturn

import numpy as np

ATTENTION_KINDS = ("standard", "diff_v1", "diff_v2")
# the attention output gate of Qiu et al. 2025 (gated attention): none, one value per head, one
# per output channel
GATES = ("none", "headwise", "elementwise")
ATTENTION_IMPLS = ("auto", "xla", "pallas", "cudnn", "splash")
# the vendors' attention and the platform each runs on (a CPU runs either's composition through
# XLA or the interpreter, for tests)
VENDOR_IMPLS = {"cudnn": "gpu", "splash": "tpu"}
CONTEXT_ATTENTIONS = ("ring", "allgather")
DTYPES = ("float32", "bfloat16", "float16")
ROPE_SCALINGS = ("none", "linear", "llama3")
# what a block keeps for the backward pass (diffjax.nn.model.remat_policy): everything, nothing
# (recompute the block), the matmul outputs, the named q/k/v projections and the attention
# output, or those names moved to host memory
REMAT_POLICIES = ("none", "full", "dots", "minimal", "minimal_offload")


class ConfigError(ValueError):
    """An inconsistent configuration. The message names the field and the fix."""


# ------------------------------------------------------------------ where attention runs
PLATFORMS = ("cpu", "gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class KernelTarget:
    """The machine attention is traced for: its ``platform`` and, for a GPU, its
    ``compute_capability`` (the GPU kernels' block sizes follow it; None: this process's GPU).
    ``attention_impl="auto"`` picks per call from the measured table
    (:func:`diffjax.ops.choose`); where nothing was measured it means the Pallas kernels on a GPU
    or TPU and the XLA math on a CPU; on a CPU the kernels run interpreted (the GPU kernel). A run takes it from its devices
    or a planner's target (:class:`diffjax.infra.runtime.Runtime`), a layer built by hand from the
    default backend when it is built: never read while tracing."""

    platform: str
    compute_capability: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.platform not in PLATFORMS:
            fail(
                "KernelTarget",
                "platform",
                f"unknown platform {self.platform!r}",
                f"use one of {', '.join(map(repr, PLATFORMS))}",
            )

    @property
    def kernel(self) -> str:
        """The Pallas kernel module it runs: ``"tpu"`` on a TPU, else ``"gpu"``."""
        return "tpu" if self.platform == "tpu" else "gpu"

    @property
    def interpret(self) -> bool:
        """Whether the kernels run interpreted (on a CPU)."""
        return self.platform == "cpu"

    def resolve(self, impl: str) -> str:
        """``"auto"`` where nothing was measured: ``"pallas"`` (GPU, TPU) or ``"xla"`` (CPU); any
        other name as it is."""
        if impl != "auto":
            return impl
        return "xla" if self.platform == "cpu" else "pallas"


# ------------------------------------------------------------------ sequence parallelism
# How a batch's tokens lie over a ``context`` mesh axis (diffjax.ops.context.order_batch): zigzag
# and striped balance the causal work over the devices, contiguous is the natural order.
TOKEN_ORDERS = ("zigzag", "striped", "contiguous")
# The orders the ring on the fused kernels can read (their masks are by index, so the blocks'
# layout must follow from the order; striped would need a mask by position).
KERNEL_ORDERS = ("zigzag", "contiguous")
RUN_TOKEN_ORDER = "zigzag"  # the order a run lays its batches out in (mesh.context_order)
NATURAL_ORDER = "contiguous"  # the tokens as given, unpermuted


@dataclasses.dataclass(frozen=True)
class ContextSpec:
    """How self-attention runs when a ``context`` mesh axis splits the sequence: ``impl``
    (``"ring"``: K/V passed round the devices; ``"allgather"``: K/V gathered whole), the
    ``order`` the tokens lie in over the axis (how the batch was laid out:
    :func:`diffjax.ops.context.order_batch`; a model built by hand sees them in the natural,
    contiguous order) and the mesh ``axis``. One value carries all three from the run to the
    batches and to the model, so they cannot disagree. Without such an axis it changes
    nothing."""

    impl: str = "ring"
    order: str = NATURAL_ORDER
    axis: str = "context"

    def __post_init__(self) -> None:
        if self.impl not in CONTEXT_ATTENTIONS:
            fail(
                "ContextSpec",
                "impl",
                f"unknown sequence-parallel attention {self.impl!r}",
                f"use one of {', '.join(map(repr, CONTEXT_ATTENTIONS))} (model.context_attention)",
            )
        if self.order not in TOKEN_ORDERS:
            fail(
                "ContextSpec",
                "order",
                f"unknown token order {self.order!r}",
                f"use one of {', '.join(map(repr, TOKEN_ORDERS))} (mesh.context_order)",
            )


def fail(section: str, field: str, problem: str, fix: str) -> NoReturn:
    """Raise ``ConfigError("<section>.<field>: <problem>. Fix: <fix>.")``."""
    raise ConfigError(f"{section}.{field}: {problem}. Fix: {fix}.")


# ------------------------------------------------------------------ typed fields
# Every config dataclass (ModelConfig, DataConfig, TrainConfig, RunConfig, MeshConfig,
# ExperimentConfig) declares its fields with these types, optionally ``| None``: int, float,
# bool, str, tuple[float, ...], or another config dataclass. check_fields() checks them at
# construction; parse_value() reads them from the command line.
_NONE_WORDS = ("none", "null")
_TRUE_WORDS, _FALSE_WORDS = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """``{field: type}`` of a config dataclass, its string annotations resolved."""
    return typing.get_type_hints(cls)


def split_scoped(overrides: list[str], scope: str) -> tuple[list[str], list[str]]:
    """``(the overrides of scope, the others)``: ``sweep.tokens=4096`` is ``sweep``'s."""
    mine = [o for o in overrides if o.strip().startswith(f"{scope}.")]
    return mine, [o for o in overrides if not o.strip().startswith(f"{scope}.")]


def apply_scoped(obj, scope: str, fields: tuple[str, ...], overrides: list[str], note: str):
    """The frozen dataclass ``obj`` with ``["scope.field=value", ...]`` applied (``fields``:
    the ones the command line may set; ``note``: where the others are set), checked by its own
    construction once all are applied. A :class:`ConfigError` names a bad key or value and the
    fix."""
    types = field_types(type(obj))
    changes = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        name = key.strip()[len(scope) + 1 :]
        if not sep or name not in fields:
            raise ConfigError(
                f"override {item!r}: not a {scope} setting. Fix: use {scope}.<field>=value with "
                f"field one of {', '.join(fields)} ({note})."
            )
        try:
            changes[name] = convert(types[name], raw, text=True)
        except ValueError as e:
            raise ConfigError(
                f"{scope}.{name}: bad value {raw!r}: {e}. Fix: give {describe_type(types[name])}."
            ) from None
    return dataclasses.replace(obj, **changes) if changes else obj


def _is_number(value: Any, kind: type) -> bool:
    return isinstance(value, kind) and not isinstance(value, (bool, np.bool_))


def convert(tp: Any, value: Any, *, text: bool = False) -> Any:
    """``value`` as type ``tp`` (numpy scalars become Python ones, an int given for a float a
    float, a list or comma-separated string for a tuple a tuple). With ``text``, strings from
    the command line are parsed too (``"3"``, ``"true"``, ``"none"``). Raises ValueError."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (text and isinstance(value, str) and value.lower() in _NONE_WORDS):
            if len(options) < len(typing.get_args(tp)):
                return None
            raise ValueError("may not be None")
        errors = []
        for option in options:
            try:
                return convert(option, value, text=text)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError("; ".join(errors))
    if value is None:
        raise ValueError("may not be None")
    if typing.get_origin(tp) is tuple:
        inner = typing.get_args(tp)[0]
        if isinstance(value, str):
            value = [v.strip() for v in value.strip("()[] ").split(",") if v.strip()]
        if isinstance(value, np.ndarray):
            value = value.tolist()
        if isinstance(value, (list, tuple)):
            return tuple(convert(inner, v, text=True) for v in value)
        raise ValueError(f"expected a comma-separated list, got {value!r}")
    if tp is bool:
        if isinstance(value, (bool, np.bool_)):
            return bool(value)
        if text and isinstance(value, str) and value.lower() in _TRUE_WORDS + _FALSE_WORDS:
            return value.lower() in _TRUE_WORDS
        raise ValueError(f"expected true or false, got {value!r}")
    if tp in (int, float):
        if _is_number(value, numbers.Integral if tp is int else numbers.Real):
            return tp(value)
        if text and isinstance(value, str):
            try:
                return tp(value.replace("_", "") if tp is int else value)
            except ValueError:
                pass
        raise ValueError(f"expected {'an integer' if tp is int else 'a number'}, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"expected a string, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if hasattr(tp, "from_text"):  # a value with a command-line spelling (a list's item)
            if isinstance(value, dict) and set(value) <= set(field_types(tp)):
                return tp(**value)  # as dataclasses.asdict wrote it (a saved config)
            if text and isinstance(value, str):
                return tp.from_text(value)
        raise ValueError(f"expected a {tp.__name__}, got {value!r}")
    raise TypeError(f"unsupported config field type {tp!r}")  # a new field's type: add it above


def describe_type(tp: Any) -> str:
    """A field type in words, for messages: ``int`` -> "an integer", ``float | None`` -> "a
    number or none", ``tuple[float, ...]`` -> "a comma-separated list of numbers"."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        words = [describe_type(a) for a in args if a is not type(None)]
        return " or ".join(words + (["none"] if type(None) in args else []))
    if typing.get_origin(tp) is tuple:
        inner = describe_type(typing.get_args(tp)[0])
        return "a comma-separated list of " + {"an integer": "integers", "a number": "numbers"}.get(
            inner, inner
        )
    words = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    if tp in words:
        return words[tp]
    if isinstance(getattr(tp, "TEXT", None), str):  # a dataclass with a command-line spelling
        return tp.TEXT
    return f"a {getattr(tp, '__name__', tp)}"


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """``{field: comment}`` of a config dataclass, read from its source: the ``# ...`` comment
    beside a field, else the comment lines right above it, joined into one line (``python
    train.py --help`` prints them). A field without either is left out; so is everything when
    the source cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
        body = ast.parse(source).body[0].body
    except (OSError, TypeError, SyntaxError, tokenize.TokenError, IndexError, AttributeError):
        return {}
    beside: dict[int, str] = {}  # line -> comment after code on that line
    alone: dict[int, str] = {}  # line -> a comment line
    for tok in tokens:
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            (alone if tok.line.lstrip().startswith("#") else beside)[tok.start[0]] = text
    out = {}
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        lines = [beside[n] for n in range(node.lineno, node.end_lineno + 1) if n in beside]
        if not lines:
            n = node.lineno - 1
            while n in alone:
                lines.insert(0, alone[n])
                n -= 1
        if lines:
            out[node.target.id] = " ".join(lines)
    return out


@dataclasses.dataclass(frozen=True)
class Allowed:
    """The values a config field allows, declared with it (:func:`declared`)."""

    choices: tuple | None = None
    what: str = "value"  # the choices' name in the error: "unknown schedule 'x'"
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # > low rather than >= low
    high_open: bool = False  # < high rather than <= high
    fix: str | None = None


def declared(
    default: Any,
    *,
    choices: tuple | None = None,
    what: str = "value",
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    fix: str | None = None,
) -> Any:
    """A config field with its default and the values it allows: one of ``choices`` (``what``
    names them in the error; for a tuple field, each of its items), or a number within the bounds ``ge``/``gt`` and ``le``/``lt``
    (``None`` passes when the field's type allows it). :func:`check_declared` enforces them with
    a "Fix:" (``fix``; default: the allowed values); ``python train.py --help`` lists the
    choices."""
    allowed = Allowed(
        choices,
        what,
        gt if gt is not None else ge,
        lt if lt is not None else le,
        gt is not None,
        lt is not None,
        fix,
    )
    return dataclasses.field(default=default, metadata={"allowed": allowed})


def allowed_values(cls: type) -> dict[str, Allowed]:
    """``{field: Allowed}`` of the fields of ``cls`` declared with :func:`declared`."""
    return {
        f.name: f.metadata["allowed"] for f in dataclasses.fields(cls) if "allowed" in f.metadata
    }


def _number(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _bounds_text(a: Allowed) -> str:
    low, high = _number(a.low) if a.low is not None else None, _number(a.high or 0)
    if a.high is None:
        return f"{'>' if a.low_open else '>='} {low}"
    if a.low is None:
        return f"{'<' if a.high_open else '<='} {high}"
    return f"in {'(' if a.low_open else '['}{low}, {high}{')' if a.high_open else ']'}"


def check_declared(config: Any, where: str | None = None) -> None:
    """Every field of ``config`` declared with :func:`declared` against the values it allows:
    a ConfigError ``"<where>.<field>: ... Fix: ..."`` (default the class's name) for the first
    that is outside them."""
    section = where or type(config).__name__
    for name, a in allowed_values(type(config)).items():
        value = getattr(config, name)
        # a tuple field's choices are those of each of its items
        unknown = (
            [v for v in (value if isinstance(value, tuple) else (value,)) if v not in a.choices]
            if a.choices is not None
            else []
        )
        if unknown:
            fail(
                section,
                name,
                f"unknown {a.what} {unknown[0]!r}",
                a.fix or f"use one of {', '.join(map(repr, a.choices))}",
            )
        if value is None or (a.low is None and a.high is None):
            continue
        below = a.low is not None and (value <= a.low if a.low_open else value < a.low)
        above = a.high is not None and (value >= a.high if a.high_open else value > a.high)
        if below or above:
            optional = type(None) in typing.get_args(field_types(type(config))[name])
            bounds = _bounds_text(a) + (" or None" if optional else "")
            fail(section, name, f"must be {bounds}, got {value}", a.fix or f"use a value {bounds}")


def check_fields(config: Any, where: str | None = None) -> None:
    """Check every field of the frozen config dataclass ``config`` against its annotation and
    store the converted value (see :func:`convert`); a wrong type raises ConfigError
    ``"<where>.<field>: expected <type>, got <type> <value>. Fix: ..."`` (``where``: default the
    class's name; a section of a config names its place, e.g. ``DataConfig.needle``)."""
    cls = type(config)
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        try:
            new = convert(field_types(cls)[f.name], value)
        except ConfigError:  # a nested config's own check: its message names the fix
            raise
        except ValueError:
            fail(
                where or cls.__name__,
                f.name,
                f"expected {f.type}, got {type(value).__name__} {value!r}",
                f"pass a value of type {f.type}",
            )
        if new is not value:
            object.__setattr__(config, f.name, new)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A rescaling of the rotary frequencies (Hugging Face's ``rope_type``), applied by
    :func:`diffjax.nn.layers.scale_inv_freq`.

    - ``"linear"``: every frequency divided by ``factor`` (position interpolation).
    - ``"llama3"``: Llama 3.1's: wavelengths longer than ``original_max_len / low_freq_factor``
      divided by ``factor``, shorter than ``original_max_len / high_freq_factor`` kept, a smooth
      blend between.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192

    def __post_init__(self):
        if self.kind not in ROPE_SCALINGS[1:]:
            raise ValueError(f"RopeScaling.kind: unknown {self.kind!r}; use 'linear' or 'llama3'")


# The byte tokenizer's special tokens (diffjax.data.tokenizer; its Hugging Face form,
# diffjax.interop.hf.byte_tokenizer_files): ids 0..255 are the bytes.
BYTE_SPECIAL_TOKENS = {"<bos>": 256, "<eos>": 257, "<pad>": 258}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only language model built from one attention kind.

    Every field is checked in ``__post_init__``; an inconsistent setting raises
    :class:`ConfigError` naming the field and the fix before any array is allocated.
    """

    vocab_size: int = declared(
        259, ge=1, fix="use a positive integer"
    )  # token ids; 259 = 256 bytes + BOS/EOS/PAD (the byte tokenizer)
    d_model: int = declared(
        256, ge=1, fix="use a positive integer"
    )  # the width of the residual stream
    num_layers: int = declared(4, ge=1, fix="use a positive integer")  # transformer blocks
    # attention heads: DIFF V1's DIFF heads (its twin has twice as many), V2's output heads,
    # standard heads (see the module doc)
    num_heads: int = declared(4, ge=1, fix="use a positive integer")
    num_kv_heads: int | None = declared(
        None, ge=1, fix="use a positive integer or None"
    )  # key/value heads (GQA); None: as many as num_heads (MHA)
    # the width of each head; None: derived from d_model and num_heads (see the module doc)
    head_dim: int | None = declared(None, ge=1, fix="use a positive integer or None")
    attention: str = declared(
        "diff_v1", choices=ATTENTION_KINDS, what="attention kind"
    )  # standard softmax attention, DIFF V1 or DIFF V2
    # the output gate of gated attention (Qiu et al. 2025): sigmoid(x W_gate) from the layer's
    # input multiplies each head's output before out_proj. "headwise": one value per head;
    # "elementwise": one per output channel of a head; "none": no gate. Any attention kind.
    gate: str = declared("none", choices=GATES, what="gate")
    max_seq_len: int = declared(
        1024, ge=1, fix="use a positive integer"
    )  # the longest sequence the model takes
    dtype: str = declared("float32", choices=DTYPES, what="dtype")  # compute (activation) dtype
    param_dtype: str = declared("float32", choices=DTYPES, what="dtype")  # parameter dtype
    # how attention is computed: "xla", "pallas" (diffjax's fused kernels), "cudnn" (NVIDIA
    # GPUs), "splash" (TPUs), or "auto": per call the fastest that can run it where the table
    # measured it (diffjax/ops/impl_table.json), else Pallas on GPU/TPU and XLA on CPU
    attention_impl: str = declared("auto", choices=ATTENTION_IMPLS, what="implementation")
    # attention over a mesh whose `context` axis splits the sequence: "ring" (K/V passed around
    # the devices, memory O(T / N)) or "allgather" (K/V gathered: simpler, for short rings)
    context_attention: str = declared(
        "ring", choices=CONTEXT_ATTENTIONS, what="sequence-parallel attention"
    )
    ffn_dim: int | None = declared(
        None, ge=1, fix="use a positive integer or None"
    )  # SwiGLU hidden width; None: 8/3 d_model up to ffn_multiple_of
    ffn_multiple_of: int = declared(
        64, ge=1, fix="use a positive integer"
    )  # the default ffn_dim is rounded up to a multiple of this
    rope_theta: float = declared(10000.0, gt=0, fix="use e.g. 10000.0")  # the rotary base
    # Rotary frequency scaling (Hugging Face's rope_type): "none", "linear" (every frequency
    # / rope_factor) or "llama3" (Llama 3.1's, with the three fields after rope_factor).
    rope_scaling: str = "none"
    rope_factor: float = 1.0  # linear and llama3: the frequencies are divided by this
    # llama3: wavelengths longer than rope_original_max_len / this are divided by rope_factor
    rope_low_freq_factor: float = 1.0
    # llama3: wavelengths shorter than rope_original_max_len / this are kept
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192  # llama3: the context length before scaling
    norm_eps: float = declared(1e-5, gt=0, fix="use e.g. 1e-5")  # RMSNorm epsilon
    tie_embeddings: bool = False  # the output projection reuses the token embedding
    init_std: float = declared(
        0.02, gt=0, fix="use e.g. 0.02"
    )  # standard deviation of the normal weight init
    # DIFF V1: one lambda_init for every layer (the paper's Table 6 ablation). None:
    # lambda_init(depth) = 0.8 - 0.6 exp(-0.3 depth).
    lambda_init: float | None = None
    diff_norm: bool = True  # DIFF V1's per-head RMSNorm (subln); false: the paper's ablation
    diff_norm_eps: float = declared(
        1e-5, gt=0, fix="use e.g. 1e-5"
    )  # its eps: 1e-5 in the official code; DiffLlama uses norm_eps
    # DIFF: the negative map's weight w is model state (a retrofit's ramp from 0 to 1, set by
    # the train step; python -m diffjax.retrofit). At w = 1 the model is plain DIFF
    ramp: bool = False
    # the blocks' parameters stacked on a leading layer axis and run with one scan: compile
    # time stays flat with depth. A checkpoint is saved in one layout; diffjax.nn.model's
    # stack_layers / unstack_layers convert a model between them.
    scan_layers: bool = False
    # rematerialization: what each block keeps for the backward pass. "none" keeps every
    # activation; "full" recomputes the block; "dots" keeps the matmul outputs; "minimal" keeps
    # the q/k/v projections and the attention output; "minimal_offload" moves those to host
    # memory (GPU/TPU). The loss and gradients do not depend on it.
    remat: str = declared("none", choices=REMAT_POLICIES, what="rematerialization policy")

    def __post_init__(self) -> None:
        check_fields(self)
        self._check_values()

    # ------------------------------------------------------------------ validation
    def _fail(self, field: str, problem: str, fix: str) -> NoReturn:
        fail("ModelConfig", field, problem, fix)

    def _check_values(self) -> None:
        check_declared(self)  # the bounds and choices declared with the fields
        if self.attention_impl == "cudnn" and self.dtype == "float32":
            self._fail(
                "attention_impl",
                "cuDNN's flash attention takes bfloat16 or float16 activations, and dtype is "
                "float32",
                "set model.dtype=bfloat16, or model.attention_impl=pallas (or auto)",
            )
        if self.ramp and self.attention == "standard":
            self._fail(
                "ramp",
                "weighs DIFF's negative map, but model.attention is 'standard'",
                "set model.attention=diff_v1 or diff_v2, or model.ramp=false",
            )
        self._check_rope_scaling()
        if self.lambda_init is not None and self.attention != "diff_v1":
            self._fail(
                "lambda_init",
                f"is a DIFF V1 setting but attention={self.attention!r}",
                "leave lambda_init=None or set attention='diff_v1'",
            )
        if not self.diff_norm and self.attention != "diff_v1":
            self._fail(
                "diff_norm",
                f"is a DIFF V1 setting but attention={self.attention!r}",
                "leave diff_norm=True or set attention='diff_v1'",
            )

        h, hkv, D = self.num_heads, self.kv_heads, self.d_model
        if self.attention == "diff_v2" and h % hkv and (2 * h) % hkv == 0:
            # 2h query heads over hkv groups of 2h/hkv heads: pairs (2i, 2i+1) stay in one
            # group iff 2h/hkv is even, i.e. iff hkv divides h.
            self._fail(
                "num_kv_heads",
                f"DIFF V2 pairs (2i, 2i+1) of the {2 * h} query heads would straddle "
                f"kv groups of {2 * h // hkv} heads with num_kv_heads={hkv}",
                f"choose num_kv_heads from {_divisors(h)} (a divisor of num_heads)",
            )
        if h % hkv:
            self._fail(
                "num_kv_heads",
                f"{hkv} kv heads do not divide num_heads={h}",
                f"choose num_kv_heads from {_divisors(h)}",
            )
        if self.attention == "standard":
            if self.head_dim is None and D % h:
                self._fail(
                    "d_model",
                    f"{D} is not divisible by num_heads={h}",
                    f"choose num_heads from {_divisors(D)} or set head_dim explicitly",
                )
        elif self.attention == "diff_v1":
            if D % (2 * h):
                self._fail(
                    "d_model",
                    f"DIFF V1 splits d_model={D} into 2*num_heads={2 * h} halves of width d, "
                    f"and {D} is not divisible by {2 * h}",
                    f"choose num_heads so that 2*num_heads divides d_model "
                    f"(num_heads in {[k for k in _divisors(D) if D % (2 * k) == 0]})",
                )
            if self.head_dim is not None and self.head_dim != D // (2 * h):
                self._fail(
                    "head_dim",
                    f"DIFF V1 fixes head_dim = d_model // (2*num_heads) = {D // (2 * h)}, "
                    f"got {self.head_dim}",
                    "leave head_dim=None for diff_v1 (the official layout fixes it)",
                )
        else:  # diff_v2
            if self.head_dim is None and D % h:
                self._fail(
                    "d_model",
                    f"{D} is not divisible by num_heads={h}",
                    f"choose num_heads from {_divisors(D)} or set head_dim explicitly",
                )
        if self.resolved_head_dim % 2:
            self._fail(
                "head_dim",
                f"rotary embedding rotates pairs of channels, so the head width must be even, "
                f"got {self.resolved_head_dim}",
                "choose d_model/num_heads (or head_dim) so that the head width is even",
            )

    def _check_rope_scaling(self) -> None:
        if self.rope_scaling not in ROPE_SCALINGS:
            self._fail(
                "rope_scaling",
                f"unknown rotary scaling {self.rope_scaling!r}",
                f"use one of {', '.join(map(repr, ROPE_SCALINGS))}",
            )
        if self.rope_scaling == "none":
            if self.rope_factor != 1.0:
                self._fail(
                    "rope_factor",
                    f"is {self.rope_factor} but rope_scaling='none'",
                    "set rope_scaling='linear' or 'llama3', or leave rope_factor=1.0",
                )
            return
        if not self.rope_factor > 0:
            self._fail("rope_factor", f"must be > 0, got {self.rope_factor}", "use e.g. 8.0")
        if self.rope_scaling == "llama3":
            lo, hi = self.rope_low_freq_factor, self.rope_high_freq_factor
            if not 0 < lo < hi:
                self._fail(
                    "rope_high_freq_factor",
                    f"llama3 scaling needs 0 < rope_low_freq_factor < rope_high_freq_factor, "
                    f"got {lo} and {hi}",
                    "use Llama 3.1's 1.0 and 4.0",
                )
            if self.rope_original_max_len < 1:
                self._fail(
                    "rope_original_max_len",
                    f"must be >= 1, got {self.rope_original_max_len}",
                    "use the pre-training context length, e.g. 8192",
                )

    # ------------------------------------------------------------------ derived values
    @property
    def rope_scaling_spec(self) -> RopeScaling | None:
        """The :class:`RopeScaling` of this config, or None."""
        if self.rope_scaling == "none":
            return None
        return RopeScaling(
            self.rope_scaling,
            self.rope_factor,
            self.rope_low_freq_factor,
            self.rope_high_freq_factor,
            self.rope_original_max_len,
        )

    @property
    def kv_heads(self) -> int:
        """The number of key/value heads (``num_kv_heads`` or ``num_heads``)."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def resolved_head_dim(self) -> int:
        """The width d of one query/key head (one half of a DIFF V1 head)."""
        if self.head_dim is not None:
            return self.head_dim
        if self.attention == "diff_v1":
            return self.d_model // (2 * self.num_heads)
        return self.d_model // self.num_heads

    @property
    def resolved_ffn_dim(self) -> int:
        """SwiGLU width: ``ffn_dim`` or 8/3 * d_model rounded up to ``ffn_multiple_of``."""
        if self.ffn_dim is not None:
            return self.ffn_dim
        hidden = int(8 * self.d_model / 3)
        m = self.ffn_multiple_of
        return m * ((hidden + m - 1) // m)

    @property
    def is_diff(self) -> bool:
        return self.attention in ("diff_v1", "diff_v2")

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def lambda_init_fn(depth: int) -> float:
    """The paper's lambda_init schedule, ``0.8 - 0.6 * exp(-0.3 * depth)`` (0-based depth)."""
    return 0.8 - 0.6 * math.exp(-0.3 * depth)


def twin(config: ModelConfig) -> ModelConfig:
    """The standard-attention twin of a DIFF config, by the paper's rules.

    - DIFF V1 with h heads, h_kv kv heads, width d: the twin has 2h heads and 2h_kv kv heads of
      width d and the same ``d_model``, so every projection has the same shape.
    - DIFF V2 with h heads, h_kv kv heads, width d: the twin has the same h, h_kv and d.

    Everything else (vocab, depth, FFN, dtype, ...) is unchanged.
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"twin() takes a ModelConfig, got {type(config).__name__}")
    common = dict(attention="standard", lambda_init=None, diff_norm=True, ramp=False)
    if config.attention == "diff_v1":
        return config.replace(
            num_heads=2 * config.num_heads,
            num_kv_heads=2 * config.kv_heads,
            head_dim=config.resolved_head_dim,
            **common,
        )
    if config.attention == "diff_v2":
        return config.replace(
            num_kv_heads=config.kv_heads, head_dim=config.resolved_head_dim, **common
        )
    raise ConfigError(
        "twin(): ModelConfig.attention is 'standard'; a twin is defined for a DIFF config. "
        "Fix: pass a config with attention='diff_v1' or 'diff_v2'."
    )
