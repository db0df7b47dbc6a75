"""ModelConfig validation, derived values, twin(), immutability."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

import diffjax
from diffjax import ConfigError, ModelConfig, lambda_init_fn, twin
from diffjax.config import describe_type, field_comments


def assert_config_error(field: str, *, contains: str | None = None, **kwargs) -> ConfigError:
    """``ModelConfig(**kwargs)`` raises ConfigError naming ``ModelConfig.<field>`` and a fix."""
    with pytest.raises(ConfigError) as info:
        ModelConfig(**kwargs)
    msg = str(info.value)
    assert f"ModelConfig.{field}" in msg, msg
    assert "Fix:" in msg, msg
    if contains is not None:
        assert contains in msg, msg
    return info.value


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)
    assert diffjax.ConfigError is ConfigError


def test_default_config_is_valid():
    cfg = ModelConfig()
    assert cfg.attention == "diff_v1"
    assert cfg.resolved_head_dim == cfg.d_model // (2 * cfg.num_heads)


# ----------------------------------------------------------------------------- rejected
@pytest.mark.parametrize(
    "kwargs, field, contains",
    [
        # width not divisible by heads
        (dict(attention="standard", d_model=64, num_heads=3), "d_model", None),
        (dict(attention="diff_v2", d_model=64, num_heads=3), "d_model", None),
        # V1: d_model must be divisible by 2 * num_heads
        (dict(attention="diff_v1", d_model=64, num_heads=3), "d_model", "2*num_heads"),
        (dict(attention="diff_v1", d_model=96, num_heads=32), "d_model", None),  # 96 % 64 != 0
        # kv heads not dividing heads
        (dict(attention="standard", d_model=64, num_heads=4, num_kv_heads=3), "num_kv_heads", None),
        (dict(attention="standard", d_model=64, num_heads=4, num_kv_heads=8), "num_kv_heads", None),
        (dict(attention="diff_v1", d_model=64, num_heads=4, num_kv_heads=3), "num_kv_heads", None),
        (dict(attention="diff_v2", d_model=64, num_heads=4, num_kv_heads=3), "num_kv_heads", None),
        # V2 pairs (2i, 2i+1) straddling kv groups
        (
            dict(attention="diff_v2", d_model=96, num_heads=3, num_kv_heads=2),
            "num_kv_heads",
            "straddle",
        ),
        (
            dict(attention="diff_v2", d_model=64, num_heads=2, num_kv_heads=4),
            "num_kv_heads",
            "straddle",
        ),
        # odd head width (rotary rotates channel pairs)
        (dict(attention="standard", d_model=48, num_heads=16), "head_dim", "even"),
        (dict(attention="diff_v1", d_model=48, num_heads=8), "head_dim", "even"),  # d = 3
        (dict(attention="diff_v2", d_model=64, num_heads=4, head_dim=5), "head_dim", "even"),
        (dict(attention="standard", d_model=64, num_heads=4, head_dim=7), "head_dim", "even"),
        # V1 fixes head_dim = d_model // (2h)
        (dict(attention="diff_v1", d_model=64, num_heads=4, head_dim=16), "head_dim", "8"),
        # unknown names
        (dict(attention="diff_v3"), "attention", "diff_v3"),
        (dict(attention="Standard"), "attention", None),
        (dict(attention_impl="triton"), "attention_impl", "triton"),
        (dict(dtype="float64"), "dtype", "float64"),
        (dict(dtype="bf16"), "dtype", None),
        (dict(param_dtype="int8"), "param_dtype", None),
        # wrong types
        (dict(d_model="64"), "d_model", "str"),
        (dict(num_layers=True), "num_layers", "bool"),
        (dict(d_model=64.0), "d_model", "float"),
        (dict(num_kv_heads=2.0), "num_kv_heads", None),
        (dict(vocab_size=None), "vocab_size", None),
        (dict(rope_theta="10000"), "rope_theta", None),
        (dict(rope_theta=True), "rope_theta", None),
        (dict(tie_embeddings=1), "tie_embeddings", None),
        (dict(attention=1), "attention", None),
        (dict(dtype=None), "dtype", None),
        (dict(lambda_init="0.8"), "lambda_init", None),
        # non-positive sizes and scales
        (dict(vocab_size=0), "vocab_size", None),
        (dict(d_model=0), "d_model", None),
        (dict(d_model=-64), "d_model", None),
        (dict(num_layers=0), "num_layers", None),
        (dict(num_heads=0), "num_heads", None),
        (dict(num_kv_heads=0), "num_kv_heads", None),
        (dict(head_dim=0, attention="standard"), "head_dim", None),
        (dict(max_seq_len=0), "max_seq_len", None),
        (dict(ffn_dim=-1), "ffn_dim", None),
        (dict(ffn_multiple_of=0), "ffn_multiple_of", None),
        (dict(rope_theta=0.0), "rope_theta", None),
        (dict(norm_eps=0.0), "norm_eps", None),
        (dict(init_std=-0.02), "init_std", None),
        # V1-only settings on other kinds
        (dict(attention="standard", lambda_init=0.8), "lambda_init", None),
        (dict(attention="diff_v2", lambda_init=0.5), "lambda_init", None),
        (dict(attention="standard", diff_norm=False), "diff_norm", None),
        (dict(attention="diff_v2", diff_norm=False), "diff_norm", None),
        # rotary scaling and the per-head norm's eps
        (dict(rope_scaling="yarn"), "rope_scaling", "'none', 'linear', 'llama3'"),
        (dict(rope_factor=8.0), "rope_factor", "rope_scaling='none'"),
        (dict(rope_scaling="linear", rope_factor=0.0), "rope_factor", "> 0"),
        (
            dict(
                rope_scaling="llama3",
                rope_factor=8.0,
                rope_low_freq_factor=4.0,
                rope_high_freq_factor=1.0,
            ),
            "rope_high_freq_factor",
            "0 < rope_low_freq_factor",
        ),
        (
            dict(rope_scaling="llama3", rope_factor=8.0, rope_original_max_len=0),
            "rope_original_max_len",
            None,
        ),
        (dict(diff_norm_eps=0.0), "diff_norm_eps", None),
    ],
)
def test_rejected(kwargs, field, contains):
    assert_config_error(field, contains=contains, **kwargs)


def test_message_format_names_field_and_fix():
    err = assert_config_error(
        "num_kv_heads", attention="diff_v2", d_model=96, num_heads=3, num_kv_heads=2
    )
    msg = str(err)
    assert re.match(r"^ModelConfig\.num_kv_heads: .+\. Fix: .+\.$", msg), msg
    # The fix lists the valid choices (divisors of num_heads).
    assert "[1, 3]" in msg, msg


def test_d_model_fix_lists_valid_head_counts():
    msg = str(assert_config_error("d_model", attention="diff_v1", d_model=64, num_heads=3))
    assert "[1, 2, 4, 8, 16, 32]" in msg, msg


# ----------------------------------------------------------------------------- accepted
@pytest.mark.parametrize(
    "kwargs, head_dim, kv_heads",
    [
        (dict(attention="standard", d_model=256, num_heads=8), 32, 8),
        (dict(attention="standard", d_model=256, num_heads=8, num_kv_heads=2), 32, 2),
        (dict(attention="standard", d_model=256, num_heads=8, num_kv_heads=1), 32, 1),
        (dict(attention="standard", d_model=100, num_heads=3, head_dim=32), 32, 3),
        (dict(attention="diff_v1", d_model=256, num_heads=4), 32, 4),
        (dict(attention="diff_v1", d_model=256, num_heads=4, num_kv_heads=2), 32, 2),
        (dict(attention="diff_v1", d_model=256, num_heads=4, head_dim=32), 32, 4),
        (dict(attention="diff_v2", d_model=256, num_heads=4), 64, 4),
        (dict(attention="diff_v2", d_model=256, num_heads=4, num_kv_heads=2), 64, 2),
        (dict(attention="diff_v2", d_model=256, num_heads=3, num_kv_heads=3, head_dim=32), 32, 3),
        (dict(attention="diff_v2", d_model=96, num_heads=3, num_kv_heads=1), 32, 1),
    ],
)
def test_derived_head_values(kwargs, head_dim, kv_heads):
    cfg = ModelConfig(**kwargs)
    assert cfg.resolved_head_dim == head_dim
    assert cfg.kv_heads == kv_heads
    assert cfg.is_diff == (cfg.attention != "standard")


@pytest.mark.parametrize(
    "d_model, multiple_of, expected",
    [
        (256, 64, 704),  # 8/3 * 256 = 682.67 -> 704
        (64, 64, 192),  # 170.67 -> 192
        (96, 64, 256),  # exactly 256
        (96, 32, 256),
        (512, 256, 1536),  # 1365.33 -> 1536
        (768, 64, 2048),  # exactly 2048
    ],
)
def test_resolved_ffn_dim(d_model, multiple_of, expected):
    cfg = ModelConfig(
        attention="standard", d_model=d_model, num_heads=4, ffn_multiple_of=multiple_of
    )
    assert cfg.resolved_ffn_dim == expected
    assert cfg.resolved_ffn_dim % multiple_of == 0
    assert cfg.resolved_ffn_dim >= 8 * d_model / 3 - 1


def test_explicit_ffn_dim_wins():
    assert ModelConfig(d_model=256, ffn_dim=100).resolved_ffn_dim == 100


def test_int_accepted_for_float_fields():
    cfg = ModelConfig(rope_theta=10000, norm_eps=1, init_std=1, attention="diff_v1", lambda_init=1)
    assert cfg.rope_theta == 10000


def test_v1_ablation_settings_accepted():
    cfg = ModelConfig(attention="diff_v1", lambda_init=0.5, diff_norm=False)
    assert cfg.lambda_init == 0.5 and cfg.diff_norm is False


def test_lambda_init_fn():
    assert lambda_init_fn(0) == pytest.approx(0.2)
    for depth in range(12):
        assert lambda_init_fn(depth) == pytest.approx(0.8 - 0.6 * math.exp(-0.3 * depth))
    assert lambda_init_fn(100) == pytest.approx(0.8, abs=1e-9)


# ----------------------------------------------------------------------------- twin
_TWIN_CHANGED = {"attention", "num_heads", "num_kv_heads", "head_dim", "lambda_init", "diff_norm"}


def _assert_rest_unchanged(a: ModelConfig, b: ModelConfig):
    da, db = a.to_dict(), b.to_dict()
    for key in da:
        if key not in _TWIN_CHANGED:
            assert da[key] == db[key], key


def test_twin_v1_gqa():
    cfg = ModelConfig(
        attention="diff_v1",
        d_model=256,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=300,
        num_layers=3,
        max_seq_len=77,
        dtype="bfloat16",
        tie_embeddings=True,
        ffn_dim=500,
        rope_theta=5e5,
        init_std=0.01,
    )
    t = twin(cfg)
    assert t.attention == "standard"
    assert t.num_heads == 8 and t.kv_heads == 4
    assert t.resolved_head_dim == 32 and t.d_model == 256
    assert t.num_heads * t.resolved_head_dim == cfg.d_model  # same q_proj shape
    _assert_rest_unchanged(cfg, t)


def test_twin_v1_mha_and_ablations():
    cfg = ModelConfig(
        attention="diff_v1", d_model=128, num_heads=2, lambda_init=0.5, diff_norm=False
    )
    t = twin(cfg)
    assert (t.attention, t.num_heads, t.kv_heads, t.resolved_head_dim) == ("standard", 4, 4, 32)
    assert t.lambda_init is None and t.diff_norm is True
    _assert_rest_unchanged(cfg, t)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(d_model=256, num_heads=4),
        dict(d_model=256, num_heads=4, num_kv_heads=2),
        dict(d_model=256, num_heads=4, num_kv_heads=1),
        dict(d_model=100, num_heads=3, num_kv_heads=3, head_dim=32),
    ],
)
def test_twin_v2_same_heads(kwargs):
    cfg = ModelConfig(attention="diff_v2", vocab_size=99, num_layers=5, **kwargs)
    t = twin(cfg)
    assert t.attention == "standard"
    assert t.num_heads == cfg.num_heads
    assert t.kv_heads == cfg.kv_heads
    assert t.resolved_head_dim == cfg.resolved_head_dim
    assert t.d_model == cfg.d_model
    _assert_rest_unchanged(cfg, t)


def test_twin_of_standard_raises():
    with pytest.raises(ConfigError, match="Fix:") as info:
        twin(ModelConfig(attention="standard", d_model=64, num_heads=4))
    assert "ModelConfig.attention" in str(info.value)


def test_twin_of_non_config_raises():
    with pytest.raises(TypeError):
        twin({"attention": "diff_v1"})


# ----------------------------------------------------------------------------- immutability
def test_frozen():
    cfg = ModelConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 128  # type: ignore[misc]
    assert cfg.d_model == 256


def test_replace_revalidates():
    cfg = ModelConfig(attention="diff_v1", d_model=64, num_heads=4)
    ok = cfg.replace(num_heads=2)
    assert ok.num_heads == 2 and ok.resolved_head_dim == 16 and cfg.num_heads == 4
    with pytest.raises(ConfigError, match=re.escape("ModelConfig.d_model")):
        cfg.replace(num_heads=3)
    with pytest.raises(ConfigError, match=re.escape("ModelConfig.lambda_init")):
        cfg.replace(attention="standard", lambda_init=0.5)
    with pytest.raises(ConfigError, match=re.escape("ModelConfig.dtype")):
        cfg.replace(dtype="float8")


def test_hashable_and_equal():
    a = ModelConfig(attention="diff_v2", d_model=64, num_heads=2)
    b = ModelConfig(attention="diff_v2", d_model=64, num_heads=2)
    assert a == b and hash(a) == hash(b)
    assert a != a.replace(num_layers=5)
    assert ModelConfig(**a.to_dict()) == a


# ----------------------------------------------------------------------------- property
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _should_accept(kind: str, D: int, h: int, hkv: int | None, head_dim: int | None) -> bool:
    """The head rules of the reference, written independently of config.py."""
    kv = h if hkv is None else hkv
    if h % kv:
        return False
    if kind == "diff_v1":
        if D % (2 * h):
            return False
        d = D // (2 * h)
        if head_dim is not None and head_dim != d:
            return False
    else:
        if head_dim is None and D % h:
            return False
        d = head_dim if head_dim is not None else D // h
    return d % 2 == 0


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    kind=st.sampled_from(["standard", "diff_v1", "diff_v2"]),
    D=st.integers(1, 160),
    h=st.integers(1, 12),
    hkv=st.one_of(st.none(), st.integers(1, 12)),
    head_dim=st.one_of(st.none(), st.integers(1, 40)),
)
def test_validation_matches_the_rules(kind, D, h, hkv, head_dim):
    kwargs = dict(attention=kind, d_model=D, num_heads=h, num_kv_heads=hkv, head_dim=head_dim)
    if _should_accept(kind, D, h, hkv, head_dim):
        c = ModelConfig(**kwargs)
        d = c.resolved_head_dim
        assert d % 2 == 0
        if kind == "diff_v1":
            assert 2 * h * d == D
        elif head_dim is None:
            assert h * d == D
        if kind != "standard":
            t = twin(c)  # the twin of any valid DIFF config is valid
            assert t.resolved_head_dim == d and t.d_model == D
            assert t.num_heads == (2 * h if kind == "diff_v1" else h)
            assert t.kv_heads == (2 * c.kv_heads if kind == "diff_v1" else c.kv_heads)
    else:
        with pytest.raises(ConfigError) as info:
            ModelConfig(**kwargs)
        msg = str(info.value)
        assert re.search(r"ModelConfig\.(d_model|num_kv_heads|head_dim)\b", msg), msg
        assert "Fix:" in msg, msg


def test_numpy_scalars_are_accepted_and_become_python_numbers():
    import numpy as np

    cfg = diffjax.ModelConfig(
        d_model=np.int64(128), num_heads=np.int32(2), rope_theta=np.float32(500000.0)
    )
    assert type(cfg.d_model) is int and cfg.d_model == 128
    assert type(cfg.num_heads) is int
    assert type(cfg.rope_theta) is float and cfg.rope_theta == 500000.0
    with pytest.raises(diffjax.ConfigError, match="ModelConfig.d_model"):
        diffjax.ModelConfig(d_model=np.float64(128.0))


def test_rope_scaling_spec():
    assert ModelConfig().rope_scaling_spec is None
    spec = ModelConfig(
        rope_scaling="llama3", rope_factor=8.0, rope_original_max_len=4096
    ).rope_scaling_spec
    assert (
        spec.kind,
        spec.factor,
        spec.low_freq_factor,
        spec.high_freq_factor,
        spec.original_max_len,
    ) == ("llama3", 8.0, 1.0, 4.0, 4096)


def test_a_checkpoint_from_before_the_new_fields_still_resumes():
    """A model config saved before a field existed matches today's config with that field at its
    default (and not with another value)."""
    from diffjax.train.checkpoint import check_same_model

    current = ModelConfig().to_dict()
    old = {k: v for k, v in current.items() if not k.startswith("rope_") or k == "rope_theta"}
    old.pop("diff_norm_eps")
    check_same_model(old, current, "run")
    with pytest.raises(ConfigError, match=r"diff_norm_eps: checkpoint has 1e-05, config has 1e-06"):
        check_same_model(old, ModelConfig(diff_norm_eps=1e-6).to_dict(), "run")


# ----------------------------------------------------------------------------- one field checker
def test_every_config_dataclass_checks_its_fields_by_annotation():
    import numpy as np

    from diffjax.config import convert
    from diffjax.data import DataConfig
    from diffjax.train import ExperimentConfig, RunConfig, TrainConfig

    train = TrainConfig(lr=1, steps=np.int64(7), tensorboard=np.bool_(False))
    assert type(train.lr) is float and type(train.steps) is int and train.tensorboard is False
    for make, field, got in [
        (lambda: TrainConfig(steps="3"), "TrainConfig.steps", "str '3'"),
        (lambda: TrainConfig(lr=None), "TrainConfig.lr", "NoneType"),
        (lambda: RunConfig(dir=3), "RunConfig.dir", "int 3"),
        (lambda: DataConfig(seq_len=8.0), "DataConfig.seq_len", "float"),
        (lambda: ExperimentConfig(model={}), "ExperimentConfig.model", "dict {}"),
    ]:
        with pytest.raises(ConfigError) as info:
            make()
        msg = str(info.value)
        assert msg.startswith(f"{field}: expected ") and got in msg and "Fix: pass a value" in msg
    # the command line's strings, by the same annotations
    assert convert(int | None, "none", text=True) is None
    assert convert(int, "1_000", text=True) == 1000 and convert(bool, "yes", text=True) is True
    assert convert(tuple[float, ...], "0, 0.5", text=True) == (0.0, 0.5)
    with pytest.raises(ValueError, match="expected an integer"):
        convert(int, "1.5", text=True)
    with pytest.raises(ValueError, match="expected an integer"):
        convert(int, "3")  # not from the command line: a string is not an int


# ------------------------------------------------------------------ field comments and types
def test_field_comments_are_read_beside_or_above_each_field():
    comments = field_comments(ModelConfig)
    assert comments["num_kv_heads"].startswith("key/value heads (GQA)")  # beside
    assert comments["rope_scaling"].startswith("Rotary frequency scaling")  # above, joined
    assert "\n" not in comments["rope_scaling"] and "#" not in comments["rope_scaling"]
    assert comments["lambda_init"].endswith("0.8 - 0.6 exp(-0.3 depth).")
    # every field of the model config has one (train.py --help prints them)
    assert set(comments) == {f.name for f in dataclasses.fields(ModelConfig)}


def test_describe_type_says_the_type_in_words():
    assert describe_type(int) == "an integer"
    assert describe_type(float | None) == "a number or none"
    assert describe_type(bool) == "true or false"
    assert describe_type(tuple[float, ...] | None) == "a comma-separated list of numbers or none"


def test_bounds_and_choices_are_declared_with_the_fields():
    """The model's and the train config's single-field rules (bounds, choices) are declared
    with their fields and enforced by one checker with the "Fix:" messages; what the classes
    check by hand relates fields."""
    import inspect

    from diffjax.config import allowed_values
    from diffjax.train import TrainConfig
    from diffjax.train.config import CHOICES

    cases = [
        (
            ModelConfig,
            "d_model",
            0,
            "ModelConfig.d_model: must be >= 1, got 0. Fix: use a positive",
        ),
        (ModelConfig, "head_dim", 0, "head_dim: must be >= 1 or None, got 0. Fix: use a positive"),
        (ModelConfig, "attention", "x", "attention: unknown attention kind 'x'. Fix: use one of"),
        (ModelConfig, "init_std", 0.0, "init_std: must be > 0, got 0.0. Fix: use e.g. 0.02"),
        (TrainConfig, "b1", 1.0, "TrainConfig.b1: must be in [0, 1), got 1.0. Fix: set train.b1"),
        (TrainConfig, "min_lr_ratio", 2.0, "must be in [0, 1], got 2.0"),
        (TrainConfig, "peak_tflops", 0.0, "peak_tflops: must be > 0 or None, got 0.0"),
        (TrainConfig, "on_nan", "undo", "on_nan: unknown setting 'undo'. Fix: use one of 'stop'"),
    ]
    for cls, name, bad, message in cases:
        assert name in allowed_values(cls)
        with pytest.raises(ConfigError, match=re.escape(message)):
            cls(**{name: bad})
    assert CHOICES["model.remat"] == allowed_values(ModelConfig)["remat"].choices  # --help
    by_hand = inspect.getsource(ModelConfig._check_values)
    by_hand += inspect.getsource(TrainConfig.__post_init__)
    for single_field in (
        "< 1:",
        "> 0:",
        "not in DTYPES",
        "not in REMAT_POLICIES",
        "not in SCHEDULES",
    ):
        assert single_field not in by_hand, single_field
