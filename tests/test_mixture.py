"""Mixtures (``data.source=mixture``): weighted blends of prepared corpora built on Grain's
``MapDataset.mix``. Two tiny corpora prepared here with disjoint alphabets (``alpha``: lowercase
letters, ``beta``: uppercase), so every token says which corpus it came from. Tested: how a
mixture is written and refused, the same batches on any number of processes and devices, rows
disjoint and covering each global batch, the realised shares, documents apart across
components, a component running out (repeated in a new order, or the end of training), the
iterator state resumed, a change of weights at a resume (refused, or recorded and continuing
each component), and training: per-component validation in metrics, TensorBoard and
report.md, a SIGKILL resumed bit for bit."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from diffjax.compare.cli import main
from diffjax.config import ConfigError
from diffjax.data import (
    MixtureData,
    BOS,
    EOS,
    PAD,
    DataConfig,
    DataError,
    MixtureComponent,
    check_data,
    make_dataset,
    make_source,
    mixture_plan,
    resume_stages,
)
from diffjax.data import prepare as prep
from diffjax.data.mixture import counts_before, int_proportions, shares
from diffjax.train import apply_overrides, default_config
from diffjax.train.checkpoint import Checkpointer
from diffjax.train.metrics import read_metrics
from tiny import tiny_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALPHA, BETA = "abcdefghijklm", "NOPQRSTUVWXYZ"
T, B = 16, 8  # seq_len, global batch


def write_docs(folder, letters: str, docs: int, low: int, high: int, seed: int):
    """``folder/docs.jsonl`` of ``docs`` documents of ``letters``; the folder is what is
    prepared, so the split (by each document's key, ``docs.jsonl:LINE``) is the same in every
    temporary directory."""
    rng = np.random.default_rng(seed)
    chars = np.array(list(letters))
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "docs.jsonl"), "w") as fh:
        for _ in range(docs):
            text = "".join(rng.choice(chars, int(rng.integers(low, high))))
            fh.write(json.dumps({"text": text}) + "\n")
    return folder


def prepare(inputs, out, tokenizer="byte"):
    options = prep.PrepareOptions(
        tuple(map(str, inputs)), tokenizer, str(out), shard_tokens=700, val_fraction=0.2
    )
    return prep.prepare(dataclasses_replace(options, progress=False))


def dataclasses_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, str]:
    """Two prepared corpora (byte tokenizer): ``alpha`` (245 train windows of 16 + 1) and
    ``beta`` (15: at weight 0.3 it runs out in the 6th batch of 8)."""
    tmp = tmp_path_factory.mktemp("mixture")
    write_docs(tmp / "alpha_docs", ALPHA, docs=60, low=40, high=120, seed=0)
    write_docs(tmp / "beta_docs", BETA, docs=9, low=15, high=35, seed=1)
    out = {}
    for name in ("alpha", "beta"):
        prepare([tmp / f"{name}_docs"], tmp / name)
        out[name] = str(tmp / name)
    return out


def mixture(corpora, weights=(0.7, 0.3), seed=0, **kw) -> DataConfig:
    """A two-corpus mixture; ``kw``: the mixture section's other settings."""
    parts = tuple(
        MixtureComponent(name, corpora[name], w) for name, w in zip(("alpha", "beta"), weights)
    )
    return DataConfig(
        source="mixture",
        seq_len=T,
        prefetch=0,
        seed=seed,
        mixture=MixtureData(components=parts, **kw),
    )


def batches(config, n, *, pi=0, pc=1, stages=None, state=None):
    it = iter(
        make_dataset(
            config, "train", batch_size=B // pc, process_index=pi, process_count=pc,
            mixture_stages=stages,
        )
    )  # fmt: skip
    if state is not None:
        it.set_state(state)
    return [next(it) for _ in range(n)]


def origin(row: np.ndarray) -> set[str]:
    """Which alphabets the tokens of a row come from."""
    found = set()
    for t in row:
        if t in (BOS, EOS, PAD):
            continue
        found.add("alpha" if chr(t) in ALPHA else "beta" if chr(t) in BETA else "other")
    return found


# ---------------------------------------------------------------------------- Grain's mix
@pytest.mark.parametrize("weights", [(0.7, 0.3), (1, 1, 1), (3, 1, 0.01), (0.123, 0.877)])
def test_grain_mix_positions_have_the_closed_form_counts(weights):
    """The plan's count of each component among the first k examples (what the log, the
    stages and the report use) is Grain's own assignment of positions, read off
    ``grain.MapDataset.mix`` of marked ranges."""
    import grain

    big = 10**6
    ds = grain.MapDataset.mix(
        [grain.MapDataset.range(i * big, (i + 1) * big) for i in range(len(weights))],
        list(weights),
    )
    props, seen = int_proportions(weights), [0] * len(weights)
    for k in range(2000):
        assert counts_before(k, props) == seen
        i, j = divmod(ds[k], big)
        assert j == seen[i]  # the k-th example is the next one of its dataset
        seen[i] += 1
    for i, w in enumerate(weights):  # the realised share: within 1% of the smallest weight
        assert abs(seen[i] / 2000 - w / sum(weights)) < 0.01 * min(weights) / sum(weights) + 1e-3


# ---------------------------------------------------------------------------- the config
def test_a_mixture_is_written_in_a_config_file_or_on_the_command_line():
    """``data.mixture.components=NAME:WEIGHT:PATH,...`` (text: and stdlib spellings too), one field as
    ``data.mixture.NAME.FIELD=VALUE``; the typed dataclass round-trips through a checkpoint's
    JSON and its command-line text."""
    exp = apply_overrides(
        default_config(),
        [
            "data.source=mixture",
            "data.mixture.components=web:0.7:gs://bucket/web,code:0.2:text:src/,lib:0.1:stdlib,"
            "mods:0.1:stdlib:modules",
            "data.mixture.code.max_files=3",
            "data.mixture.web.val_fraction=0",
            "data.mixture.exhausted=stop",
        ],
    )
    web, code, lib, mods = exp.data.mixture.components
    assert mods == MixtureComponent("mods", None, 0.1, "stdlib", stdlib_part="modules")
    assert web == MixtureComponent("web", "gs://bucket/web", 0.7, "tokens", val_fraction=0.0)
    assert code == MixtureComponent("code", "src/", 0.2, "text", max_files=3)
    assert lib == MixtureComponent("lib", None, 0.1, "stdlib")
    # the command-line text holds name, weight and where (a component's other fields are set
    # one by one)
    assert MixtureComponent.from_text(str(web)) == dataclasses_replace(web, val_fraction=None)
    assert [MixtureComponent.from_text(str(c)) for c in (lib, mods)] == [lib, mods]
    assert MixtureComponent.from_text(str(code)) == dataclasses_replace(code, max_files=None)
    saved = json.loads(json.dumps(exp.to_dict()["data"]))
    assert DataConfig.from_saved(saved) == exp.data
    part = exp.data.component("code")  # its own settings, the mixture's seq_len
    assert (part.source, part.path, part.max_files, part.seq_len) == ("text", "src/", 3, 128)
    assert exp.data.weights == {"web": 0.7, "code": 0.2, "lib": 0.1, "mods": 0.1}
    assert shares({"a": 0.7, "b": 0.3})["a"] == pytest.approx(233 / 333)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.source=mixture"], r"DataConfig.mixture.components: source='mixture' but no component"),
        (["data.mixture.components=a:1:p"], r"DataConfig.mixture.components: is a mixture setting but source='stdlib'"),
        (["data.source=mixture", "data.mixture.components=a:0:p,b:0:q"], r"every weight is 0 \(a, b\)"),
        (["data.source=mixture", "data.mixture.components=a:-1:p"], r"mixture\[a\].weight: must be .* >= 0"),
        (["data.source=mixture", "data.mixture.components=a:1:p,a:2:q"], r"names the component 'a' more"),
        (["data.source=mixture", "data.mixture.components=a:x:p"], r"the weight 'x' of 'a:x:p' is not a"),
        (["data.source=mixture", "data.mixture.components=a b:1:p"], r"'a b' is not a component name"),
        (["data.source=mixture", "data.mixture.components=a:1:p", "data.mixture.b.weight=1"],
         r"data.mixture.b.weight: the mixture has no component 'b' \(its components: a\)"),
        (["data.source=mixture", "data.mixture.components=a:1:p", "data.mixture.a.size=1"],
         r"data.mixture.a.size: not a component setting"),
        (["data.source=mixture", "data.mixture.components=a:1:p", "data.mixture.a.val_fraction=2"],
         r"DataConfig.mixture\[a\].val_fraction: must be in \[0, 1\)"),
        (["data.source=mixture", "data.mixture.components=a:1:p", "data.path=x"],
         r"DataConfig.path: source='mixture' reads its components' paths"),
        (["data.source=mixture", "data.mixture.components=a:1:p", "data.mixture.exhausted=wrap"],
         r"DataConfig.mixture.exhausted: unknown setting 'wrap'"),
        (["data.source=mixture", "data.mixture.components=a:1:p", "data.mixture.a.stdlib_part=modules"],
         r"DataConfig.mixture\[a\].stdlib_part: is a stdlib setting"),
        (["data.source=mixture", "data.mixture.components=a:1:stdlib", "data.mixture.a.stdlib_part=docs"],
         r"DataConfig.mixture\[a\].stdlib_part: unknown part 'docs'"),
        (["data.source=text", "data.path=x", "data.stdlib.part=modules"],
         r"DataConfig.stdlib.part: is a stdlib setting but source='text'"),
    ],
)  # fmt: skip
def test_bad_mixture_settings_are_refused_at_construction(overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        apply_overrides(default_config(), overrides)
    assert "Fix:" in str(info.value)


def _no_manifest(corpora, tmp):
    shutil.copytree(corpora["beta"], tmp / "beta")
    os.remove(tmp / "beta" / "manifest.json")  # an unfinished preparation
    return ["data.mixture.beta.path=" + str(tmp / "beta")]


def _missing_shard(corpora, tmp):
    shutil.copytree(corpora["beta"], tmp / "beta")
    os.remove(tmp / "beta" / "train_00000.bin")
    return ["data.mixture.beta.path=" + str(tmp / "beta")]


def _other_tokenizer(corpora, tmp):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(BETA + "[UNK]")}, "[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.save(str(tmp / "tokenizer.json"))
    docs = write_docs(tmp / "beta_docs", BETA, docs=12, low=15, high=35, seed=1)
    prepare([docs], tmp / "beta", tokenizer=str(tmp / "tokenizer.json"))
    return ["data.mixture.beta.path=" + str(tmp / "beta")]


