"""One command-line convention for every ``python -m diffjax.*`` program (:mod:`diffjax.cli`):
positional inputs, ``section.field=value`` settings of a typed dataclass, ``--help`` listing every
key with its allowed values, and each old flag refused with the spelling that replaced it, exit
status 2, before any compute."""

from __future__ import annotations

import dataclasses

import pytest

from diffjax import cli
from diffjax import sample as sample_mod
from diffjax.config import ConfigError, check_fields, fail

# ---------------------------------------------------------------------------- the shared parser


@dataclasses.dataclass(frozen=True)
class _Toy:
    count: int = 3  # how many. The rest of the comment is not shown
    mode: str = "a"  # which mode
    # a list of widths,
    # over two lines
    widths: tuple[int, ...] = (1, 2)

    def __post_init__(self):
        check_fields(self)
        if self.mode not in ("a", "b"):
            fail("_Toy", "mode", f"unknown mode {self.mode!r}", "use 'a' or 'b'")


TOY = (cli.Section("toy", _Toy(), {"mode": ("a", "b")}),)


def test_keys_help_lists_every_field_with_its_first_sentence_and_allowed_values():
    lines = cli.keys_help(TOY).splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith("  toy.count "))
    assert "int" in lines[i] and "default: 3" in lines[i]
    assert lines[i + 1].strip() == "how many"
    j = next(n for n, line in enumerate(lines) if line.startswith("  toy.mode "))
    assert lines[j + 1].strip() == "which mode; one of 'a', 'b'"
    k = next(n for n, line in enumerate(lines) if line.startswith("  toy.widths "))
    assert lines[k + 1].strip() == "a list of widths, over two lines"


def test_overrides_are_typed_and_checked_by_the_dataclass():
    out = cli.apply_overrides(TOY, ["toy.count=7", "toy.widths=4,8", "toy.mode=b"], "prog")
    assert out["toy"] == _Toy(count=7, mode="b", widths=(4, 8))
    assert cli.apply_overrides(TOY, [], "prog")["toy"] == _Toy()
    with pytest.raises(ConfigError, match=r"^toy.count: bad value 'x'.*Fix: give an integer\.$"):
        cli.apply_overrides(TOY, ["toy.count=x"], "prog")
    # the dataclass's own check, named by the key
    with pytest.raises(ConfigError, match=r"^toy.mode: unknown mode 'c'. Fix: use 'a' or 'b'\.$"):
        cli.apply_overrides(TOY, ["toy.mode=c"], "prog")
    with pytest.raises(ConfigError, match=r"unknown setting 'toy.cont'.*did you mean toy.count"):
        cli.apply_overrides(TOY, ["toy.cont=1"], "prog")


def test_overrides_are_split_from_inputs_up_to_a_double_dash():
    overrides, rest = cli.split_overrides(["run", "a.b=1", "x=1", "--", "c.d=2"])
    assert overrides == ["a.b=1"] and rest == ["run", "x=1", "--", "c.d=2"]
    assert cli.split_overrides(["gs://b/p=1", "dir/a.b=c"]) == ([], ["gs://b/p=1", "dir/a.b=c"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--old", "0.8"], "the flag --old is now toy.new=0.8"),
        (["--old=0.8"], "the flag --old is now toy.new=0.8"),
        (["--many", "1", "2", "toy.count=3"], "the flag --many is now toy.widths=1,2"),
        (["--switch"], "the flag --switch is now toy.mode=b"),
        (["--old", "two words"], "the flag --old is now toy.new='two words'"),
    ],
)
def test_a_renamed_flag_is_refused_with_its_new_spelling(argv, message):
    renamed = {
        "--old": cli.Renamed("toy.new={}"),
        "--many": cli.Renamed("toy.widths={}", values="many"),
        "--switch": cli.Renamed("toy.mode=b", values="none"),
    }
    with pytest.raises(ConfigError) as e:
        cli.refuse_renamed(argv, renamed, "prog")
    assert str(e.value).startswith(message + ". Fix: write ")
    cli.refuse_renamed(["--", "--old"], renamed, "prog")  # after --: an input, not a flag


