"""Hugging Face checkpoints in and out: ``DiffLlama`` (DIFF V1) and ``Llama`` (standard attention).

A checkpoint is a directory with ``config.json`` and ``model.safetensors`` (or the shards that
``model.safetensors.index.json`` lists), on local disk or in a bucket (``gs://``, see
:mod:`diffjax.infra.storage`). Reading and writing need numpy and safetensors only; no torch, and
nothing is downloaded from the Hugging Face Hub. A checkpoint in a bucket is read through a
local temporary copy of each file (safetensors memory-maps a real file) and written to a local
temporary directory first, each file then uploaded whole: the weights first, ``config.json``
last, so a prefix holding ``config.json`` holds a whole checkpoint.

    model = diffjax.from_pretrained("ckpt/diffllama-375m")          # -> TransformerLM (diff_v1)
    model = diffjax.from_pretrained("ckpt/llama", mesh=mesh)        # placed on a mesh as read
    diffjax.save_pretrained(model, "export/")                       # transformers loads it
    diffjax.save_pretrained(model, "gs://my-bucket/export")         # the same, in a bucket

Every difference between the two layouts is a fixed permutation or a value, so both directions
are exact (up to float32 rounding of the same operations in another order):

- **Head pairs.** DiffLlama counts raw heads (``num_attention_heads`` = H = 2h) and pairs raw
  query head ``i`` with ``i + H/2`` (the halves of ``torch.chunk``); its keys pair kv head ``g``
  with ``g + H_kv/2``, and the 2d-wide value of DIFF group ``g`` is ``[v_g, v_{g + H_kv/2}]``.
  diffjax pairs adjacent raw heads (``2i, 2i+1``, as the official ``multihead_flashdiff_1.py``),
  so the rows of ``q_proj``, ``k_proj`` and ``v_proj`` are permuted head by head.
- **Rotary.** transformers rotates the half-split pairs ``(x_j, x_{j+d/2})`` (GPT-NeoX form),
  diffjax the interleaved pairs ``(x_2j, x_2j+1)`` with the same frequency ``j``: the rows within
  each query and key head are permuted (both alike, so every score ``q . k`` is unchanged).
- **The per-head norm.** DiffLlama's ``groupnorm`` is an RMSNorm over 2d *without* a weight, with
  ``eps = rms_norm_eps``: it loads as diffjax's ``subln`` with weight 1 and
  ``diff_norm_eps = rms_norm_eps``. Going out, a learned ``subln`` weight (one vector shared by
  the heads) is folded into the columns of ``o_proj``.
- **Layout.** ``nn.Linear.weight`` is ``[out, in]``; a flax kernel is ``[in, out]``.

DIFF V2, which transformers lacks, goes out as ``diff_transformer_v2``: Llama's layout (the
rotary rows permuted as above, the 2h query heads in diffjax's order: heads 2i and 2i + 1 form
pair i) plus ``lambda_proj``, with its modeling code (``diffjax/interop/remote``, torch and
transformers only) written beside the weights and named in ``auto_map``; it reads back exactly.
``tokenizer="byte"`` writes diffjax's byte tokenizer as a ``tokenizer.json``.

Any config diffjax cannot express (biases, dropout, other activations or rotary variants; a
gate on export) is refused, each with a message naming it.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Any, Iterator

import jax
import numpy as np
from flax import nnx

from diffjax.infra import sharding, storage
from diffjax.config import BYTE_SPECIAL_TOKENS, ConfigError, ModelConfig
from diffjax.nn.attention import Ramp
from diffjax.nn.model import TransformerLM, initial_rest, stack_layers, unstack_layers

MODEL_TYPES = {"diffllama": "diff_v1", "llama": "standard", "diff_transformer_v2": "diff_v2"}
ARCHITECTURES = {
    "diffllama": "DiffLlamaForCausalLM",
    "llama": "LlamaForCausalLM",
    "diff_transformer_v2": "DiffTransformerV2ForCausalLM",
}
# DIFF V2's modeling code, written beside its weights (transformers has no DIFF V2 model):
# files of diffjax/interop/remote that import torch and transformers only
REMOTE_DIR = os.path.join(os.path.dirname(__file__), "remote")
REMOTE_FILES = ("configuration_diff_transformer_v2.py", "modeling_diff_transformer_v2.py")
AUTO_MAP = {
    "AutoConfig": "configuration_diff_transformer_v2.DiffTransformerV2Config",
    "AutoModel": "modeling_diff_transformer_v2.DiffTransformerV2Model",
    "AutoModelForCausalLM": "modeling_diff_transformer_v2.DiffTransformerV2ForCausalLM",
}
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "generation_config.json",
)
# ModelConfig fields from_pretrained(..., **overrides) may set: none changes a weight's shape
# or meaning.
OVERRIDABLE = ("dtype", "param_dtype", "attention_impl", "max_seq_len", "scan_layers", "remat")
# Buffers some older checkpoints carry; they are recomputed, never read.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class PretrainedError(ConfigError):
    """A checkpoint directory diffjax cannot read, or a model it cannot write in the Hugging Face
    format. The message names the file or field and the fix."""


def _fail(where: str, problem: str, fix: str):
    raise PretrainedError(f"{where}: {problem}. Fix: {fix}.")


def _is_file(path: str) -> bool:
    return storage.path(path).is_file()


# ---------------------------------------------------------------------------- config.json
def read_config(path: str) -> dict[str, Any]:
    """The ``config.json`` of the checkpoint directory ``path`` (local or ``gs://``; checked to
    exist and parse). A bucket that does not exist or cannot be read is refused first
    (:class:`diffjax.infra.storage.StorageError`)."""
    path = os.fspath(path)
    storage.check_access(path, what="path", write=False)
    if not storage.isdir(path):
        if storage.is_remote(path):
            problem = "is not a directory (no object has this prefix)"
        elif os.path.exists(path) and not os.path.isfile(path):
            problem = "cannot be read"
        else:
            problem = "is not a directory"
        _fail(
            path,
            problem,
            "pass a directory (local or gs://) holding config.json and *.safetensors (a "
            "Hugging Face checkpoint; diffjax downloads nothing from the Hub)",
        )
    file = storage.join(path, CONFIG_FILE)
    if not _is_file(file):
        _fail(
            file,
            "does not exist",
            "pass a Hugging Face checkpoint directory (the one holding "
            "config.json and the *.safetensors weights)",
        )
    try:
        hf = storage.read_json(file)
    except (OSError, ValueError) as e:
        _fail(file, f"is not readable JSON ({e})", "restore the checkpoint's config.json")
    if not isinstance(hf, dict):
        _fail(file, "does not hold a JSON object", "restore the checkpoint's config.json")
    return hf


def _rope_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """ModelConfig's rotary fields from either layout of the rotary settings: transformers 5's
    ``rope_parameters`` or the older ``rope_theta`` + ``rope_scaling``."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        _fail(where, f"rope settings {params!r} are not a JSON object", "fix config.json")
    if any(isinstance(v, dict) for v in params.values()):
        _fail(where, "per-layer-type rotary settings", "use a checkpoint with one rotary setting")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        _fail(
            where,
            f"partial_rotary_factor={partial}: diffjax rotates the whole head",
            "use a checkpoint with partial_rotary_factor 1.0",
        )
    out: dict[str, Any] = {"rope_theta": float(theta)}
    if kind == "default":
        return out
    if kind not in ("linear", "llama3"):
        _fail(
            where,
            f"rope_type {kind!r} is not supported",
            "diffjax reads rope_type 'default', 'linear' and 'llama3'",
        )
    if "factor" not in params:
        _fail(where, f"rope_type {kind!r} without a 'factor'", "add the scaling factor")
    out.update(rope_scaling=kind, rope_factor=float(params["factor"]))
    if kind == "llama3":
        try:
            out.update(
                rope_low_freq_factor=float(params["low_freq_factor"]),
                rope_high_freq_factor=float(params["high_freq_factor"]),
                rope_original_max_len=int(
                    params.get(
                        "original_max_position_embeddings", hf.get("max_position_embeddings")
                    )
                ),
            )
        except (KeyError, TypeError) as e:
            _fail(
                where,
                f"rope_type 'llama3' lacks {e}",
                "give low_freq_factor, high_freq_factor and original_max_position_embeddings",
            )
    return out


