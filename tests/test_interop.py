"""Interop with the official PyTorch state dicts: names, layout, round trips and failure modes
of ``diffjax.load_unilm_state_dict`` / ``diffjax.unilm_state_dict``."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import diffjax

ZEROS = nnx.initializers.zeros_init()
EMBED = 64


def _normal(rng, shape, std=0.1):
    return (rng.standard_normal(shape) * std).astype(np.float32)


# Shapes of the official modules' state dicts (torch layout, [out, in]), written out by hand.
def official_shapes(kind: str) -> dict[str, tuple[int, ...]]:
    if kind == "standard":  # MultiheadAttention(64, depth, num_heads=8, num_kv_heads=2): d = 8
        return {
            "q_proj.weight": (64, 64),
            "k_proj.weight": (16, 64),
            "v_proj.weight": (16, 64),
            "out_proj.weight": (64, 64),
        }
    if kind == "v1":  # MultiheadFlashDiff1(64, depth, num_heads=4, num_kv_heads=2): d = 8
        return {
            "q_proj.weight": (64, 64),
            "k_proj.weight": (32, 64),
            "v_proj.weight": (32, 64),
            "out_proj.weight": (64, 64),
            "lambda_q1": (8,),
            "lambda_k1": (8,),
            "lambda_q2": (8,),
            "lambda_k2": (8,),
            "subln.weight": (16,),
        }
    if kind == "v2":  # V2(64, num_heads=4, num_kv_heads=2, head_dim=16)
        return {
            "q_proj.weight": (128, 64),
            "k_proj.weight": (32, 64),
            "v_proj.weight": (32, 64),
            "o_proj.weight": (64, 64),
            "lambda_proj.weight": (4, 64),
        }
    raise AssertionError(kind)


def build(kind: str, seed: int = 0):
    if kind == "standard":
        return diffjax.MultiheadAttention(EMBED, 0, 8, 2, kernel_init=ZEROS, rngs=nnx.Rngs(seed))
    if kind == "v1":
        return diffjax.MultiheadDiffAttn(EMBED, 3, 4, 2, kernel_init=ZEROS, rngs=nnx.Rngs(seed))
    if kind == "v2":
        return diffjax.MultiheadDiffAttnV2(
            EMBED, 0, 4, 2, head_dim=16, kernel_init=ZEROS, rngs=nnx.Rngs(seed)
        )
    raise AssertionError(kind)


def random_sd(kind: str, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: _normal(rng, shape) for name, shape in official_shapes(kind).items()}


def assert_sd_equal(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].shape == b[name].shape, name
        np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]), err_msg=name)


KINDS = ["standard", "v1", "v2"]


# ---------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("kind", KINDS)
def test_round_trip(kind):
    sd = random_sd(kind)
    m = build(kind)
    out = diffjax.load_unilm_state_dict(m, sd)
    assert out is m  # in place, and returned
    back = diffjax.unilm_state_dict(m)
    assert_sd_equal(back, sd)
    for v in back.values():
        assert isinstance(v, np.ndarray)


@pytest.mark.parametrize("kind", KINDS)
def test_export_names_and_shapes_match_official(kind):
    """A freshly built module exports exactly the official names and torch-layout shapes."""
    m = build(kind)
    exported = diffjax.unilm_state_dict(m)
    assert {k: v.shape for k, v in exported.items()} == official_shapes(kind)


def test_layout_is_torch_transposed():
    """``W [out, in]`` is stored as the flax kernel ``W.T`` (y = x @ W.T)."""
    sd = random_sd("standard")
    m = diffjax.load_unilm_state_dict(build("standard"), sd)
    np.testing.assert_array_equal(np.asarray(m.q_proj.kernel[...]), sd["q_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(m.out_proj.kernel[...]), sd["out_proj.weight"].T)
    sd = random_sd("v1")
    m = diffjax.load_unilm_state_dict(build("v1"), sd)
    np.testing.assert_array_equal(np.asarray(m.subln.scale[...]), sd["subln.weight"])
    np.testing.assert_array_equal(np.asarray(m.lambda_k2[...]), sd["lambda_k2"])
    sd = random_sd("v2")
    m = diffjax.load_unilm_state_dict(build("v2"), sd)
    np.testing.assert_array_equal(np.asarray(m.lambda_proj.kernel[...]), sd["lambda_proj.weight"].T)


def test_v1_without_norm_has_no_subln_key():
    m = diffjax.MultiheadDiffAttn(EMBED, 0, 4, 2, norm=False, kernel_init=ZEROS, rngs=nnx.Rngs(0))
    sd = random_sd("v1")
    with pytest.raises(KeyError, match="subln.weight"):
        diffjax.load_unilm_state_dict(m, sd)
    del sd["subln.weight"]
    diffjax.load_unilm_state_dict(m, sd)
    assert "subln.weight" not in diffjax.unilm_state_dict(m)


def test_bfloat16_params_are_cast():
    import jax.numpy as jnp

    m = diffjax.MultiheadDiffAttn(
        EMBED, 0, 4, 2, param_dtype=jnp.bfloat16, kernel_init=ZEROS, rngs=nnx.Rngs(0)
    )
    sd = random_sd("v1")
    diffjax.load_unilm_state_dict(m, sd)
    assert m.q_proj.kernel[...].dtype == jnp.bfloat16
    assert m.lambda_q1[...].dtype == jnp.float32  # lambda vectors stay float32
    np.testing.assert_array_equal(np.asarray(m.lambda_q1[...]), sd["lambda_q1"])
    np.testing.assert_allclose(
        np.asarray(m.q_proj.kernel[...], np.float32), sd["q_proj.weight"].T, rtol=1e-2, atol=1e-3
    )


# ---------------------------------------------------------------------------- failures
@pytest.mark.parametrize("kind", KINDS)
def test_missing_key_names_the_key_and_writes_nothing(kind):
    m = diffjax.load_unilm_state_dict(build(kind), random_sd(kind, seed=1))
    before = diffjax.unilm_state_dict(m)
    sd = random_sd(kind, seed=2)
    victim = sorted(sd)[-1]
    del sd[victim]
    with pytest.raises(KeyError, match=victim.replace(".", r"\.")) as info:
        diffjax.load_unilm_state_dict(m, sd)
    assert "missing" in str(info.value)
    assert_sd_equal(diffjax.unilm_state_dict(m), before)


@pytest.mark.parametrize("kind", KINDS)
def test_unexpected_key_names_the_key_and_writes_nothing(kind):
    m = diffjax.load_unilm_state_dict(build(kind), random_sd(kind, seed=1))
    before = diffjax.unilm_state_dict(m)
    sd = random_sd(kind, seed=2)
    sd["rotary.inv_freq"] = np.zeros(4, np.float32)
    with pytest.raises(KeyError, match=r"rotary\.inv_freq") as info:
        diffjax.load_unilm_state_dict(m, sd)
    assert "unexpected" in str(info.value)
    assert_sd_equal(diffjax.unilm_state_dict(m), before)


@pytest.mark.parametrize(
    "kind,victim,bad_shape",
    [
        (
            "standard",
            "out_proj.weight",
            (64, 32),
        ),  # last one checked: earlier ones would be written
        ("standard", "k_proj.weight", (64, 64)),  # an MHA checkpoint into a GQA module
        ("v1", "subln.weight", (8,)),
        ("v1", "lambda_k2", (16,)),
        ("v1", "v_proj.weight", (64, 64)),
        ("v2", "lambda_proj.weight", (8, 64)),
        ("v2", "q_proj.weight", (64, 64)),  # V2 needs 2h q heads
        ("v2", "o_proj.weight", (64,)),  # wrong rank
    ],
)
def test_wrong_shape_names_the_key_and_writes_nothing(kind, victim, bad_shape):
    m = diffjax.load_unilm_state_dict(build(kind), random_sd(kind, seed=1))
    before = diffjax.unilm_state_dict(m)
    sd = random_sd(kind, seed=2)
    sd[victim] = np.zeros(bad_shape, np.float32)
    with pytest.raises(ValueError, match=victim.replace(".", r"\.")):
        diffjax.load_unilm_state_dict(m, sd)
    assert_sd_equal(diffjax.unilm_state_dict(m), before)


def test_wrong_shape_message_is_in_torch_layout():
    m = build("standard")
    sd = random_sd("standard")
    sd["k_proj.weight"] = np.zeros((64, 64), np.float32)
    with pytest.raises(
        ValueError,
        match=r"k_proj\.weight: shape \(64, 64\) does not match "
        r"the module's \(16, 64\)",
    ):
        diffjax.load_unilm_state_dict(m, sd)


def test_non_strict_allows_missing_and_unexpected():
    m = diffjax.load_unilm_state_dict(build("v1"), random_sd("v1", seed=1))
    before = diffjax.unilm_state_dict(m)
    sd = random_sd("v1", seed=2)
    del sd["lambda_q1"]
    sd["extra"] = np.zeros(3, np.float32)
    diffjax.load_unilm_state_dict(m, sd, strict=False)
    after = diffjax.unilm_state_dict(m)
    np.testing.assert_array_equal(after["lambda_q1"], before["lambda_q1"])  # kept
    np.testing.assert_array_equal(after["q_proj.weight"], sd["q_proj.weight"])  # loaded
    # shape errors stay errors without strict
    sd["q_proj.weight"] = np.zeros((3, 3), np.float32)
    with pytest.raises(ValueError, match=r"q_proj\.weight"):
        diffjax.load_unilm_state_dict(m, sd, strict=False)


# ---------------------------------------------------------------------------- prefix, o_proj
@pytest.mark.parametrize("kind", KINDS)
def test_prefix(kind):
    sd = random_sd(kind, seed=3)
    full = {f"layers.2.self_attn.{k}": v for k, v in sd.items()}
    # another layer's weights and unrelated entries are ignored when a prefix is given
    full.update({f"layers.3.self_attn.{k}": np.zeros_like(v) for k, v in sd.items()})
    full["embed_tokens.weight"] = np.zeros((10, EMBED), np.float32)
    m = diffjax.load_unilm_state_dict(build(kind), full, prefix="layers.2.self_attn.")
    assert_sd_equal(diffjax.unilm_state_dict(m), sd)
    # a wrong prefix finds nothing: every key is missing
    with pytest.raises(KeyError, match="missing"):
        diffjax.load_unilm_state_dict(build(kind), full, prefix="layers.9.self_attn.")


def test_standard_accepts_o_proj_name():
    sd = random_sd("standard", seed=4)
    sd["o_proj.weight"] = sd.pop("out_proj.weight")
    m = diffjax.load_unilm_state_dict(build("standard"), sd)
    np.testing.assert_array_equal(np.asarray(m.out_proj.kernel[...]), sd["o_proj.weight"].T)
    back = diffjax.unilm_state_dict(m)
    np.testing.assert_array_equal(back["out_proj.weight"], sd["o_proj.weight"])
    # with a prefix too
    pre = {f"model.{k}": v for k, v in sd.items()}
    m2 = diffjax.load_unilm_state_dict(build("standard"), pre, prefix="model.")
    np.testing.assert_array_equal(np.asarray(m2.out_proj.kernel[...]), sd["o_proj.weight"].T)
    # both names at once is ambiguous: one of them is unexpected
    sd["out_proj.weight"] = sd["o_proj.weight"]
    with pytest.raises(KeyError, match="out_proj.weight"):
        diffjax.load_unilm_state_dict(build("standard"), sd)


def test_diff_modules_do_not_accept_the_other_out_name():
    sd = random_sd("v1")
    sd["o_proj.weight"] = sd.pop("out_proj.weight")
    with pytest.raises(KeyError, match="out_proj.weight"):
        diffjax.load_unilm_state_dict(build("v1"), sd)
    sd = random_sd("v2")
    sd["out_proj.weight"] = sd.pop("o_proj.weight")
    with pytest.raises(KeyError, match="o_proj.weight"):
        diffjax.load_unilm_state_dict(build("v2"), sd)


def test_load_rejects_other_modules():
    with pytest.raises(TypeError, match="RMSNorm"):
        diffjax.load_unilm_state_dict(diffjax.RMSNorm(8), {})
    with pytest.raises(TypeError, match="RMSNorm"):
        diffjax.unilm_state_dict(diffjax.RMSNorm(8))


def test_loaded_weights_change_the_output():
    """The loaded state is what the forward pass uses (not a copy)."""
    import jax.numpy as jnp

    apply = nnx.jit(lambda module, x: module(x))
    m = build("v2")
    x = jnp.asarray(np.random.default_rng(5).standard_normal((1, 4, EMBED)), jnp.float32)
    zero_out = np.asarray(apply(m, x))
    np.testing.assert_array_equal(zero_out, 0.0)  # zero-initialised projections
    diffjax.load_unilm_state_dict(m, random_sd("v2", seed=5))
    assert np.abs(np.asarray(apply(m, x))).max() > 1e-3


def test_torch_tensors_are_accepted():
    """A real torch state dict (float32 and bfloat16 tensors) loads without conversion by hand."""
    torch = pytest.importorskip("torch")
    sd = random_sd("v1", seed=6)
    tsd = {k: torch.from_numpy(v.copy()) for k, v in sd.items()}
    tsd["q_proj.weight"] = tsd["q_proj.weight"].to(torch.bfloat16)
    m = diffjax.load_unilm_state_dict(build("v1"), tsd)
    back = diffjax.unilm_state_dict(m)
    np.testing.assert_array_equal(back["lambda_q1"], sd["lambda_q1"])
    np.testing.assert_array_equal(back["q_proj.weight"], tsd["q_proj.weight"].float().numpy())


def test_export_of_bfloat16_module_is_float32_and_writable():
    m = diffjax.MultiheadDiffAttnV2(
        64, 0, 2, 1, head_dim=16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)
    )
    sd = diffjax.unilm_state_dict(m)
    for name, a in sd.items():
        assert a.dtype == np.float32, name
        assert a.flags.writeable, name
    np.testing.assert_array_equal(
        sd["q_proj.weight"].T, np.asarray(m.q_proj.kernel[...]).astype(np.float32)
    )