# ---------------------------------------------------------------------------- every program
def _help(main, capsys) -> list[str]:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    return capsys.readouterr().out.splitlines()


def _described(lines: list[str], key: str) -> str:
    i = next(n for n, line in enumerate(lines) if line.startswith(f"  {key} "))
    assert lines[i + 1].startswith("      ") and lines[i + 1].strip(), key
    return lines[i + 1].strip()


def _refused(main, argv, capsys) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


# ------------------------------------------------------------------ python -m diffjax.sample
def test_sample_help_lists_every_key_with_its_allowed_values(capsys):
    lines = _help(sample_mod.main, capsys)
    for f in dataclasses.fields(sample_mod.SampleSettings):
        _described(lines, f"sample.{f.name}")
    assert _described(lines, "sample.step").endswith("one of 'best', 'latest', '<step number>'")
    assert _described(lines, "sample.temperature").startswith("0: greedy decoding")


@pytest.mark.parametrize(
    "argv, new",
    [
        (["--prompt", "def main("], "RUN_DIR 'def main('"),
        (["x", "--temperature", "0.8"], "sample.temperature=0.8"),
        (["x", "--max_new_tokens", "40"], "sample.max_new_tokens=40"),
        (["x", "--max-new-tokens=40"], "sample.max_new_tokens=40"),
        (["x", "--top_k", "5"], "sample.top_k=5"),
        (["x", "--sample-seed", "3"], "sample.sampling_seed=3"),
        (["x", "--model", "standard"], "sample.model=standard"),
        (["x", "--seed", "1"], "sample.train_seed=1"),
        (["x", "--step", "latest"], "sample.step=latest"),
        (["x", "--tokenizer", "byte"], "sample.tokenizer=byte"),
    ],
)
def test_sample_refuses_its_old_flags_naming_the_new_spelling(argv, new, capsys, tmp_path):
    err = _refused(sample_mod.main, [str(tmp_path / "nothing"), *argv], capsys)
    flag = next(a.split("=")[0] for a in argv if a.startswith("--"))
    assert f"error: the flag {flag} is now {new}" in err and f"Fix: write {new} instead" in err


@pytest.mark.parametrize(
    "override, message",
    [
        ("sample.temperature=-1", "sample.temperature: must be >= 0, got -1.0. Fix: use 0 for "),
        ("sample.top_k=x", "sample.top_k: bad value 'x': expected an integer"),
        ("sample.step=soon", "sample.step: 'soon' is not a checkpoint. Fix: use best, latest"),
        ("sample.max_new_tokens=0", "sample.max_new_tokens: must be >= 1, got 0. Fix: "),
    ],
)
def test_sample_bad_setting_names_the_field_and_the_fix(override, message, capsys, tmp_path):
    # refused before the run folder is read: it does not exist
    assert message in _refused(sample_mod.main, [str(tmp_path / "none"), "x", override], capsys)


# ------------------------------------------------------------------ python -m diffjax.evaluate
def _evaluate():
    import diffjax.evaluate.__main__ as evaluate_cli

    return evaluate_cli


def test_evaluate_help_lists_every_key_with_its_allowed_values(capsys):
    from diffjax.evaluate import EvalSettings
    from diffjax.evaluate.lm_eval_run import LmEvalSettings
    from diffjax.evaluate.long_context import LongContextSettings
    from diffjax.infra.sharding import MeshConfig

    lines = _help(_evaluate().main, capsys)
    for prefix, cls in (
        ("eval", EvalSettings),
        ("lm_eval", LmEvalSettings),
        ("long_context", LongContextSettings),
        ("mesh", MeshConfig),
    ):
        for f in dataclasses.fields(cls):
            if f.name != "quick":  # the --quick mode, not a setting
                _described(lines, f"{prefix}.{f.name}")
    assert not any(line.startswith("  eval.quick ") for line in lines)
    assert _described(lines, "mesh.context_order").endswith(
        "one of 'zigzag', 'striped', 'contiguous'"
    )
    assert _described(lines, "eval.bits") == "bit widths of the logit quantization"
    assert any(line.startswith("  --quick ") for line in lines)