def config_from_hf(
    hf: dict[str, Any], *, where: str = CONFIG_FILE, **overrides: Any
) -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face ``config.json`` (as a dict) of model type
    ``diffllama`` (-> ``attention="diff_v1"``) or ``llama`` (-> ``"standard"``). ``overrides``:
    any of :data:`OVERRIDABLE` (e.g. ``param_dtype="bfloat16"``). Anything diffjax cannot
    express raises :class:`PretrainedError` naming it."""
    mt = hf.get("model_type")
    if mt not in MODEL_TYPES:
        _fail(
            where,
            f"model_type {mt!r} is not supported",
            "diffjax reads 'diffllama' (DIFF V1), 'llama' (standard attention) and "
            "'diff_transformer_v2' (DIFF V2, as diffjax.save_pretrained writes it) checkpoints",
        )
    bad = sorted(set(overrides) - set(OVERRIDABLE))
    if bad:
        raise PretrainedError(
            f"from_pretrained: {', '.join(bad)} cannot be overridden (the "
            f"checkpoint fixes it). Fix: override only {', '.join(OVERRIDABLE)}."
        )
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
    ):
        if not isinstance(hf.get(key), int) or isinstance(hf.get(key), bool):
            _fail(
                where,
                f"{key} is missing or not an integer ({hf.get(key)!r})",
                "restore the checkpoint's config.json",
            )
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        _fail(
            where,
            f"hidden_act {act!r}: diffjax's feed-forward is SwiGLU (silu)",
            "use a checkpoint with hidden_act 'silu'",
        )
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            _fail(
                where,
                f"{key}=true: diffjax's projections have no bias",
                f"use a checkpoint with {key} false",
            )
    if float(hf.get("attention_dropout", 0.0) or 0.0) > 0:
        _fail(
            where,
            f"attention_dropout={hf['attention_dropout']}: diffjax has no dropout",
            "set attention_dropout to 0.0 in config.json (it only matters in training)",
        )
    D, H = hf["hidden_size"], hf["num_attention_heads"]
    Hkv = hf.get("num_key_value_heads") or H
    head_dim = hf.get("head_dim") or D // H
    eps = float(hf.get("rms_norm_eps", 1e-5 if mt == "diffllama" else 1e-6))
    kw: dict[str, Any] = dict(
        vocab_size=hf["vocab_size"],
        d_model=D,
        num_layers=hf["num_hidden_layers"],
        max_seq_len=int(hf.get("max_position_embeddings") or 2048),
        ffn_dim=hf["intermediate_size"],
        norm_eps=eps,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
        **_rope_fields(hf, where),
    )
    kw.update(_attention_fields(mt, D, H, Hkv, head_dim, eps, where))
    kw.update(overrides)
    try:
        return ModelConfig(**kw)
    except ConfigError as e:
        raise PretrainedError(f"{where}: diffjax cannot express this config ({e})") from None


def _attention_fields(
    mt: str, D: int, H: int, Hkv: int, head_dim: int, eps: float, where: str
) -> dict[str, Any]:
    """ModelConfig's attention fields of a checkpoint of model type ``mt`` with ``H`` query
    heads (``num_attention_heads``), ``Hkv`` kv heads of width ``head_dim`` and width ``D``."""
    if H % Hkv:
        _fail(
            where,
            f"num_key_value_heads={Hkv} does not divide num_attention_heads={H}",
            "restore the checkpoint's config.json",
        )
    if mt == "diffllama":
        if H % 2 or Hkv % 2:
            _fail(
                where,
                f"DiffLlama pairs heads in halves, so num_attention_heads ({H}) and "
                f"num_key_value_heads ({Hkv}) must be even",
                "fix config.json",
            )
        if head_dim * H != D:
            _fail(
                where,
                f"head_dim={head_dim} with {H} heads is not hidden_size={D}: diffjax's "
                f"DIFF V1 fixes head_dim = hidden_size / num_attention_heads",
                "use a checkpoint whose head_dim is hidden_size / num_attention_heads",
            )
        return dict(attention="diff_v1", num_heads=H // 2, num_kv_heads=Hkv // 2, diff_norm_eps=eps)
    if mt == "diff_transformer_v2":
        if H % 2:
            _fail(
                where,
                f"num_attention_heads={H} counts DIFF V2's query heads, two per output head, "
                f"so it must be even",
                "fix config.json",
            )
        return dict(attention="diff_v2", num_heads=H // 2, num_kv_heads=Hkv, head_dim=head_dim)
    return dict(attention="standard", num_heads=H, num_kv_heads=Hkv, head_dim=head_dim)


def config_from_pretrained(path: str, **overrides: Any) -> ModelConfig:
    """The :class:`ModelConfig` of the checkpoint directory ``path`` (local or ``gs://``; no
    weights are read)."""
    return config_from_hf(
        read_config(path), where=storage.join(os.fspath(path), CONFIG_FILE), **overrides
    )


def hf_config(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` (as a dict) of ``config``; refuses what the format cannot
    express (see :func:`check_exportable`)."""
    check_exportable(config)
    mt = _model_type(config)
    scaling = None
    if config.rope_scaling != "none":
        scaling = {"rope_type": config.rope_scaling, "factor": config.rope_factor}
        if config.rope_scaling == "llama3":
            scaling.update(
                low_freq_factor=config.rope_low_freq_factor,
                high_freq_factor=config.rope_high_freq_factor,
                original_max_position_embeddings=config.rope_original_max_len,
            )
    out = {
        "architectures": [ARCHITECTURES[mt]],
        "model_type": mt,
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.resolved_ffn_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": _query_heads(config),
        "num_key_value_heads": _key_heads(config),
        "head_dim": config.resolved_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": config.init_std,
        # both spellings of the rotary settings: transformers >= 5 and older readers
        "rope_theta": config.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta}
        if scaling is None
        else {**scaling, "rope_theta": config.rope_theta},
        "torch_dtype": config.param_dtype,
        "use_cache": True,
    }
    if mt == "diffllama":
        out["lambda_std_dev"] = 0.1
    else:
        out["mlp_bias"] = False
    if mt == "diff_transformer_v2":
        out["auto_map"] = AUTO_MAP
    return out


