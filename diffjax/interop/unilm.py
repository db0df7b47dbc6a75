"""Weights from the official PyTorch modules (microsoft/unilm ``Diff-Transformer``), no torch needed.

A state dict maps the official parameter names to arrays in torch layout (``nn.Linear.weight``
is ``[out, in]``). :func:`load_unilm_state_dict` writes them into the matching diffjax module so
that the same weights give the same outputs; :func:`unilm_state_dict` goes the other way.
Whole models in Hugging Face's DiffLlama / Llama format: :mod:`diffjax.interop.hf`.

=====================  =====================================================================
module                 official names
=====================  =====================================================================
MultiheadAttention     ``q_proj.weight k_proj.weight v_proj.weight out_proj.weight``
                       (``o_proj.weight`` is accepted too: the V2 file's baseline names it so)
MultiheadDiffAttn      the above, ``lambda_q1 lambda_k1 lambda_q2 lambda_k2 subln.weight``
MultiheadDiffAttnV2    ``q_proj.weight k_proj.weight v_proj.weight o_proj.weight lambda_proj.weight``
=====================  =====================================================================
"""

from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from diffjax.nn.attention import (
    AttentionLayer,
    MultiheadAttention,
    MultiheadDiffAttn,
    MultiheadDiffAttnV2,
)
from diffjax.infra.sharding import logical_axes


def _param_table(module: nnx.Module) -> dict[str, tuple[nnx.Param, bool]]:
    """Official name -> (diffjax parameter, transpose?) for one attention module."""
    if isinstance(module, AttentionLayer):
        # the output projection is ``out_proj`` in diffjax, ``o_proj`` in the official V2 file
        out_name = "o_proj" if isinstance(module, MultiheadDiffAttnV2) else "out_proj"
        table = {
            f"{n}.weight": (getattr(module, n).kernel, True) for n in ("q_proj", "k_proj", "v_proj")
        }
        table[f"{out_name}.weight"] = (module.out_proj.kernel, True)
        if isinstance(module, MultiheadDiffAttnV2):
            table["lambda_proj.weight"] = (module.lambda_proj.kernel, True)
        if isinstance(module, MultiheadDiffAttn):
            for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                table[n] = (getattr(module, n), False)
            if module.subln is not None:
                table["subln.weight"] = (module.subln.scale, False)
        return table
    raise TypeError(
        f"load_unilm_state_dict: expected a MultiheadAttention, MultiheadDiffAttn or "
        f"MultiheadDiffAttnV2, got {type(module).__name__}"
    )


def _to_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor, converted without importing torch
        value = value.detach().cpu()
        if not str(value.dtype).startswith(("torch.float32", "torch.float64")):
            value = value.float()
        value = value.numpy()
    return np.asarray(value)


def _check_layer(module: nnx.Module, layer: int | None, where: str) -> None:
    """A module of a scanned model (``model.layers.attn``: every parameter stacked on a leading
    layer axis) needs ``layer``; any other module refuses one."""
    kernel = module.q_proj.kernel if isinstance(module, AttentionLayer) else None
    names = logical_axes(kernel) or () if kernel is not None else ()
    stacked = bool(names) and names[0] == "layers"
    if stacked and layer is None:
        raise ValueError(
            f"{where}: {type(module).__name__} holds the stacked layers of a scanned model "
            f"({kernel.shape[0]} layers). Fix: pass layer=i for the official module of layer i."
        )
    if stacked and not 0 <= layer < kernel.shape[0]:
        raise ValueError(f"{where}: layer={layer} is out of range 0..{kernel.shape[0] - 1}")
    if not stacked and layer is not None:
        raise ValueError(
            f"{where}: layer={layer} was given but {type(module).__name__} holds one layer. "
            f"Fix: leave layer out (it is for model.layers.attn of a scanned model)."
        )


def load_unilm_state_dict(
    module: nnx.Module,
    state_dict: Mapping[str, Any],
    *,
    prefix: str = "",
    strict: bool = True,
    layer: int | None = None,
) -> nnx.Module:
    """Load official-layout weights into ``module`` in place (and return it).

    ``state_dict``: official name -> numpy array (or torch tensor), torch layout. ``prefix`` is
    stripped from every key first (e.g. ``"layers.0.self_attn."``); keys without it are ignored.
    With ``strict`` (default), a missing or unexpected key is an error. A shape mismatch is
    always an error. Nothing is written unless every check passes. ``layer``: for the stacked
    attention of a scanned model (``model.layers.attn``), the layer to write.
    """
    _check_layer(module, layer, "load_unilm_state_dict")
    table = _param_table(module)
    given = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    if isinstance(module, MultiheadAttention) and "o_proj.weight" in given:
        table["o_proj.weight"] = table.pop("out_proj.weight")  # the V2 file's baseline naming
    missing = sorted(set(table) - set(given))
    unexpected = sorted(set(given) - set(table))
    if strict and (missing or unexpected):
        raise KeyError(
            f"load_unilm_state_dict into {type(module).__name__}: "
            + (f"missing {missing}" if missing else "")
            + ("; " if missing and unexpected else "")
            + (f"unexpected {unexpected}" if unexpected else "")
            + ". Fix: pass the state dict of the matching official module (or strict=False)."
        )
    updates = []
    for name, (param, transpose) in table.items():
        if name not in given:
            continue
        array = _to_numpy(given[name])
        if transpose:
            if array.ndim != 2:
                raise ValueError(
                    f"{name}: expected a 2-D [out, in] weight, got shape {array.shape}"
                )
            array = array.T
        target = param[...] if layer is None else param[...][layer]
        if array.shape != target.shape:
            expect = target.shape[::-1] if transpose else target.shape
            raise ValueError(
                f"{name}: shape {array.shape[::-1] if transpose else array.shape} does "
                f"not match the module's {expect} (torch layout). Fix: build the module "
                f"with the official module's embed_dim/num_heads/num_kv_heads."
            )
        updates.append((param, jnp.asarray(array, dtype=target.dtype)))
    for param, value in updates:
        param[...] = value if layer is None else param[...].at[layer].set(value)
    return module


def unilm_state_dict(module: nnx.Module, *, layer: int | None = None) -> dict[str, np.ndarray]:
    """The module's weights under the official names, torch layout, as writable numpy arrays
    (``layer``: of that layer of a scanned model's stacked ``model.layers.attn``).

    bfloat16 parameters come out as float32 (``torch.from_numpy`` takes no numpy bfloat16);
    ``torch.from_numpy(a).to(torch.bfloat16)`` restores them exactly.
    """
    _check_layer(module, layer, "unilm_state_dict")
    out = {}
    for name, (param, transpose) in _param_table(module).items():
        array = np.asarray(param[...] if layer is None else param[...][layer])
        if array.dtype == jnp.bfloat16:
            array = array.astype(np.float32)
        out[name] = np.array(array.T if transpose else array, copy=True)
    return out
