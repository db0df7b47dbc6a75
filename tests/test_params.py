"""Parameter counts: count_params against built models and closed-form formulas, twin deltas,
parts, tied embeddings, compare_params' table."""

from __future__ import annotations

import functools
import re

import jax
import pytest
from flax import nnx

from diffjax import ModelConfig, ParamCount, TransformerLM, compare_params, count_params, twin
from diffjax.nn.param_count import PARTS


def cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=64, d_model=64, num_layers=2, max_seq_len=32)
    base.update(kw)
    return ModelConfig(**base)


CONFIGS = {
    "standard": cfg(attention="standard", num_heads=4),
    "standard_gqa": cfg(attention="standard", num_heads=4, num_kv_heads=2),
    "standard_head_dim": cfg(attention="standard", num_heads=3, head_dim=16),
    "diff_v1": cfg(attention="diff_v1", num_heads=2),
    "diff_v1_gqa": cfg(attention="diff_v1", num_heads=2, num_kv_heads=1),
    "diff_v1_no_norm": cfg(attention="diff_v1", num_heads=2, diff_norm=False),
    "diff_v2": cfg(attention="diff_v2", num_heads=2),
    "diff_v2_gqa": cfg(attention="diff_v2", num_heads=4, num_kv_heads=2),
    "diff_v2_head_dim": cfg(attention="diff_v2", num_heads=3, num_kv_heads=1, head_dim=16),
    "diff_v1_tied": cfg(attention="diff_v1", num_heads=2, tie_embeddings=True),
    "ffn_dim": cfg(attention="diff_v2", num_heads=2, ffn_dim=40, num_layers=3),
    # gated attention's output gate: D -> h (headwise) or D -> h x a head's output width
    "standard_gate_headwise": cfg(
        attention="standard", num_heads=4, num_kv_heads=2, gate="headwise"
    ),
    "diff_v1_gate_elementwise": cfg(attention="diff_v1", num_heads=2, gate="elementwise"),
    "diff_v2_gate_headwise": cfg(attention="diff_v2", num_heads=3, head_dim=16, gate="headwise"),
}