def check_exportable(config: ModelConfig) -> None:
    """Refuse a config the Hugging Face formats cannot express, naming the field."""
    if config.gate != "none":
        raise PretrainedError(
            f"save_pretrained: ModelConfig.gate={config.gate!r} (gated attention) cannot be "
            f"expressed: no exported format (DiffLlama, Llama, diffjax's DIFF V2) has an "
            f"attention output gate. Fix: keep the "
            f"diffjax checkpoint (train.py run folder, diffjax.train.load_model), or export a "
            f"model trained with model.gate=none."
        )
    if config.attention == "diff_v1":
        if config.lambda_init is not None:
            raise PretrainedError(
                f"save_pretrained: ModelConfig.lambda_init={config.lambda_init} (a fixed lambda_init) "
                f"cannot be expressed: DiffLlama always uses 0.8 - 0.6 exp(-0.3 depth). Fix: export "
                f"a model trained with lambda_init=None."
            )
        if not config.diff_norm:
            raise PretrainedError(
                "save_pretrained: ModelConfig.diff_norm=False cannot be expressed: DiffLlama always "
                "applies its per-head norm. Fix: export a model trained with diff_norm=True."
            )
        if config.diff_norm_eps != config.norm_eps:
            raise PretrainedError(
                f"save_pretrained: ModelConfig.diff_norm_eps={config.diff_norm_eps} differs from "
                f"norm_eps={config.norm_eps}, and DiffLlama uses rms_norm_eps for both. Fix: train "
                f"with diff_norm_eps equal to norm_eps."
            )