@pytest.mark.parametrize(
    "argv, flag, new",
    [
        (["--long-context", "8192,32768"], "--long-context", "long_context.lengths=8192,32768"),
        (["--long-context-examples", "4"], "--long-context-examples", "long_context.examples=4"),
        (["--lm-eval-tasks", "piqa,arc_easy"], "--lm-eval-tasks", "lm_eval.tasks=piqa,arc_easy"),
        (["--lm-eval-only"], "--lm-eval-only", "lm_eval.only=true"),
        (["--lm-eval-include-path=t/"], "--lm-eval-include-path", "lm_eval.include_path=t/"),
        (
            ["--lm-eval-no-default-tasks"],
            "--lm-eval-no-default-tasks",
            "lm_eval.default_tasks=false",
        ),
        (["--lm-eval-limit", "100"], "--lm-eval-limit", "lm_eval.limit=100"),
        (["--lm-eval-batch-size", "4"], "--lm-eval-batch-size", "lm_eval.batch_size=4"),
        (["--lm-eval-num-fewshot", "0"], "--lm-eval-num-fewshot", "lm_eval.num_fewshot=0"),
    ],
)
def test_evaluate_refuses_its_old_flags_naming_the_new_spelling(argv, flag, new, capsys, tmp_path):
    err = _refused(_evaluate().main, [str(tmp_path), "--quick", *argv], capsys)
    assert f"error: the flag {flag} is now {new}. Fix: write {new} instead" in err


@pytest.mark.parametrize(
    "override, message",
    [
        ("eval.retrieval_examples=0", "eval.retrieval_examples: must be >= 1, got 0. Fix: set "),
        ("eval.bits=8,1", "eval.bits: must be bit widths in [2, 24], got (8, 1). Fix: e.g. "),
        ("eval.batch_size=many", "eval.batch_size: bad value 'many': expected an integer"),
        ("eval.quick=true", "unknown setting 'eval.quick'"),
        ("lm_eval.limit=0", "lm_eval.limit: must be > 0, got 0. Fix: e.g. lm_eval.limit=100"),
        ("long_context.examples=0", "long_context.examples: must be >= 1, got 0. Fix: "),
        ("mesh.context_order=spiral", "mesh.context_order: unknown"),
    ],
)
def test_evaluate_bad_setting_names_the_field_and_the_fix(override, message, capsys, tmp_path):
    # refused before the run folder is read: it holds nothing
    assert message in _refused(_evaluate().main, [str(tmp_path), override], capsys)


def test_evaluate_settings_reach_the_analyses(monkeypatch, tmp_path):
    """``eval.*`` changes single fields of the quick or the full set; the run directory is
    the positional input."""
    from diffjax.evaluate import EvalSettings

    cli_mod = _evaluate()
    calls = []
    monkeypatch.setattr(cli_mod, "evaluate_run", lambda run, **kw: calls.append((run, kw)))
    assert cli_mod.main([str(tmp_path), "--quick", "eval.bits=8,4", "eval.depth_bins=3"]) == 0
    assert cli_mod.main([str(tmp_path), "eval.val_examples=7"]) == 0
    (run, quick), (_, full) = calls
    assert run == str(tmp_path)
    assert quick["settings"] == dataclasses.replace(
        EvalSettings.for_run(True), bits=(8, 4), depth_bins=3
    )
    assert full["settings"] == dataclasses.replace(EvalSettings.for_run(False), val_examples=7)
    assert quick["quick"] and not full["quick"]


# ------------------------------------------------------------------ python -m diffjax.data.prepare
def test_prepare_help_lists_every_key_with_its_allowed_values(capsys):
    from diffjax.data import prepare as prep

    lines = _help(prep.main, capsys)
    for f in dataclasses.fields(prep.PrepareSettings):
        _described(lines, f"prepare.{f.name}")
    assert _described(lines, "prepare.dtype").endswith("one of 'auto', 'uint16', 'uint32'")
    assert _described(lines, "prepare.tokenizer").startswith("required: ")