def _other_vocab(corpora, tmp):
    shutil.copytree(corpora["beta"], tmp / "beta")
    manifest = json.loads((tmp / "beta" / "manifest.json").read_text())
    manifest["vocab_size"] = 300
    (tmp / "beta" / "manifest.json").write_text(json.dumps(manifest))
    return ["data.mixture.beta.path=" + str(tmp / "beta")]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda c, t: ["data.mixture.beta.path=" + str(t / "nope")], r"nope' does not exist"),
        (_no_manifest, r"holds no manifest.json: it is not a prepared corpus, or its prep"),
        (_missing_shard, r"lists train_00000.bin with \d+ uint16 tokens, but the file is miss"),
        (_other_tokenizer, r"its ids come from the tokenizer .*tokenizer.json' \(\d+ ids\), tho"),
        (_other_vocab, r"tokenizer 'byte' \(300 ids\), those of component 'alpha' from 'byte'"),
    ],
)
def test_bad_components_are_refused_before_training_naming_the_component(
    corpora, tmp_path, capsys, make, message
):
    """A missing component, a folder whose preparation did not finish, one whose manifest
    lists a shard that is not there, another tokenizer or vocabulary: train.py stops with
    exit 2 naming the component and the fix, before any model is built."""
    extra = make(corpora, tmp_path)
    run = tmp_path / "run"
    args = [f"run.dir={run}", *train_args(corpora), *extra]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: DataConfig.mixture[beta]") and "Fix:" in err, err
    assert __import__("re").search(message, err), err
    assert not (run / "diff").exists()