def check_ramp_done(model: TransformerLM) -> None:
    """Refuse a retrofit whose negative map's weight w has not reached 1 in every layer: the
    formats hold plain DIFF, which is w = 1."""
    values = [
        np.asarray(x, np.float32).reshape(-1) for x in jax.tree.leaves(nnx.state(model, Ramp))
    ]
    w = np.concatenate(values) if values else np.ones(1, np.float32)
    if not np.all(w == 1.0):
        raise PretrainedError(
            f"save_pretrained: this retrofitted model is mid-ramp (its negative map's weight w "
            f"is {float(np.min(w)):.4g}, and DiffLlama is DIFF at w = 1). Fix: train it past "
            f"retrofit.warmup_steps (w reaches 1), then export that checkpoint."
        )


# ---------------------------------------------------------------------------- the layout
def _pairs(n: int) -> np.ndarray:
    """``[0, n/2, 1, n/2 + 1, ...]``: item ``2i + s`` of diffjax's order is item ``i + s n/2`` of
    the half-split order (heads of a DiffLlama pair; channels of a half-rotated head)."""
    return np.stack([np.arange(n // 2), np.arange(n // 2) + n // 2], axis=-1).reshape(-1)


def row_permutation(
    num_heads: int, head_dim: int, *, pair_halves: bool, rotary: bool
) -> np.ndarray:
    """``perm``: row ``r`` of the diffjax projection (``[heads * head_dim]`` outputs) is row
    ``perm[r]`` of the Hugging Face ``weight``. ``pair_halves``: heads reordered from halves to
    adjacent pairs; ``rotary``: channels within each head from half-split to interleaved."""
    heads = _pairs(num_heads) if pair_halves else np.arange(num_heads)
    within = _pairs(head_dim) if rotary else np.arange(head_dim)
    return (heads[:, None] * head_dim + within[None, :]).reshape(-1)


# (diffjax path, Hugging Face name or None, kind). Kinds: "linear" (transpose), "q"/"k"/"v"
# (transpose and permute rows), "o" (transpose; the subln weight folds in on export), "vector"
# (as is), "ones" (DiffLlama's weightless groupnorm: loads as 1, folds into "o" on export).
def weight_table(config: ModelConfig) -> list[tuple[tuple, str | None, str]]:
    """Every parameter of a :class:`TransformerLM` of ``config`` and its Hugging Face name."""
    rows: list[tuple[tuple, str | None, str]] = [
        (("embed", "embedding"), "model.embed_tokens.weight", "vector")
    ]
    diff = config.attention == "diff_v1"
    for i in range(config.num_layers):
        a, hf = ("layers", i, "attn"), f"model.layers.{i}.self_attn"
        rows += [
            (a + ("q_proj", "kernel"), f"{hf}.q_proj.weight", "q"),
            (a + ("k_proj", "kernel"), f"{hf}.k_proj.weight", "k"),
            (a + ("v_proj", "kernel"), f"{hf}.v_proj.weight", "v"),
            (a + ("out_proj", "kernel"), f"{hf}.o_proj.weight", "o"),
        ]
        if diff:
            rows += [
                (a + (n,), f"{hf}.{n}", "vector")
                for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
            ]
            rows.append((a + ("subln", "scale"), None, "ones"))
        if config.attention == "diff_v2":
            rows.append((a + ("lambda_proj", "kernel"), f"{hf}.lambda_proj.weight", "linear"))
        m, hm = ("layers", i, "ffn"), f"model.layers.{i}.mlp"
        rows += [
            (m + ("w1", "kernel"), f"{hm}.gate_proj.weight", "linear"),
            (m + ("w3", "kernel"), f"{hm}.up_proj.weight", "linear"),
            (m + ("w2", "kernel"), f"{hm}.down_proj.weight", "linear"),
            (
                ("layers", i, "attn_norm", "scale"),
                f"model.layers.{i}.input_layernorm.weight",
                "vector",
            ),
            (
                ("layers", i, "ffn_norm", "scale"),
                f"model.layers.{i}.post_attention_layernorm.weight",
                "vector",
            ),
        ]
    rows.append((("norm", "scale"), "model.norm.weight", "vector"))
    if not config.tie_embeddings:
        rows.append((("lm_head", "kernel"), "lm_head.weight", "linear"))
    return rows


def _query_heads(config: ModelConfig) -> int:
    """The Hugging Face ``num_attention_heads``: every raw query head (2h for DIFF V1 and V2)."""
    return config.num_heads * (1 if config.attention == "standard" else 2)


def _key_heads(config: ModelConfig) -> int:
    """The Hugging Face ``num_key_value_heads`` (DiffLlama counts both keys of a pair)."""
    return config.kv_heads * (2 if config.attention == "diff_v1" else 1)


def _permutation(config: ModelConfig, kind: str) -> np.ndarray | None:
    diff = config.attention == "diff_v1"  # DiffLlama pairs heads in halves, diffjax adjacent
    d = config.resolved_head_dim
    if kind == "q":
        return row_permutation(_query_heads(config), d, pair_halves=diff, rotary=True)
    if kind == "k":
        return row_permutation(_key_heads(config), d, pair_halves=diff, rotary=True)
    if kind == "v" and diff:
        return row_permutation(2 * config.kv_heads, d, pair_halves=True, rotary=False)
    return None


def to_diffjax(config: ModelConfig, kind: str, weight: np.ndarray) -> np.ndarray:
    """A Hugging Face tensor in diffjax's layout (see :func:`weight_table` for ``kind``)."""
    if kind == "vector":
        return weight
    if weight.ndim != 2:
        raise ValueError(f"expected a 2-D [out, in] weight, got shape {weight.shape}")
    perm = _permutation(config, kind)
    if perm is not None:
        if weight.shape[0] != perm.size:
            raise ValueError(f"expected {perm.size} output rows, got shape {weight.shape}")
        weight = weight[perm]
    return weight.T


def from_diffjax(
    config: ModelConfig, kind: str, value: np.ndarray, subln: np.ndarray | None = None
) -> np.ndarray:
    """A diffjax parameter in the Hugging Face layout (the inverse of :func:`to_diffjax`);
    ``subln``: the layer's per-head norm weight, folded into ``o_proj``'s columns."""
    if kind == "vector":
        return value
    weight = value.T
    perm = _permutation(config, kind)
    if perm is not None:
        weight = weight[np.argsort(perm)]
    if kind == "o" and subln is not None:
        # out_proj(concat_i(n_i * w)) = (out_proj . diag(tile(w, h))) (concat_i n_i)
        weight = weight * np.tile(subln.astype(np.float32), config.num_heads)[None, :].astype(
            np.float32
        )
    return weight


# ---------------------------------------------------------------------------- reading
class _Reader:
    """The safetensors of a checkpoint directory: one file or the shards of an index, each
    opened once (memory-mapped) and read one tensor at a time. A file in a bucket is first
    downloaded into ``local_dir`` (when it is first needed)."""

    def __init__(self, path: str, stack: contextlib.ExitStack, local_dir: str | None = None):
        from safetensors import safe_open

        self._open = lambda f: stack.enter_context(
            safe_open(storage.download(f, local_dir), framework="numpy")
        )
        index = storage.join(path, INDEX_FILE)
        single = storage.join(path, WEIGHTS_FILE)
        self._files: dict[str, Any] = {}
        if _is_file(index):
            try:
                weight_map = storage.read_json(index)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                _fail(
                    index, f"is not a safetensors index ({e!r})", "restore the checkpoint's index"
                )
            missing = sorted(
                {v for v in weight_map.values() if not _is_file(storage.join(path, v))}
            )
            if missing:
                _fail(
                    path,
                    f"the index {INDEX_FILE} lists {', '.join(missing)}, which "
                    f"{'is' if len(missing) == 1 else 'are'} missing",
                    "copy every shard of the checkpoint into the directory",
                )
            self.where = {k: storage.join(path, v) for k, v in weight_map.items()}
        elif _is_file(single):
            handle = self._handle(single)
            self.where = {k: single for k in handle.keys()}
        else:
            other = [
                f
                for f in (
                    "pytorch_model.bin",
                    "pytorch_model.bin.index.json",
                    "model.safetensors.index.json",
                )
                if storage.exists(storage.join(path, f))
            ]
            _fail(
                path,
                f"holds no {WEIGHTS_FILE} or {INDEX_FILE}"
                + (f" (only {', '.join(other)})" if other else ""),
                "save the weights as safetensors (transformers: model.save_pretrained(path), "
                "the default) next to config.json",
            )

    def _handle(self, file: str):
        if file not in self._files:
            self._files[file] = self._open(file)
        return self._files[file]

    def get(self, name: str) -> np.ndarray:
        return self._handle(self.where[name]).get_tensor(name)


def from_pretrained(
    path: str, *, mesh: jax.sharding.Mesh | None = None, rules: Any = None, **overrides: Any
) -> TransformerLM:
    """The :class:`TransformerLM` of a Hugging Face checkpoint directory (``diffllama`` ->
    DIFF V1, ``llama`` -> standard attention), with the same logits.

    ``path``: a directory with ``config.json`` and ``model.safetensors`` or a sharded
    ``model.safetensors.index.json``, local or in a bucket (``gs://``: each weights file is
    downloaded to a temporary directory, deleted on return). ``mesh``: place every parameter on it by its logical axes
    (``rules``: default :data:`diffjax.infra.sharding.DEFAULT_RULES`) as it is read, one tensor at a
    time, so a checkpoint larger than one device's memory loads onto an fsdp mesh; without a
    mesh the parameters go to the default device. ``overrides``: ``dtype``, ``param_dtype``
    (default float32: the checkpoint's bfloat16 weights are upcast exactly),
    ``attention_impl``, ``max_seq_len``. Raises :class:`PretrainedError` (a
    :class:`diffjax.ConfigError`) naming the file, tensor or field, before anything is placed;
    a bucket that does not exist or cannot be read, :class:`diffjax.infra.storage.StorageError`
    before anything is read.
    """
    path = os.fspath(path)
    config = config_from_pretrained(path, **overrides)
    if config.scan_layers:  # read layer by layer, then stacked (and placed again on the mesh)
        unrolled = from_pretrained(
            path, mesh=mesh, rules=rules, **{**overrides, "scan_layers": False}
        )
        model = stack_layers(unrolled)
        if mesh is not None:
            state = nnx.state(model)
            nnx.update(model, jax.device_put(state, sharding.tree_shardings(state, mesh, rules)))
        return model
    abstract = nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0)))
    graphdef, params, _ = nnx.split(abstract, nnx.Param, ...)
    table = {key: (name, kind) for key, name, kind in weight_table(config)}
    with contextlib.ExitStack() as stack:
        local_dir = None
        if storage.is_remote(path):
            local_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="diffjax-hf-"))
        reader = _Reader(path, stack, local_dir)
        needed = {name for name, _ in table.values() if name is not None}
        present = set(reader.where)
        missing = sorted(needed - present)
        extra = sorted(
            n
            for n in present - needed
            if not n.endswith(_IGNORED_SUFFIXES)
            and not (config.tie_embeddings and n == "lm_head.weight")
        )
        if missing or extra:
            parts = ([f"missing {_some(missing)}"] if missing else []) + (
                [f"unexpected {_some(extra)}"] if extra else []
            )
            _fail(
                path,
                f"the weights do not match its config.json ({'; '.join(parts)})",
                "use the weights written with this config.json (a checkpoint of "
                f"{ARCHITECTURES[_model_type(config)]})",
            )
        shardings = sharding.tree_shardings(params, mesh, rules) if mesh is not None else None

        def load(key_path, var, shard=None):
            key = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in key_path)
            if key not in table:  # pragma: no cover - weight_table covers every parameter
                raise AssertionError(f"no Hugging Face name for diffjax parameter {key}")
            name, kind = table[key]
            if kind == "ones":
                host = np.ones(var.shape, np.float32)
            else:
                raw = reader.get(name)
                expect = tuple(var.shape)[::-1] if kind != "vector" else tuple(var.shape)
                if tuple(raw.shape) != expect:  # (the permutations keep shapes)
                    _fail(
                        path,
                        f"tensor {name} has shape {tuple(raw.shape)}, the config needs {expect}",
                        "use the weights written with this config.json",
                    )
                host = to_diffjax(config, kind, raw)
            host = np.asarray(host).astype(var.dtype)
            if shard is None:
                value = jax.device_put(host)
            else:
                value = jax.make_array_from_callback(host.shape, shard, lambda idx: host[idx])
            return var.replace(value)

        is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
        if shardings is None:
            params = jax.tree_util.tree_map_with_path(load, params, is_leaf=is_var)
        else:
            params = jax.tree_util.tree_map_with_path(
                lambda p, v, s: load(p, v, s.get_value() if is_var(s) else s),
                params,
                shardings,
                is_leaf=is_var,
            )
    rest = initial_rest(config)
    if mesh is not None:
        rest = jax.device_put(rest, sharding.tree_shardings(rest, mesh, rules))
    return nnx.merge(graphdef, params, rest)