@pytest.mark.parametrize(
    "argv, flag, new",
    [
        (["--tokenizer", "byte"], "--tokenizer", "prepare.tokenizer=byte"),
        (["--out", "gs://b/p"], "--out", "prepare.out=gs://b/p"),
        (["--text-field", "body"], "--text-field", "prepare.text_field=body"),
        (["--workers", "8"], "--workers", "prepare.workers=8"),
        (["--shard-tokens", "4000"], "--shard-tokens", "prepare.shard_tokens=4000"),
        (["--val-fraction=0.1"], "--val-fraction", "prepare.val_fraction=0.1"),
        (["--dtype", "uint32"], "--dtype", "prepare.dtype=uint32"),
        (["--quiet"], "--quiet", "prepare.progress=false"),
    ],
)
def test_prepare_refuses_its_old_flags_naming_the_new_spelling(argv, flag, new, capsys, tmp_path):
    from diffjax.data import prepare as prep

    out = tmp_path / "out"
    err = _refused(prep.main, [str(tmp_path / "a.txt"), *argv, f"prepare.out={out}"], capsys)
    assert f"error: the flag {flag} is now {new}. Fix: write {new} instead" in err
    assert not out.exists()


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "prepare.workers=0",
            "prepare.workers: must be >= 1, got 0. Fix: use e.g. prepare.workers=4",
        ),
        ("prepare.val_fraction=1", "prepare.val_fraction: must be in [0, 1), got 1.0. Fix: "),
        ("prepare.dtype=int8", "prepare.dtype: unknown dtype 'int8'. Fix: use one of auto, uint16"),
        (
            "prepare.shard_tokens=lots",
            "prepare.shard_tokens: bad value 'lots': expected an integer",
        ),
        (
            "prepare.out=",
            "prepare.tokenizer: is required. Fix: give it, e.g. prepare.tokenizer=byte",
        ),
    ],
)
def test_prepare_bad_setting_names_the_field_and_the_fix(override, message, capsys, tmp_path):
    from diffjax.data import prepare as prep

    (tmp_path / "a.txt").write_text("some text\n")
    assert message in _refused(prep.main, [str(tmp_path / "a.txt"), override], capsys)


# ------------------------------------------------------------------ python -m diffjax.kernels.check
def test_kernel_check_help_lists_every_key_with_its_allowed_values(capsys):
    from diffjax.kernels import check

    lines = _help(check.main, capsys)
    for f in dataclasses.fields(check.CheckSettings):
        _described(lines, f"check.{f.name}")
    assert _described(lines, "check.kind").endswith("one of 'v1', 'v2', 'standard'")
    assert _described(lines, "check.backend").endswith("one of 'gpu', 'tpu'")


@pytest.mark.parametrize(
    "argv, flag, new",
    [
        (["--interpret"], "--interpret", "check.interpret=true"),
        (["--backend", "tpu"], "--backend", "check.backend=tpu"),
        (["--head-dim", "64", "128"], "--head-dim", "check.head_dim=64,128"),
        (["--kind", "v1", "v2", "check.dtype=float32"], "--kind", "check.kind=v1,v2"),
        (["--dtype", "bfloat16"], "--dtype", "check.dtype=bfloat16"),
    ],
)
def test_kernel_check_refuses_its_old_flags_naming_the_new_spelling(argv, flag, new, capsys):
    from diffjax.kernels import check

    err = _refused(check.main, argv, capsys)
    assert f"error: the flag {flag} is now {new}. Fix: write {new} instead" in err


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "check.kind=v3",
            "check.kind: unknown kind 'v3'. Fix: use some of 'v1', 'v2', 'standard'.",
        ),
        ("check.backend=cuda", "check.backend: unknown backend 'cuda'. Fix: use one of 'gpu'"),
        ("check.head_dim=64,wide", "check.head_dim: bad value '64,wide': expected an integer"),
        ("check.interpret=maybe", "check.interpret: bad value 'maybe': expected true or false"),
    ],
)
def test_kernel_check_bad_setting_names_the_field_and_the_fix(override, message, capsys):
    from diffjax.kernels import check

    assert message in _refused(check.main, [override], capsys)