def formula(c: ModelConfig) -> dict[str, int]:
    """Closed-form parameter counts by part, from the layouts in the reference."""
    V, D, L, F = c.vocab_size, c.d_model, c.num_layers, c.resolved_ffn_dim
    h, hkv = c.num_heads, c.kv_heads
    parts = dict.fromkeys(PARTS, 0)
    parts["embedding"] = V * D
    parts["lm_head"] = 0 if c.tie_embeddings else D * V
    parts["ffn"] = L * 3 * D * F
    parts["norms"] = (2 * L + 1) * D
    if c.attention == "standard":
        d = c.resolved_head_dim
        parts["attn.q_proj"] = L * D * h * d
        parts["attn.k_proj"] = parts["attn.v_proj"] = L * D * hkv * d
        parts["attn.out_proj"] = L * h * d * D
    elif c.attention == "diff_v1":
        d = D // (2 * h)
        n_rep = h // hkv
        parts["attn.q_proj"] = parts["attn.out_proj"] = L * D * D
        parts["attn.k_proj"] = parts["attn.v_proj"] = L * D * (D // n_rep)
        parts["attn.lambda"] = L * 4 * d
        parts["attn.subln"] = L * 2 * d if c.diff_norm else 0
    else:
        d = c.resolved_head_dim
        parts["attn.q_proj"] = L * D * 2 * h * d
        parts["attn.k_proj"] = parts["attn.v_proj"] = L * D * hkv * d
        parts["attn.out_proj"] = L * h * d * D
        parts["attn.lambda"] = L * D * h
    width = 2 * d if c.attention == "diff_v1" else d  # a head's output width
    parts["attn.gate"] = {"none": 0, "headwise": L * D * h, "elementwise": L * D * h * width}[
        c.gate
    ]
    return parts


def n_elements(model: nnx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


@functools.cache
def built(name: str) -> TransformerLM:
    return TransformerLM(CONFIGS[name], rngs=nnx.Rngs(0))


# ----------------------------------------------------------------------------- totals
@pytest.mark.parametrize("name", list(CONFIGS))
def test_count_matches_built_model(name):
    model = built(name)
    count = count_params(CONFIGS[name])
    assert isinstance(count, ParamCount)
    assert count.total == n_elements(model)
    # Counting the model itself gives the same parts.
    assert count_params(model) == count


@pytest.mark.parametrize("name", list(CONFIGS))
def test_count_matches_closed_form(name):
    c = CONFIGS[name]
    count = count_params(c)
    assert count.parts == formula(c)
    assert count.total == sum(formula(c).values())


def test_hand_count_small_diff_v1():
    # V=10, D=8, one layer, h=1 DIFF head -> d = 8 / 2 = 4, FFN width 16.
    c = ModelConfig(
        vocab_size=10, d_model=8, num_layers=1, num_heads=1, ffn_dim=16, attention="diff_v1"
    )
    embedding = 10 * 8  # 80
    q = k = v = out = 8 * 8  # 64 each (h_kv = h: n_rep = 1)
    lambdas = 4 * 4  # lambda_q1, k1, q2, k2 of width d = 4
    subln = 2 * 4  # per-head RMSNorm over 2d
    ffn = 3 * 8 * 16  # 384
    norms = 8 + 8 + 8  # attn_norm, ffn_norm, final norm
    lm_head = 8 * 10  # 80
    total = embedding + q + k + v + out + lambdas + subln + ffn + norms + lm_head
    assert total == 848
    count = count_params(c)
    assert count.total == 848
    assert count.parts == {
        "embedding": 80,
        "attn.q_proj": 64,
        "attn.k_proj": 64,
        "attn.v_proj": 64,
        "attn.out_proj": 64,
        "attn.lambda": 16,
        "attn.subln": 8,
        "attn.gate": 0,
        "ffn": 384,
        "norms": 24,
        "lm_head": 80,
    }
    assert count_params(twin(c)).total == 848 - 16 - 8
    assert str(count) == "848 parameters"


def test_hand_count_small_diff_v2_gqa():
    # V=10, D=8, one layer, h=2 output heads (4 query heads) of width d=4, h_kv=1.
    c = ModelConfig(
        vocab_size=10,
        d_model=8,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        ffn_dim=16,
        attention="diff_v2",
    )
    q = 8 * (2 * 2 * 4)  # 128: D -> 2h d
    k = v = 8 * (1 * 4)  # 32 each: D -> h_kv d
    o = (2 * 4) * 8  # 64: h d -> D
    lam = 8 * 2  # lambda_proj: D -> h
    total = 80 + q + k + v + o + lam + 384 + 24 + 80
    assert count_params(c).total == total == 840
    # The twin lacks the Q2 half of q_proj and lambda_proj.
    assert count_params(twin(c)).total == total - 8 * 2 * 4 - lam


# ----------------------------------------------------------------------------- twins
@pytest.mark.parametrize(
    "kw",
    [
        dict(d_model=64, num_heads=2),
        dict(d_model=64, num_heads=2, num_kv_heads=1),
        dict(d_model=256, num_heads=4, num_kv_heads=2, num_layers=3),
        dict(d_model=128, num_heads=8, num_layers=1, vocab_size=259),
        dict(d_model=64, num_heads=2, diff_norm=False),
        dict(d_model=64, num_heads=4, lambda_init=0.5, tie_embeddings=True),
    ],
)
def test_v1_total_is_twin_plus_lambdas_and_subln(kw):
    c = cfg(attention="diff_v1", **kw)
    t = twin(c)
    a, b = count_params(c), count_params(t)
    d, L = c.resolved_head_dim, c.num_layers
    extra = L * (4 * d + (2 * d if c.diff_norm else 0))
    assert a.total == b.total + extra
    for part in PARTS:
        if part == "attn.lambda":
            assert a.parts[part] == L * 4 * d and b.parts[part] == 0
        elif part == "attn.subln":
            assert a.parts[part] == (L * 2 * d if c.diff_norm else 0) and b.parts[part] == 0
        else:  # every projection has exactly the twin's shape
            assert a.parts[part] == b.parts[part], part


@pytest.mark.parametrize(
    "kw",
    [
        dict(d_model=64, num_heads=2),
        dict(d_model=64, num_heads=4, num_kv_heads=2),
        dict(d_model=256, num_heads=4, num_kv_heads=1, num_layers=3),
        dict(d_model=96, num_heads=3, num_kv_heads=3, head_dim=16),
        dict(d_model=64, num_heads=2, tie_embeddings=True),
    ],
)
def test_v2_total_is_twin_plus_q2_and_lambda_proj(kw):
    c = cfg(attention="diff_v2", **kw)
    t = twin(c)
    a, b = count_params(c), count_params(t)
    D, h, d, L = c.d_model, c.num_heads, c.resolved_head_dim, c.num_layers
    assert a.total == b.total + L * (D * h * d + D * h)
    assert a.parts["attn.q_proj"] == 2 * b.parts["attn.q_proj"] == L * D * 2 * h * d
    assert a.parts["attn.lambda"] == L * D * h and b.parts["attn.lambda"] == 0
    assert a.parts["attn.subln"] == 0
    for part in (
        "embedding",
        "attn.k_proj",
        "attn.v_proj",
        "attn.out_proj",
        "ffn",
        "norms",
        "lm_head",
    ):
        assert a.parts[part] == b.parts[part], part


# ----------------------------------------------------------------------------- parts
@pytest.mark.parametrize("name", list(CONFIGS))
def test_parts_sum_to_total(name):
    count = count_params(CONFIGS[name])
    assert tuple(count.parts) == PARTS
    assert sum(count.parts.values()) == count.total
    assert all(v >= 0 for v in count.parts.values())


def test_tied_embeddings_remove_lm_head():
    untied, tied = count_params(CONFIGS["diff_v1"]), count_params(CONFIGS["diff_v1_tied"])
    assert tied.parts["lm_head"] == 0
    assert untied.parts["lm_head"] == 64 * 64
    assert tied.parts["embedding"] == untied.parts["embedding"]
    assert tied.total == untied.total - 64 * 64
    assert n_elements(built("diff_v1_tied")) == tied.total


@pytest.mark.parametrize(
    "name, shapes",
    [
        # D=64, h=2, d=16: q [D, D], k/v [D, D/n_rep], out [D, D], lambdas [d], subln [2d].
        (
            "diff_v1",
            {
                "q_proj": (64, 64),
                "k_proj": (64, 64),
                "v_proj": (64, 64),
                "out_proj": (64, 64),
                "lambda_q1": (16,),
                "lambda_k2": (16,),
                "subln": (32,),
            },
        ),
        (
            "diff_v1_gqa",
            {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "out_proj": (64, 64)},
        ),
        # D=64, h=4 (8 query heads), h_kv=2, d=16.
        (
            "diff_v2_gqa",
            {
                "q_proj": (64, 128),
                "k_proj": (64, 32),
                "v_proj": (64, 32),
                "out_proj": (64, 64),
                "lambda_proj": (64, 4),
            },
        ),
        (
            "diff_v2_head_dim",
            {
                "q_proj": (64, 96),
                "k_proj": (64, 16),
                "v_proj": (64, 16),
                "out_proj": (48, 64),
                "lambda_proj": (64, 3),
            },
        ),
        (
            "standard_gqa",
            {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "out_proj": (64, 64)},
        ),
    ],
)
def test_projection_shapes(name, shapes):
    model = nnx.eval_shape(lambda: TransformerLM(CONFIGS[name], rngs=nnx.Rngs(0)))
    found = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
        keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        if keys[:3] == ["layers", "0", "attn"]:
            found[keys[3]] = tuple(leaf.shape)
    for key, shape in shapes.items():
        assert found[key] == shape, (key, found)


# ----------------------------------------------------------------------------- table
def _rows(table: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in table.strip().splitlines()
    ]


def _num(cell: str) -> int:
    return int(cell.replace("*", "").replace(",", ""))


@pytest.mark.parametrize(
    "name", ["diff_v1", "diff_v1_gqa", "diff_v2", "diff_v2_head_dim", "diff_v1_tied"]
)
def test_compare_params_table(name):
    c = CONFIGS[name]
    table = compare_params(c)
    assert isinstance(table, str)
    rows = _rows(table)
    assert rows[0] == ["part", c.attention, "standard twin", "difference"]
    assert all(re.fullmatch(r"-{3,}:?", cell) for cell in rows[1])
    assert all(len(r) == 4 for r in rows)
    a, b = count_params(c), count_params(twin(c))
    body = {r[0]: r[1:] for r in rows[2:-1]}
    # Every non-empty part is reported, with the difference; parts empty in both are omitted.
    for part in PARTS:
        if a.parts[part] or b.parts[part]:
            x, y, diff = body[part]
            assert (_num(x), _num(y), _num(diff)) == (
                a.parts[part],
                b.parts[part],
                a.parts[part] - b.parts[part],
            )
        else:
            assert part not in body
    total = rows[-1]
    assert total[0] == "**total**"
    assert (_num(total[1]), _num(total[2]), _num(total[3])) == (a.total, b.total, a.total - b.total)
    assert total[3].strip("*").startswith("+")  # DIFF adds parameters
    assert f"{a.total:,}" in total[1]


def test_compare_params_rejects_standard():
    from diffjax import ConfigError

    with pytest.raises(ConfigError):
        compare_params(CONFIGS["standard"])


# ----------------------------------------------------------------------------- property
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def diff_configs(draw):
    kind = draw(st.sampled_from(["diff_v1", "diff_v2"]))
    h = draw(st.integers(1, 4))
    hkv = draw(st.sampled_from([k for k in range(1, h + 1) if h % k == 0]))
    d = 2 * draw(st.integers(1, 8))
    D = 2 * h * d if kind == "diff_v1" else h * d
    head_dim = None if kind == "diff_v1" or draw(st.booleans()) else 2 * draw(st.integers(1, 8))
    return ModelConfig(
        attention=kind,
        vocab_size=draw(st.integers(1, 50)),
        d_model=D,
        num_layers=draw(st.integers(1, 3)),
        num_heads=h,
        num_kv_heads=hkv,
        head_dim=head_dim,
        tie_embeddings=draw(st.booleans()),
        ffn_multiple_of=draw(st.sampled_from([1, 8, 64])),
        diff_norm=True if kind == "diff_v2" else draw(st.booleans()),
    )


@settings(max_examples=12, deadline=None, derandomize=True)
@given(c=diff_configs())
def test_counts_match_formula_for_random_configs(c):
    a, b = count_params(c), count_params(twin(c))
    assert a.parts == formula(c)
    assert b.parts == formula(twin(c))
    D, h, d, L = c.d_model, c.num_heads, c.resolved_head_dim, c.num_layers
    if c.attention == "diff_v1":
        assert a.total - b.total == L * (4 * d + (2 * d if c.diff_norm else 0))
    else:
        assert a.total - b.total == L * (D * h * d + D * h)