def _some(names: list[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _model_type(config: ModelConfig) -> str:
    return {v: k for k, v in MODEL_TYPES.items()}[config.attention]


# ---------------------------------------------------------------------------- writing
def _host(x: jax.Array) -> np.ndarray:
    """The whole array on this host (gathered from every process when it spans several)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def _parse_size(size: int | str) -> int:
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    text = str(size).strip().upper()
    for unit, mult in sorted(units.items(), key=lambda u: -len(u[0])):
        if text.endswith(unit):
            try:
                return int(float(text[: -len(unit)]) * mult)
            except ValueError:
                break
    raise PretrainedError(
        f"save_pretrained: max_shard_size {size!r} is not a size. Fix: give "
        f"bytes (an int) or a string such as '5GB' or '500MB'."
    )


def save_pretrained(
    model: TransformerLM,
    path: str,
    *,
    max_shard_size: int | str = "5GB",
    tokenizer: str | None = None,
    tokenizer_from: str | None = None,
) -> str:
    """Write ``model`` as a Hugging Face checkpoint directory: DIFF V1 as ``diffllama``
    (``DiffLlamaForCausalLM``), standard attention as ``llama`` (``LlamaForCausalLM``), so
    ``transformers.AutoModelForCausalLM.from_pretrained(path)`` gives the same logits; DIFF V2
    as ``diff_transformer_v2`` with its modeling code beside the weights (``auto_map``), loaded
    with ``from_pretrained(path, trust_remote_code=True)`` on a machine without diffjax.

    ``path``: a local directory or a ``gs://`` prefix (written to a temporary directory, each
    file uploaded whole as soon as it is written: the weights first, ``config.json`` last).
    Weights are written in the parameters' dtype, in shards of at most ``max_shard_size`` (an
    index ``model.safetensors.index.json`` when there are several). ``tokenizer``:
    ``"byte"`` writes diffjax's byte tokenizer as ``tokenizer.json`` (+ its config;
    :func:`byte_tokenizer_files`), so ``AutoTokenizer`` loads it; a directory (local or
    ``gs://``; ``tokenizer_from``, its older name) has its tokenizer files
    (``tokenizer.json``, ``tokenizer_config.json``, ...) copied beside the weights. A gate
    (``model.gate``), a fixed ``lambda_init``, ``diff_norm=False`` or a ``diff_norm_eps``
    other than ``norm_eps`` are refused (the formats cannot express them); so is a directory that already holds a
    checkpoint (nothing saved is overwritten), and, before any work, a bucket that does not
    exist or cannot be written (:class:`diffjax.infra.storage.StorageError`). Returns ``path``. With
    several processes every process calls it and process 0 writes.
    """
    from safetensors.numpy import save_file

    if not isinstance(model, TransformerLM):
        raise TypeError(
            f"save_pretrained takes a diffjax.TransformerLM, got {type(model).__name__}"
        )
    path = os.fspath(path)
    storage.check_access(path, what="save_pretrained path", write=jax.process_index() == 0)
    if tokenizer is not None and tokenizer_from is not None:
        raise PretrainedError(
            "save_pretrained: both tokenizer and tokenizer_from are given. Fix: pass tokenizer= "
            "only (tokenizer_from is its older name)."
        )
    tokenizer = tokenizer if tokenizer is not None else tokenizer_from
    if tokenizer is not None and tokenizer != "byte":
        tokenizer = os.fspath(tokenizer)
        storage.check_access(tokenizer, what="tokenizer", write=False)
    if model.config.scan_layers:  # the format has one entry per layer
        model = unstack_layers(model)
    config = model.config
    if config.ramp:  # a retrofit: plain DIFF once its negative map's weight w reached 1
        check_ramp_done(model)
        config = config.replace(ramp=False)
    hf = hf_config(config)
    limit = _parse_size(max_shard_size)
    _check_new_checkpoint_dir(path)
    tok_files = _tokenizer_files(tokenizer) if tokenizer not in (None, "byte") else []
    tensors = _hf_tensors(model, config)
    if jax.process_index() != 0:
        return path
    names, shards = _shards(tensors, limit)
    with _staging(path) as (out, done):
        for file, shard in zip(names, shards):
            tmp = os.path.join(out, file + ".tmp")
            save_file(dict(shard), tmp, metadata={"format": "pt"})
            os.replace(tmp, os.path.join(out, file))
            done(file)
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": sum(a.nbytes for _, a in tensors)},
                "weight_map": {
                    name: file for file, shard in zip(names, shards) for name, _ in shard
                },
            }
            _write_json(os.path.join(out, INDEX_FILE), index)
            done(INDEX_FILE)
        for f, data in _side_files(config, path, tokenizer, tok_files).items():
            storage.write_bytes(os.path.join(out, f), data)
            done(f)
        _write_json(os.path.join(out, CONFIG_FILE), hf)  # last: it marks a whole checkpoint
        done(CONFIG_FILE)
    return path


def _side_files(
    config: ModelConfig, path: str, tokenizer: str | None, tok_files: list[str]
) -> dict[str, bytes]:
    """The files written beside the weights: the tokenizer's (copied from the directory
    ``tokenizer``, or the byte tokenizer's with ``"byte"``) and DIFF V2's modeling code."""
    out = {
        f: storage.read_bytes(storage.join(tokenizer, f))
        for f in tok_files
        if not storage.exists(storage.join(path, f))
    }
    if tokenizer == "byte":
        for f, obj in byte_tokenizer_files().items():
            out[f] = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
    if config.attention == "diff_v2":
        out.update({f: storage.read_bytes(os.path.join(REMOTE_DIR, f)) for f in REMOTE_FILES})
    return out


def _check_new_checkpoint_dir(path: str) -> None:
    """``path`` is a directory (new or empty of checkpoints): nothing saved is overwritten."""
    if _is_file(path):
        _fail(path, "is a file", "pass a directory (new or empty) to write the checkpoint into")
    taken = [
        f for f in (CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE) if storage.exists(storage.join(path, f))
    ]
    if storage.isdir(path):
        taken += sorted(
            p.name
            for p in storage.path(path).iterdir()
            if p.name.endswith(".safetensors") and p.name not in taken
        )
    if taken:
        _fail(
            path,
            f"already holds a checkpoint ({', '.join(taken)}); nothing is overwritten",
            "pass a new directory, or move the old checkpoint away first",
        )


def _tokenizer_files(tokenizer_from: str) -> list[str]:
    """The tokenizer files in ``tokenizer_from`` to copy beside the weights (at least one)."""
    tok_files = [f for f in TOKENIZER_FILES if _is_file(storage.join(tokenizer_from, f))]
    if not tok_files:
        _fail(
            tokenizer_from,
            f"holds none of {', '.join(TOKENIZER_FILES)}",
            "pass the directory holding the tokenizer files, 'byte', or leave tokenizer out",
        )
    return tok_files


def byte_tokenizer_files() -> dict[str, dict]:
    """diffjax's byte tokenizer (:class:`diffjax.data.tokenizer.ByteTokenizer`) as a Hugging
    Face tokenizer (``{file name: its JSON}``), built with the ``tokenizers`` package:
    ``AutoTokenizer`` (and diffjax's ``HFTokenizer``) encode every text to its UTF-8 bytes as
    it does, and decode with ``skip_special_tokens=True`` as it decodes. A byte-level BPE
    without merges: each byte is its own token, id = the byte. ``<bos>``/``<eos>``/``<pad>``
    are 256/257/258; ``split_special_tokens`` keeps their spelling in a text plain bytes, as
    diffjax does, and nothing is added around a text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    chars = _byte_chars()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    names = sorted(BYTE_SPECIAL_TOKENS, key=BYTE_SPECIAL_TOKENS.get)
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    assert [tok.token_to_id(n) for n in names] == [BYTE_SPECIAL_TOKENS[n] for n in names]
    bos, eos, pad = names
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "add_bos_token": False,
        "add_eos_token": False,
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
    }
    specials = {"bos_token": bos, "eos_token": eos, "pad_token": pad}
    return {
        TOKENIZER_FILES[0]: json.loads(tok.to_str()),
        "tokenizer_config.json": config,
        "special_tokens_map.json": specials,
    }


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of ``tokenizers``' ByteLevel:
    printable Latin-1 bytes stand for themselves, the other 68 for U+0100 onwards in order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    rest = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(rest)}}