def test_kernel_check_settings_choose_the_cases():
    from diffjax.kernels import check

    chosen = check.CheckSettings(head_dim=(64,), kind=("v1", "v2"), dtype=("float32",)).cases()
    assert [(c.kind, c.head_dim, c.dtype) for c in chosen] == [
        ("v1", 64, "float32"),
        ("v2", 64, "float32"),
    ]
    assert check.CheckSettings().cases() == check.standard_cases()


# ------------------------------------------------------------------ python -m diffjax.plan
def test_plan_help_lists_its_keys_and_the_configs(capsys):
    from diffjax import plan as planner

    lines = _help(planner.main, capsys)
    for f in dataclasses.fields(planner.PlanSettings):
        _described(lines, f"plan.{f.name}")
    assert _described(lines, "plan.target").endswith(
        "one of 'v5e-8', 'v6e-8', 'v5p-8', 'h100-8', 'h200-8'"
    )
    assert _described(lines, "plan.search").endswith("one of 'all', 'remat', 'accum', 'none'")
    for key in ("model.d_model", "train.batch_size", "mesh.fsdp"):  # the config's keys too
        _described(lines, key)


@pytest.mark.parametrize(
    "argv, flag, new",
    [
        (["--target", "v5e-8"], "--target", "plan.target=v5e-8"),
        (["--hbm-gib", "4"], "--hbm-gib", "plan.hbm_gib=4"),
        (["--mfu", "0.5"], "--mfu", "plan.mfu=0.5"),
        (["--peak-tflops", "900"], "--peak-tflops", "plan.peak_tflops=900"),
        (["--model", "diff"], "--model", "plan.model=diff"),
        (["--search", "none"], "--search", "plan.search=none"),
        (["--json", "out.json"], "--json", "plan.json=out.json"),
    ],
)
def test_plan_refuses_its_old_flags_naming_the_new_spelling(argv, flag, new, capsys):
    from diffjax import plan as planner

    err = _refused(planner.main, ["plan.target=v5e-8", *argv, "model.d_model=64"], capsys)
    assert f"error: the flag {flag} is now {new}. Fix: write {new} instead" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan.target=v5e-8", "plan.mfu=1.5"], "plan.mfu: must be in (0, 1], got 1.5. Fix: e.g."),
        (["plan.target=v5e-8", "plan.search=some"], "plan.search: unknown search 'some'. Fix: "),
        (["plan.target=v5e-8", "plan.hbm_gib=lots"], "plan.hbm_gib: bad value 'lots': expected"),
        (["model.d_model=64"], "plan.target: is required. Fix: give one of v5e-8, v6e-8"),
        (["plan.target=v5e-8", "model.dmodel=64"], "unknown config key 'model.dmodel'"),
    ],
)
def test_plan_bad_setting_names_the_field_and_the_fix(argv, message, capsys):
    from diffjax import plan as planner

    assert message in _refused(planner.main, argv, capsys)


# ------------------------------------------------------------------ python -m diffjax.sweep
def test_sweep_help_lists_the_ladders_keys_and_the_configs(capsys):
    from diffjax.sweep.cli import main
    from diffjax.sweep.ladder import SCALAR_FIELDS

    lines = _help(main, capsys)
    for name in SCALAR_FIELDS:
        _described(lines, f"sweep.{name}")
    assert not any(line.startswith("  sweep.sizes ") for line in lines)  # the config file's
    assert _described(lines, "sweep.budget").endswith("one of 'fixed', 'proportional'")
    _described(lines, "train.steps")