def test_the_example_config_mixes_two_disjoint_parts_of_the_stdlib():
    """configs/mixture_cpu.py loads and validates; its components, the stdlib's top-level
    modules and its packages, are disjoint, together the stdlib corpus, each file in the split
    it has there."""
    from diffjax.data.sources import load_corpus, text_files
    from diffjax.train import load_config

    exp = load_config(os.path.join(ROOT, "configs", "mixture_cpu.py"))
    assert exp.data.source == "mixture" and exp.data.weights == {"modules": 0.5, "packages": 0.5}
    summary = check_data(exp.data, exp.model.vocab_size)
    assert "modules (50%)" in summary.description and "its packages" in summary.description
    keys = {
        c.name: {k for k, _ in text_files(exp.data.component(c.name))}
        for c in exp.data.mixture.components
    }
    whole = DataConfig(source="stdlib", seq_len=exp.data.seq_len)
    assert keys["modules"] and all("/" not in k for k in keys["modules"])
    assert keys["packages"] and all("/" in k for k in keys["packages"])
    assert keys["modules"] | keys["packages"] == {k for k, _ in text_files(whole)}
    assert not keys["modules"] & keys["packages"]
    val = [len(load_corpus(exp.data.component(n)).validation) for n in keys]
    assert sum(val) == len(load_corpus(whole).validation) and min(val) > 0