def _hf_tensors(model: TransformerLM, config: ModelConfig) -> list[tuple[str, np.ndarray]]:
    """``(Hugging Face name, host array in its layout)`` for every weight of the unrolled
    ``model``, in :func:`weight_table`'s order (DIFF V1's subln scale folded into ``o_proj``)."""
    state = nnx.to_pure_dict(nnx.state(model, nnx.Param))

    def value(key: tuple) -> jax.Array:
        node = state
        for k in key:
            node = node[k]
        return node

    tensors: list[tuple[str, np.ndarray]] = []
    for key, name, kind in weight_table(config):
        if name is None:  # the subln weight: folded into o_proj
            continue
        host = _host(value(key))
        subln = None
        if kind == "o" and config.attention == "diff_v1":
            subln = _host(value(key[:-2] + ("subln", "scale")))
            out_dtype = host.dtype
            host = from_diffjax(config, kind, host.astype(np.float32), subln).astype(out_dtype)
        else:
            host = from_diffjax(config, kind, host)
        tensors.append((name, np.ascontiguousarray(host)))
    return tensors


def _shards(tensors, limit: int) -> tuple[list[str], list[list[tuple[str, np.ndarray]]]]:
    """The tensors in order, cut into shards of at most ``limit`` bytes (a tensor larger than
    the limit gets a shard of its own), and each shard's file name."""
    shards: list[list[tuple[str, np.ndarray]]] = [[]]
    size = 0
    for name, arr in tensors:
        if shards[-1] and size + arr.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, arr))
        size += arr.nbytes
    n = len(shards)
    if n == 1:
        return [WEIGHTS_FILE], shards
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)], shards