def test_each_config_file_is_for_one_program_and_the_others_name_it(capsys):
    """Every configs/*.py loads under the program its declaration names (none: train.py;
    SWEEP, SENSITIVITY, RETROFIT: their own commands), and under any other is refused before
    anything runs, the right command named."""
    import pathlib

    from diffjax.compare import Comparison, studies
    from diffjax.compare.cli import main as train_main
    from diffjax.compare.retrofit_study import load_study
    from diffjax.retrofit_study import main as retrofit_main
    from diffjax.sweep.cli import main as sweep_main
    from diffjax.sweep.ladder import load_ladder
    from diffjax.sweep.lr_sensitivity import main as lr_main
    from diffjax.train.config import load_config

    programs = {None: train_main, "SWEEP": sweep_main, "SENSITIVITY": lr_main}
    programs["RETROFIT"] = retrofit_main
    root = pathlib.Path(__file__).resolve().parent.parent
    seen = set()
    for path in sorted(str(p) for p in root.glob("configs/*.py")):
        name, _ = studies.declared(path)
        seen.add(name)
        exp = load_config(path)  # every file's experiment: a comparison, or a study's one model
        assert isinstance(exp, Comparison) == (name != "RETROFIT"), path
        if name == "RETROFIT":
            assert load_study(path) is not None
        elif name is not None:
            load_ladder(path, name)
        right = studies.TRAIN if name is None else studies.COMMANDS[name]
        for other, main in programs.items():
            if other != name:
                assert main(["--config", path]) == 2, (path, other)
                assert f"Fix: {right} --config {path}" in capsys.readouterr().err, (path, other)
    assert seen == set(programs)  # a config file for every program


# ------------------------------------------------------------------ every written command line
def _renamed_by_program():
    from diffjax import plan as planner
    from diffjax.data import prepare as prep
    from diffjax.kernels import check

    return {
        "diffjax.sample": sample_mod.RENAMED,
        "diffjax.evaluate": _evaluate().RENAMED,
        "diffjax.data.prepare": prep.RENAMED,
        "diffjax.kernels.check": check.RENAMED,
        "diffjax.plan": planner.RENAMED,
    }


def written_commands(text: str) -> list[tuple[str, str]]:
    """``(program, its arguments)`` of every ``python -m diffjax.X ...`` in ``text``: to the
    closing backtick of inline code (markdown's or reStructuredText's), else to the end of the
    line (continued after a backslash)."""
    import re

    found = []
    for m in re.finditer(r"python -m (diffjax(?:\.\w+)+)", text):
        start = text.rfind("\n", 0, m.start()) + 1
        inline = re.search(r"`\S*$", text[start : m.start()]) is not None  # `python, ``/v/python
        rest = text[m.end() :]
        if inline:
            rest = rest.split("`", 1)[0]
        else:
            rest = re.split(r"(?<!\\)\n", rest, maxsplit=1)[0]
        found.append((m.group(1), rest.replace("\\\n", " ")))
    return found


def test_written_commands_are_found():
    text = "run `python -m diffjax.sample RUN --temperature\n0.8` then\n"
    text += "python -m diffjax.plan \\\n  --target v5e-8 # x\nnot --mfu\n"
    text += "    ``/v/bin/python -m diffjax.evaluate --lm-eval-only`` wrote it"
    assert written_commands(text) == [
        ("diffjax.sample", " RUN --temperature\n0.8"),
        ("diffjax.plan", "    --target v5e-8 # x"),
        ("diffjax.evaluate", " --lm-eval-only"),
    ]


# written commands known to use an old flag (none: every one is updated)
KNOWN_STALE: set[tuple[str, str]] = set()


def test_no_written_command_uses_a_renamed_flag():
    """The docs, README, configs, notebooks, benchmarks, CI script and the package's own
    messages spell every command line the new way."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    files = [root / "README.md", root / ".ci" / "run", *root.glob("docs/*.md")]
    files += [*root.glob("configs/*"), *root.glob("notebooks/*.ipynb"), *root.glob("benchmarks/*")]
    files += [p for p in root.glob("diffjax/**/*.py")]
    renamed = _renamed_by_program()
    stale = []
    for path in files:
        if not path.is_file():
            continue
        text = path.read_text()
        if path.suffix == ".ipynb":
            text = text.replace("\\n", "\n").replace('\\"', '"')
        for program, rest in written_commands(text):
            if (str(path.relative_to(root)), program) in KNOWN_STALE:
                continue
            try:
                cli.refuse_renamed(rest.split(), renamed.get(program, {}), program)
            except ConfigError as e:
                stale.append(f"{path.relative_to(root)}: python -m {program}{rest}: {e}")
    assert not stale, "\n".join(stale)