# ---------------------------------------------------------------------------- the batches
def test_same_batches_on_any_number_of_processes(corpora):
    """Global batch j is the same rows in the same order on 1, 2 or 4 processes: each
    process's rows are its slice of it, disjoint from the others', together the batch once;
    another data.seed gives another order."""
    config, n = mixture(corpora), 30
    one = batches(config, n)
    for pc in (2, 4):
        parts = [batches(config, n, pi=pi, pc=pc) for pi in range(pc)]
        for j in range(n):
            for key in one[j]:
                glued = np.concatenate([parts[pi][j][key] for pi in range(pc)])
                np.testing.assert_array_equal(glued, one[j][key])
    plan, checked = mixture_plan(config, B), 0
    for j, b in enumerate(one):  # distinct examples, but where a component's pass ends in it
        before, after = plan.examples_read(j), plan.examples_read(j + 1)
        if any(before[k] // m != (after[k] - 1) // m for k, m in plan.lengths.items()):
            continue  # the end of one pass and the start of the next (another order)
        rows = {(int(c), r.tobytes()) for c, r in zip(b["component"], b["inputs"])}
        assert len(rows) == B
        checked += 1
    assert checked >= n // 2
    other = batches(mixture(corpora, seed=1), 3)  # another data.seed: another order
    assert not np.array_equal(other[0]["inputs"], one[0]["inputs"])


STREAM_PY = """
import sys
import jax
import numpy as np

port, n, i, alpha, beta, out = sys.argv[1:]
jax.distributed.initialize(f"127.0.0.1:{port}", int(n), int(i))
from diffjax.infra import sharding
from diffjax.train import apply_overrides, default_config
from diffjax.train.setup import process_stream

mix = f"data.mixture.components=alpha:0.7:{alpha},beta:0.3:{beta}"
exp = apply_overrides(default_config(), [
    "data.source=mixture", mix, "data.seq_len=16", "train.batch_size=8", "data.prefetch=0"])
saved = {}
for name, mesh in (("data", sharding.MeshConfig(data=-1)), ("tensor", sharding.MeshConfig(tensor=4))):
    stream = process_stream(exp, "train", sharding.make_mesh(mesh))
    for j in range(12):
        for key, value in next(stream).items():
            saved[f"{name}/{j}/{key}"] = value
np.savez(out, **saved)
"""


def test_the_loops_stream_on_two_processes_of_two_devices(corpora, tmp_path):
    """Two processes (jax.distributed on 127.0.0.1) of 2 CPU devices each: on a data=4 mesh
    each feeds its half of every global batch, the halves disjoint and together the
    single-process batch; on a tensor=4 mesh (both processes hold every row) each reads the
    whole batch."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="2")
    flags = os.environ.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(f for f in flags if "device_count" not in f)
    outs = [tmp_path / f"p{i}.npz" for i in range(2)]

    def child(i: int) -> list[str]:
        paths = [corpora["alpha"], corpora["beta"], str(outs[i])]
        return [sys.executable, "-c", STREAM_PY, str(port), "2", str(i), *paths]

    kw = dict(cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    procs = [subprocess.Popen(child(i), **kw) for i in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0, out[-3000:]
    got = [np.load(o) for o in outs]
    one = batches(mixture(corpora), 12)
    for j, want in enumerate(one):
        for key in want:
            halves = [g[f"data/{j}/{key}"] for g in got]
            assert all(h.shape[0] == B // 2 for h in halves)
            np.testing.assert_array_equal(np.concatenate(halves), want[key])
            for g in got:
                np.testing.assert_array_equal(g[f"tensor/{j}/{key}"], want[key])


def test_a_component_in_a_bucket_gives_the_local_batches(corpora, bucket):
    """beta uploaded to a bucket (a real GCS API server on 127.0.0.1): the mixture's batches
    of each of two processes, and the iterator's state after them, are those of the local
    folders bit for bit; the prefix without its manifest is refused naming the component."""
    from diffjax.infra import storage

    for name in os.listdir(corpora["beta"]):
        storage.upload(os.path.join(corpora["beta"], name), f"{bucket}/beta/{name}")
    local = mixture(corpora)
    remote = mixture({**corpora, "beta": f"{bucket}/beta"})
    check_data(remote)
    for pi in range(2):
        a = iter(make_dataset(local, "train", batch_size=B // 2, process_index=pi, process_count=2))
        b = iter(
            make_dataset(remote, "train", batch_size=B // 2, process_index=pi, process_count=2)
        )
        for _ in range(8):
            x, y = next(a), next(b)
            assert all(np.array_equal(x[k], y[k]) for k in x)
        assert a.get_state() == b.get_state()
    storage.remove(f"{bucket}/beta/manifest.json")
    with pytest.raises(DataError, match=r"^DataConfig.mixture\[beta\].*manifest.json.*Fix:"):
        check_data(remote)


def test_realised_shares_match_the_weights(corpora):
    """Over 200 batches each component's share of the rows is its weight (to Grain's rounding
    of the weights), every batch within one row of it; the plan counts the same rows."""
    for weights in ((0.7, 0.3), (0.5, 0.5), (0.9, 0.1)):
        config = mixture(corpora, weights)
        got = batches(config, 200)
        tags = np.stack([b["component"] for b in got])  # [batches, B]
        share = np.bincount(tags.ravel(), minlength=2) / tags.size
        np.testing.assert_allclose(share, np.array(weights) / sum(weights), atol=0.005)
        per_batch = (tags == 0).sum(1)
        assert np.all(np.abs(per_batch - B * weights[0] / sum(weights)) < 1 + 1e-9)
        plan = mixture_plan(config, B)
        read = plan.examples_read(200)
        assert [read["alpha"], read["beta"]] == np.bincount(tags.ravel(), minlength=2).tolist()


def test_documents_stay_apart_across_components(corpora):
    """Every row is a window of one component (all its letters from that component's alphabet,
    its tag naming it), with the segment ids and positions that component's own document
    index gives the window: no example, and no document, spans two components."""
    config = mixture(corpora)
    windows = {}
    for i, name in enumerate(("alpha", "beta")):
        src = make_source(config.component(name), "train")
        for j in range(len(src)):
            ex = src[j]
            windows[(i, ex["inputs"].tobytes())] = ex
    for b in batches(config, 40):
        assert set(b) >= {"segment_ids", "positions", "component"}
        for r in range(B):
            c = int(b["component"][r])
            assert origin(b["inputs"][r]) == {("alpha", "beta")[c]}
            ex = windows[(c, b["inputs"][r].tobytes())]
            for key in ("targets", "weights", "segment_ids", "positions"):
                np.testing.assert_array_equal(b[key][r], ex[key])
            starts = np.flatnonzero(b["inputs"][r] == BOS)
            assert all(b["positions"][r][s] == 0 for s in starts)  # a document starts afresh


def test_a_component_that_runs_out_starts_over_in_a_new_order_and_is_said(corpora):
    """``repeat``: beta's examples all appear once before any appears twice; the batch of its
    first repeat is the one the plan's note names, and its second pass is another order."""
    config = mixture(corpora)
    plan = mixture_plan(config, B)
    n = plan.lengths["beta"]
    got = batches(config, 3 * n // 2)
    order = [
        r.tobytes() for b in got for c, r in zip(b["component"], b["inputs"]) if c == 1
    ]  # beta's rows, in the order read
    assert len(set(order[:n])) == n and order[n] in order[:n]
    seen = np.cumsum([int((b["component"] == 1).sum()) for b in got])  # beta's rows so far
    first_repeat = int(np.argmax(seen > n))  # the batch that reads beta's (n + 1)-th row
    notes = [(j, note) for j in range(len(got)) for note in plan.notes(j)]
    assert [j for j, note in notes if "'beta'" in note][0] == first_repeat
    assert f"all its {n} train examples; step {first_repeat + 1} reads it again" in notes[0][1]
    assert order[n : 2 * n] != order[:n] and sorted(order[n : 2 * n]) == sorted(order[:n])


def test_a_stop_mixture_ends_when_a_component_runs_out(corpora):
    """``stop``: the batches end at the plan's count, no example read twice, the component
    named that ran out; a state saved at the end resumes at the end."""
    config = mixture(corpora, exhausted="stop")
    plan = mixture_plan(config, B)
    end = plan.available_batches()
    it = iter(make_dataset(config, "train", batch_size=B))
    got = list(it)
    assert len(got) == end and plan.ran_out() == ["beta"]
    rows = [(int(c), r.tobytes()) for b in got for c, r in zip(b["component"], b["inputs"])]
    assert len(set(rows)) == len(rows)
    assert plan.examples_read(end)["beta"] <= plan.lengths["beta"]
    assert "component 'beta' runs out after" in plan.stop_note(end + 1)
    assert plan.stop_note(end) is None
    again = iter(make_dataset(config, "train", batch_size=B))
    again.set_state(it.get_state())
    assert next(again, None) is None


def test_iterator_state_resumes_the_same_batches(corpora):
    """The state after k batches (through a JSON round trip, as a checkpoint holds it) gives
    the next batches bit for bit, also past a component's first pass."""
    config = mixture(corpora)
    it = iter(make_dataset(config, "train", batch_size=B))
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    after = [next(it) for _ in range(20)]
    for got, want in zip(batches(config, 20, state=state), after):
        assert all(np.array_equal(got[k], want[k]) for k in want)


def test_changed_weights_at_a_resume_need_the_setting_and_continue_each_component(corpora):
    """Other weights at a resume are refused without data.mixture.reweight (naming it), a
    component left out is refused (naming weight 0); with it a new stage starts at the resumed
    batch: the batches before it are the first stage's, and after it each component goes on
    with the examples after those it had given."""
    old = mixture(corpora)
    new = mixture(corpora, (0.5, 0.5), reweight=True)
    saved = json.loads(json.dumps(old.to_dict()))
    with pytest.raises(ConfigError, match=r"alpha 0.7 -> 0.5, beta 0.3 -> 0.5.*mixture.reweight"):
        resume_stages(new.replace(mixture=dict(reweight=False)), None, saved, 6, 6)
    alone = DataConfig(
        source="mixture", seq_len=T, mixture=MixtureData(components=old.mixture.components[:1])
    )
    with pytest.raises(ConfigError, match=r"mixes the component 'beta'.*weight=0"):
        resume_stages(alone, None, saved, 6, 6)
    assert resume_stages(old, None, saved, 6, 6) == (resume_stages(old, None, saved, 6, 6)[0], None)
    stages, note = resume_stages(new, None, saved, 6, 6)
    assert "the weights change at step 6 (alpha 0.7 -> 0.5, beta 0.3 -> 0.5" in note
    dicts = [s.to_dict() for s in stages]
    first, staged = batches(old, 6), batches(new, 10, stages=dicts)
    for a, b in zip(first, staged[:6]):
        assert all(np.array_equal(a[k], b[k]) for k in a)
    tags = np.stack([b["component"] for b in staged[6:]])
    assert (tags == 0).sum() == (tags == 1).sum()  # 0.5 / 0.5 from the resumed batch on
    plan = mixture_plan(new, B, dicts)
    for c, name in enumerate(("alpha", "beta")):  # each continues its own order
        alone = mixture(corpora, (1, 0) if c == 0 else (0, 1))
        straight = [r for b in batches(alone, 12) for r in b["inputs"]]
        read = plan.offsets(1)[name]
        rows = [r for b in staged[6:] for cc, r in zip(b["component"], b["inputs"]) if cc == c]
        n = plan.lengths[name]
        if read + len(rows) <= n:  # within the first pass the orders must agree
            want = straight[read : read + len(rows)]
            assert all(np.array_equal(x, y) for x, y in zip(rows, want))


# ---------------------------------------------------------------------------- training
def train_args(corpora, *extra) -> list[str]:
    return tiny_run(
        f"data.seq_len={T}",
        f"train.batch_size={B}",
        "train.steps=8",
        "train.eval_every=4",
        "train.checkpoint_every=4",
        "data.source=mixture",
        f"data.mixture.components=alpha:0.7:{corpora['alpha']},beta:0.3:{corpora['beta']}",
        *extra,
        drop=("data.max_files", "train.tensorboard"),
    )


KILLED_TRAIN_PY = """
import os, signal, sys
from diffjax.compare.cli import main

def kill(step, checkpointer):
    if step == 6:
        checkpointer.wait()
        os.kill(os.getpid(), signal.SIGKILL)

sys.exit(main(sys.argv[1:], after_step=kill))
"""


def train_py(args, script=None):
    cmd = [sys.executable, *(["-c", script] if script else [os.path.join(ROOT, "train.py")])]
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "1"}
    return subprocess.run([*cmd, *args], env=env, cwd=ROOT, capture_output=True, text=True)