@contextlib.contextmanager
def _staging(path: str) -> Iterator[tuple[str, Any]]:
    """``(local folder to write the checkpoint's files in, done(name))``: for a local ``path``
    the folder is ``path`` itself (``done`` does nothing); for a bucket a temporary folder, and
    ``done(name)`` uploads that file to ``path`` whole and deletes the local copy (so the local
    disk holds one file at a time)."""
    if not storage.is_remote(path):
        os.makedirs(path, exist_ok=True)
        yield path, lambda name: None
        return
    with tempfile.TemporaryDirectory(prefix="diffjax-export-") as tmp:

        def done(name: str) -> None:
            local = os.path.join(tmp, name)
            storage.upload(local, storage.join(path, name))
            os.remove(local)

        yield tmp, done


def _write_json(file: str, obj: Any) -> None:
    tmp = file + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, file)


__all__ = [
    "ARCHITECTURES",
    "byte_tokenizer_files",
    "MODEL_TYPES",
    "OVERRIDABLE",
    "PretrainedError",
    "check_exportable",
    "config_from_hf",
    "config_from_pretrained",
    "from_diffjax",
    "from_pretrained",
    "hf_config",
    "read_config",
    "row_permutation",
    "save_pretrained",
    "to_diffjax",
    "weight_table",
]