def losses(model_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(str(model_dir / "metrics.jsonl"))]


@pytest.fixture(scope="module")
def straight(corpora, tmp_path_factory):
    """A DIFF-vs-twin run of 8 steps on the mixture, never interrupted (TensorBoard on)."""
    run = tmp_path_factory.mktemp("straight") / "run"
    out = train_py([f"run.dir={run}", *train_args(corpora)])
    assert out.returncode == 0, out.stderr[-3000:]
    return run, out.stdout


@pytest.mark.xdist_group("mixture-train")
def test_training_reports_each_component_and_a_kill_resumes_bit_for_bit(
    corpora, straight, tmp_path
):
    """Each evaluation records val_loss/<component> and val_loss, their blend by the training
    shares; TensorBoard has them; report.md has a row per component with DIFF − twin and the
    mixture's table (weights, shares, passes); the log says beta ran out. SIGKILLed after step
    6 and resumed, the run's losses equal the uninterrupted run's bit for bit."""
    from tensorboard.backend.event_processing import event_accumulator

    run, stdout = straight
    assert "[diff] data.mixture: component 'beta' has given all its" in stdout
    for label in ("diff", "standard"):
        evals = [
            r
            for r in read_metrics(str(run / label / "seed_0" / "metrics.jsonl"))
            if "val_loss" in r
        ]
        assert [r["step"] for r in evals] == [4, 8]
        for r in evals:
            a, b = r["val_loss/alpha"], r["val_loss/beta"]
            assert r["val_loss"] == pytest.approx((233 * a + 100 * b) / 333)
        result = json.loads((run / label / "seed_0" / "result.json").read_text())
        mix = result["mixture"]["components"]
        assert mix["alpha"]["examples"] + mix["beta"]["examples"] == 8 * B
        assert (
            mix["beta"]["passes"] > 1
            and result["metrics"]["val_loss/beta"] == evals[-1]["val_loss/beta"]
        )
    acc = event_accumulator.EventAccumulator(str(run / "diff" / "seed_0" / "tb"))
    acc.Reload()
    assert {"val_loss", "val_loss/alpha", "val_loss/beta"} <= set(acc.Tags()["scalars"])
    report = (run / "report.md").read_text()
    assert "| validation loss: alpha |" in report and "| validation loss: beta |" in report
    assert "**The mixture** (2 components" in report
    read = mixture_plan(mixture(corpora), B).examples_read(8)  # Grain's positions: 19 of 64
    assert f"| beta | 0.3 | {read['beta'] / (8 * B):.1%} |" in report
    assert f"| alpha | 0.7 | {read['alpha'] / (8 * B):.1%} |" in report

    killed = tmp_path / "killed"
    out = train_py([f"run.dir={killed}", *train_args(corpora)], KILLED_TRAIN_PY)
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    assert len(losses(killed / "diff" / "seed_0")) < 8
    out = train_py([f"run.dir={killed}", *train_args(corpora), "--resume"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming from the checkpoint at step 4" in out.stdout
    for label in ("diff", "standard"):
        assert losses(killed / label / "seed_0") == losses(run / label / "seed_0")


@pytest.mark.xdist_group("mixture-train")
def test_the_evaluation_gives_each_components_loss_and_its_difference(straight, tmp_path):
    """python -m diffjax.evaluate on a mixture run: eval.json holds each component's loss, the
    loss of the model on that component alone (evaluated as a run on the component's corpus),
    and eval.md a row per component and DIFF − twin on each."""
    import dataclasses

    from diffjax.evaluate import EvalSettings, evaluate_model, evaluate_run
    from diffjax.evaluate.run import data_config, read_run_config
    from diffjax.train.checkpoint import load_model

    run, _ = straight
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    settings = dataclasses.replace(EvalSettings.for_run(True), val_examples=6, bits=(8,))
    text = evaluate_run(str(copy), settings=settings, log=lambda *_: None)
    assert "| validation loss: alpha |" in text and "| validation loss: beta |" in text
    assert "- validation loss on beta (nats), DIFF minus the twin:" in text
    entries = json.loads((copy / "eval.json").read_text())["models"]
    data = data_config(read_run_config(str(copy)))
    for entry in entries:
        by = entry["val_loss_by_component"]
        assert sorted(by) == ["alpha", "beta"] and by["alpha"] != by["beta"]
        model = load_model(str(copy / entry["label"] / "seed_0"), "best")
        for name in ("alpha", "beta"):
            alone = evaluate_model(model, data.component(name), settings, log=lambda *_: None)
            assert by[name] == pytest.approx(alone["val_loss"], rel=1e-6)
            assert "val_loss_by_component" not in alone  # one corpus: no components


@pytest.mark.xdist_group("mixture-train")
def test_weights_changed_at_a_resume_are_refused_then_recorded(corpora, straight, tmp_path, capsys):
    """The finished run continued to 12 steps at 0.5/0.5: refused before training without
    data.mixture.reweight (nothing written); with it, the log, every later checkpoint,
    result.json and report.md record the change at step 8."""
    run = tmp_path / "run"
    shutil.copytree(straight[0], run)
    before = (run / "diff" / "seed_0" / "metrics.jsonl").read_text()
    args = [f"run.dir={run}", *train_args(corpora, "train.steps=12", "compare.twins=")]
    args += ["data.mixture.alpha.weight=0.5", "data.mixture.beta.weight=0.5"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "data.mixture: the weights differ from those of the checkpoint at step 8" in err
    assert "Fix: set data.mixture.reweight=true" in err
    assert (run / "diff" / "seed_0" / "metrics.jsonl").read_text() == before
    assert main([*args, "data.mixture.reweight=true"]) == 0
    out = capsys.readouterr().out
    assert "the weights change at step 8 (alpha 0.7 -> 0.5, beta 0.3 -> 0.5" in out
    assert "data config differs" not in out
    ckpt = Checkpointer(str(run / "diff" / "seed_0" / "checkpoints"))
    stages = ckpt.read_meta(12)["mixture_stages"]
    ckpt.close()
    assert [(s["step"], s["weights"]) for s in stages] == [
        (0, {"alpha": 0.7, "beta": 0.3}),
        (8, {"alpha": 0.5, "beta": 0.5}),
    ]
    result = json.loads((run / "diff" / "seed_0" / "result.json").read_text())
    assert result["mixture"]["stages"] == stages
    read = result["mixture"]["components"]
    first = counts_before(8 * B, int_proportions([0.7, 0.3]))  # 8 steps at 0.7 / 0.3: 45, 19
    assert [read["alpha"]["examples"], read["beta"]["examples"]] == [n + 2 * B for n in first]
    assert (
        "Weights over the run: from step 0: alpha 0.7, beta 0.3; from step 8: alpha 0.5"
        in (run / "report.md").read_text()
    )


def test_training_stops_when_a_stop_mixture_ends(corpora, tmp_path, capsys):
    """``data.mixture.exhausted=stop``: the log says before training where it will stop and
    then that it stopped; the last step is evaluated and saved."""
    run = tmp_path / "run"
    args = [f"run.dir={run}", *train_args(corpora, "train.steps=40", "compare.twins=")]
    args += ["data.mixture.exhausted=stop", "train.tensorboard=false"]
    assert main(args) == 0
    out = capsys.readouterr().out
    end = mixture_plan(mixture(corpora, exhausted="stop"), B).available_batches()
    assert f"component 'beta' runs out after {end} steps" in out
    assert f"training stops after step {end} (data.mixture.exhausted=stop)" in out
    records = read_metrics(str(run / "diff" / "seed_0" / "metrics.jsonl"))
    assert records[-1]["step"] == end and "val_loss" in records[-1]
    assert end in Checkpointer(str(run / "diff" / "seed_0" / "checkpoints")).all_steps()


def test_check_data_describes_each_component(corpora):
    summary = check_data(mixture(corpora))
    assert summary.description.startswith("mixture of 2 components")
    assert "alpha (70%)" in summary.description and "beta (30%)" in summary.description
    with pytest.raises(DataError, match=r"mixture\[alpha\].*vocab_size"):
        check_data(mixture(corpora), vocab_size=100)
