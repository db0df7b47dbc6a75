"""The benchmark scripts run on CPU (tiny sizes) and print their tables."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(ROOT, "benchmarks", f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_gpu_script_rehearses_every_part_on_cpu(tmp_path):
    """``benchmarks/gpu_train.sh`` with ``GPU_TRAIN_TINY=1``: the same script the GPU runs, at a
    tiny size (the kernel check interpreted, cuDNN's compositions on XLA), writes every table."""
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "benchmarks", "gpu_train.sh")],
        cwd=ROOT,
        env={**os.environ, "GPU_TRAIN_TINY": "1", "OUT": str(out), "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu_train.sh: done" in proc.stdout
    assert "jax 0.10" in (out / "env.txt").read_text() or "jax 0.1" in (out / "env.txt").read_text()
    assert "PASS: 3 of 3 cases" in (out / "kernel_check.txt").read_text()
    attention = json.loads((out / "attention.json").read_text())
    got = {(r["kind"], r["impl"]) for r in attention["rows"] if "error" not in r}
    for kind in ("v1", "standard", "v2", "std-2h"):
        assert {(kind, "xla"), (kind, "cudnn")} <= got, got
    assert ("v1", "cudnn-4") in got
    assert "V2 / std-2h on cudnn" in (out / "attention.md").read_text()
    docs = json.loads((out / "attention_docs.json").read_text())
    assert {r["documents"] for r in docs["rows"]} == {32}
    # a CPU rehearsal never writes its times into auto's table
    assert (out / "impl_table.json").read_text() == open(
        os.path.join(ROOT, "diffjax", "ops", "impl_table.json")
    ).read()
    step = json.loads((out / "train_step.json").read_text())
    rows = {(r["model"], r["impl"]): r for r in step["rows"]}
    assert set(rows) == {(m, i) for m in ("DIFF V1", "DIFF V2", "twin") for i in ("xla", "cudnn")}
    assert all("error" not in r and r["step_ms"] > 0 for r in rows.values()), rows
    assert step["env"]["documents"] == 40
    md = (out / "train_step.md").read_text()
    assert "cudnn: DIFF V1 / twin step time" in md and "DIFF V2 / twin" in md
    bench = _load("attention")  # the FLOP count is the reference page's
    assert bench.visible_pairs(4, True) == 10 and bench.visible_pairs(4, False) == 16
    assert bench.flops("v1", 1, 4, 1, 8, True) == 2 * 6 * 8 * 10
    assert bench.flops("v2", 1, 4, 1, 8, True) == bench.flops("std-2h", 1, 4, 1, 8, True)


def test_decode_benchmark_runs_on_cpu(capsys, tmp_path):
    bench = _load("decode")
    md = tmp_path / "table.md"
    assert (
        bench.main(
            [
                "--d-model",
                "32",
                "--layers",
                "1",
                "--heads",
                "1",
                "--batch",
                "2",
                "--prompt-len",
                "8",
                "--new-tokens",
                "4",
                "--iters",
                "1",
                "--markdown",
                str(md),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    for model in ("diff_v1", "diff_v2", "twin"):
        assert model in lines and lines[model].rstrip().endswith("yes")  # cached == naive tokens
    # d_model 32, h = 1: V1 caches K1, K2 (16 each) and V (32), the twin 2 heads x 16 x (K + V)
    assert " 256 " in lines["diff_v1"] and " 256 " in lines["twin"] and " 256 " in lines["diff_v2"]
    assert "| diff_v2 |" in md.read_text()


def test_query_split_on_hand_made_answers():
    import numpy as np

    split = _load("query_split").split_accuracy
    batch = {"query_needle": np.array([[0, 1, 0, 1], [2, 2, 0, 3]])}
    correct = np.array([[False, True, True, True], [True, True, False, False]])
    acc = split(correct, batch)
    # first: (F, T); new later: (T) of row 0, (F, F) of row 1; repeats: (T, T) and (T)
    assert acc["first"] == 0.5 and acc["new"] == 1 / 3 and acc["repeat"] == 1.0
    assert acc["all"] == 5 / 8 and acc["by_index"] == [0.5, 1.0, 0.5, 0.5]
    assert acc["repeat_share"] == 3 / 8


def test_lookup_attention_masks_shares_and_swap():
    import numpy as np

    la = _load("lookup_attention")
    #                   BOS  t   k1  v1  t   k2  v2  t   k2  v2'
    inputs = np.array([[256, 97, 74, 51, 55, 81, 52, 98, 81, 52]])
    batch = {
        "inputs": inputs,
        "targets": np.roll(inputs, -1, 1),
        "needle_value_spans": np.array([[[3, 4], [6, 7]]]),
        "query_needle": np.array([[1]]),
        "query_spans": np.array([[[8, 10]]]),
        "answer_spans": np.array([[[8, 9]]]),
    }
    rows, masks = la.first_query_masks(batch)
    assert rows.tolist() == [8] and masks.shape == (len(la.COLUMNS), 1, 10)
    where = {c: np.flatnonzero(masks[i, 0]).tolist() for i, c in enumerate(la.COLUMNS)}
    assert where == {
        "answer": [6],
        "key": [5],
        "after": [7],
        "other values": [3],
        "digits in text": [4],
        "BOS": [0],
        "self": [8],
        "other context": [1, 2],
    }
    maps = np.zeros((1, 2, 10, 10))
    maps[0, 0, 8, 6] = 1.0  # head 0: all on the answer
    maps[0, 1, 8, [6, 3]] = [0.5, -0.5]  # head 1: a differential row, half of it negative
    shares = la.row_shares(maps, rows, masks)
    np.testing.assert_allclose(shares[0], np.eye(len(la.COLUMNS))[0])
    assert shares[1, 0] == 0.5 and shares[1, 3] == -0.5
    swapped, new = la.swap_asked_value(batch, 128)
    assert swapped[0, 6] == new[0, 0] and chr(new[0, 0]) in "123456789"
    assert new[0, 0] not in (51, 52)  # no needle of the example has it
    changed = np.flatnonzero(swapped[0] != inputs[0]).tolist()
    assert changed == [6]  # the context only: the query's own answer (a target) is untouched


def test_retrieval_scripts_on_a_tiny_needle_run(tmp_path, capsys):
    from diffjax.compare.cli import main

    run = tmp_path / "run"
    assert (
        main(
            [
                f"run.dir={run}",
                "model.d_model=32",
                "model.num_layers=1",
                "model.num_heads=1",
                "model.max_seq_len=64",
                "data.source=needle",
                "data.seq_len=48",
                "data.needle.num_needles=2",
                "data.needle.num_queries=4",
                "data.needle.query_replacement=true",
                "data.needle.key_len=1",
                "data.needle.value_len=1",
                "data.needle.template={key}{value}",
                "data.needle.query_template={key}{value}",
                "data.synthetic.num_val_examples=8",
                "train.batch_size=8",
                "train.eval_batches=1",
                "train.warmup_steps=1",
                "train.steps=2",
                "train.eval_every=2",
                "train.checkpoint_every=2",
                "train.progress=false",
                "train.tensorboard=false",
                "compare.throughput_rounds=1",
                "compare.quick_eval=false",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert _load("query_split").main([str(run), "--examples", "8"]) == 0
    out = capsys.readouterr().out
    assert "| diff | 0 |" in out and "| standard | 0 |" in out and "first query 0.500" in out
    png = tmp_path / "curves.png"
    assert _load("retrieval_curves").main([str(run), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "final first query" in out and "(first query: 0.500)" in out
    assert png.stat().st_size > 1000
    assert _load("lookup_attention").main([str(run), "--examples", "8"]) == 0
    out = capsys.readouterr().out
    assert "follows the swap" in out and "| diff | 0 |" in out and "| standard | 0 |" in out


def test_reproduce_reports_a_changed_number_then_agrees_after_write(tmp_path, capsys, monkeypatch):
    """benchmarks/reproduce.py: a published value the code does not give is reported (exit 1);
    ``--write`` records what the code gives, and the same runs then agree (exit 0)."""
    bench = _load("reproduce")
    published = tmp_path / "published.json"
    tiny = (
        "python train.py model.d_model=32 model.num_layers=1 model.num_heads=1 "
        "data.seq_len=32 train.steps=4 train.batch_size=8 train.eval_every=2 "
        "train.eval_batches=1 train.checkpoint_every=4"
    )
    entry = dict(command=tiny, date="2000-01-01", jax="0.0", metric="val_loss", digits=4)
    entry["values"] = {"diff": {"0": 1.0}, "standard": {"0": 1.0}}
    published.write_text(json.dumps({"tiny": entry}))
    monkeypatch.setattr(bench, "PUBLISHED", str(published))
    assert bench.main(["tiny", "--out", str(tmp_path / "a"), "--write"]) == 1
    out = capsys.readouterr().out
    assert "| diff | 0 | 1.0000 |" in out and "DIFFERS" in out
    written = json.loads(published.read_text())["tiny"]
    assert written["date"] != "2000-01-01" and written["values"]["diff"]["0"] != 1.0
    assert bench.main(["tiny", "--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "DIFFERS" not in out and out.count("| same |") == 2
    assert bench.agrees(2.37391, 2.37394, 4) and not bench.agrees(2.3739, 2.3753, 4)


def test_context_memory_benchmark_prints_its_table():
    """benchmarks/context_memory.py at a tiny size (its own process: it sets the device count
    before JAX starts): a row per context size and implementation, the ring below the
    all-gather."""
    import subprocess
    import sys

    args = ["--lengths", "256", "--sizes", "1,2,4", "--time-lengths", "", "--block-k", "16"]
    args += ["--heads", "1", "--head-dim", "16"]
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "context_memory.py"), *args],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    ).stdout
    rows = {
        (c[2], c[3]): float(c[4].replace(",", ""))
        for c in (line.split("|") for line in out.splitlines() if line.startswith("| 256 |"))
    }
    assert set(rows) == {(" 1 ", " reference "), (" 2 ", " ring "), (" 2 ", " allgather ")} | {
        (" 4 ", " ring "),
        (" 4 ", " allgather "),
    }
    assert rows[" 4 ", " ring "] < rows[" 4 ", " allgather "]


def test_plan_table_search_finds_the_boundary_with_few_compiles():
    largest_batch = _load("plan_table").largest_batch
    gib = 1024**3

    def fake(bytes_of):
        seen = []

        def measure(b):
            seen.append(b)
            m = bytes_of(b)
            return {"fits": m <= 16 * gib, "total_bytes": m}

        return measure, seen

    # linear memory: 2 GiB plus 0.25 GiB per sequence fits 56 sequences, not 57
    measure, seen = fake(lambda b: 2 * gib + b * gib // 4)
    assert largest_batch(measure, 8, 16 * gib) == 56
    assert seen[:2] == [8, 32] and 64 in seen and len(seen) <= 4 and len(set(seen)) == len(seen)
    # convex memory (the line through n and 4n overshoots far) still ends at the boundary
    measure, seen = fake(lambda b: 2 * gib + b * b * gib // 256)
    assert largest_batch(measure, 4, 16 * gib) == 56  # 2 + 56^2/256 = 14.25, 60: 16.06
    assert 60 in seen and len(seen) <= 7
    # one sequence per device already too large
    measure, seen = fake(lambda b: 20 * gib + b)
    assert largest_batch(measure, 8, 16 * gib) is None and seen == [8]
    # a record without a byte count (a compile error) is bisected past
    measure, seen = fake(lambda b: 2 * gib + b * gib // 4)

    def with_error(b):
        r = measure(b)
        return {"fits": r["fits"]} if b == 64 else r

    assert largest_batch(with_error, 8, 16 * gib) == 56


def test_the_scaling_table_is_rendered_from_the_committed_compiles():
    """docs/scaling.md's table of the paper-size plans is what ``plan_table.py --render`` makes
    of benchmarks/plan_table.jsonl (every compile behind it), so neither changes alone."""
    table = _load("plan_table").render(os.path.join(ROOT, "benchmarks", "plan_table.jsonl"))
    assert table.count("\n") == 19  # the header, the rule and 18 rows: 3 sizes x 3 targets x 2
    assert "not run" not in table and "not searched" not in table
    with open(os.path.join(ROOT, "docs", "scaling.md")) as f:
        assert table in f.read()


def test_the_latency_relay_holds_each_request_and_passes_the_bytes_unchanged(gcs_server):
    """benchmarks/data_speed.py's stand-in for a farther bucket: a real HTTP request to the
    emulator through the relay returns the same bytes, at least ``delay`` later."""
    import time
    import urllib.request

    bucket = gcs_server.new_bucket().removeprefix("gs://")
    data = bytes(range(256)) * 64
    gcs_server.client().bucket(bucket).blob("relayed.bin").upload_from_string(data)
    relay = _load("data_speed").LatencyRelay(gcs_server.url)
    try:
        url = f"/storage/v1/b/{bucket}/o/relayed.bin?alt=media"
        direct = urllib.request.urlopen(gcs_server.url + url, timeout=10).read()
        assert direct == data
        for delay in (0.0, 0.2):
            relay.delay = delay
            t = time.perf_counter()
            got = urllib.request.urlopen(relay.url + url, timeout=10).read()
            assert time.perf_counter() - t >= delay
            assert got == direct
    finally:
        relay.close()


def test_reproduce_says_whether_the_machine_differs(monkeypatch):
    """A differing value is explained by the machines' differences, or by the code when the
    machine is the publishing one; the record names the CPU, its extensions and any XLA cap."""
    from diffjax.infra import machine

    reproduce = _load("reproduce")
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=AVX2")
    now = machine.describe()
    assert now["xla_cpu_max_isa"] == "AVX2" and "capped at AVX2" in machine.summary(now)
    assert now["cpu"] == machine.cpu_model() and now["jaxlib"]
    assert "the code changed" in reproduce.explain(dict(now), now)
    other = dict(now, cpu="Another CPU", vector_extensions=["sse4_2", "avx", "avx2"])
    said = reproduce.explain(other, now)
    assert "this machine differs" in said and "cpu: Another CPU -> " in said
    assert "vector_extensions: ['sse4_2', 'avx', 'avx2'] -> " in said
    assert "not recorded" in reproduce.explain(None, now)


TINY_RUN = ["model.d_model=32", "model.num_layers=1", "model.num_heads=1", "data.seq_len=32"]
TINY_RUN += ["model.max_seq_len=32", "train.batch_size=8", "data.max_files=20"]


def test_document_mask_benchmark_prints_both_settings(capsys):
    bench = _load("document_mask")
    assert bench.main(["--rounds", "1", "--steps", "2", "--batches", "2", *TINY_RUN]) == 0
    out = capsys.readouterr().out
    assert "| input pipeline, tokens/s" in out and "| train step, ms" in out
    assert "data.seq_len=32" in out  # the command as run


def test_masking_comparison_trains_both_arms_and_pairs_them(tmp_path, capsys):
    bench = _load("masking_comparison")
    settings = [*TINY_RUN, "train.steps=4", "train.eval_every=4", "train.eval_batches=1"]
    settings += ["train.checkpoint_every=4", "train.tensorboard=false"]
    assert bench.main(["--out", str(tmp_path), "--seeds", "2", *settings]) == 0
    out = capsys.readouterr().out
    for row in ("| DIFF V1 |", "| twin |", "| DIFF − twin (paired) |", "per seed"):
        assert row in out
    on = json.loads((tmp_path / "on" / "config.json").read_text())["data"]
    off = json.loads((tmp_path / "off" / "config.json").read_text())["data"]
    assert on["document_mask"] is None and off["document_mask"] is False
    values = {a: bench.final_losses(str(tmp_path), a, 2) for a in ("on", "off")}
    assert all(len(v) == 2 for arm in values.values() for v in arm.values())


def test_diagnostics_cost_benchmark_times_both_models_both_ways(capsys):
    bench = _load("diagnostics_cost")
    assert bench.main(["--rounds", "1", "--steps", "2", *TINY_RUN]) == 0
    out = capsys.readouterr().out
    assert "| diff (diff_v1) |" in out and "| standard (standard) |" in out
    assert "data.seq_len=32" in out  # the command as run


def test_the_stage0_script_rehearses_on_cpu_and_resumes_its_run(tmp_path):
    """``benchmarks/gpu_stage0.sh`` with ``STAGE0_TINY=1``: the probe, the tokens that fit, every
    arm and seed of configs/gpu_stage0.py at a tiny size, the report under ``$OUT``; a second
    call finds every arm done and rebuilds the same report."""
    out, run = tmp_path / "out", tmp_path / "run"
    env = {**os.environ, "STAGE0_TINY": "1", "OUT": str(out), "STAGE0_RUN": str(run)}
    env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")  # one device, as on the GPU

    def call():
        return subprocess.run(
            ["bash", os.path.join(ROOT, "benchmarks", "gpu_stage0.sh")],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
        )  # fmt: skip

    proc = call()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sweep = (out / "sweep.md").read_text()
    for arm in ("v1", "v2", "v2m"):
        assert f"**DIFF V{arm[1]} ({arm}) against twin**" in sweep, sweep
    assert "| tokens/s | MFU | attention |" in sweep
    assert (out / "curves.png").stat().st_size > 10_000
    reached = (out / "reached.txt").read_text().splitlines()
    assert len(reached) == 8 and all("2,560 tokens" in line for line in reached), reached
    assert "tokens per model:" in (out / "env.txt").read_text()
    again = call()
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "probe" not in again.stdout.split("tokens per model")[0].lower().replace("probe.", "")
    assert (out / "sweep.md").read_text() == sweep


def test_the_stage0_config_states_its_parameter_counts():
    """configs/gpu_stage0.py's table: each arm's model and its non-embedding parameters, the
    twin shared by V1 and V2, the matched V2 within 0.2% of the twin."""
    from diffjax import twin
    from diffjax.sweep.cli import non_embedding_params
    from diffjax.train.config import apply_overrides, load_config

    path = os.path.join(ROOT, "configs", "gpu_stage0.py")
    exp = load_config(path)
    spec = importlib.util.spec_from_file_location("gpu_stage0", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    models = {arm: apply_overrides(exp, list(o)).model for arm, o in module.SWEEP.arms.items()}
    doc = module.__doc__
    for arm, n in (("v1", models["v1"]), ("v2", models["v2"]), ("v2m", models["v2m"])):
        assert f"{non_embedding_params(n):,}" in doc, (arm, non_embedding_params(n))
    tw = twin(models["v1"])
    assert twin(models["v2"]) == tw and f"{non_embedding_params(tw):,}" in doc
    assert abs(non_embedding_params(models["v2m"]) / non_embedding_params(tw) - 1) < 0.002
    assert exp.model.dtype == "bfloat16" and exp.data.seq_len == 1024 and exp.compare.seeds == 2
    assert module.SWEEP.twins == {"v2m": "v1"}


def test_the_storage_fault_rows_are_bounded_and_the_requests_classified(gcs_server, tmp_path):
    """benchmarks/storage_faults.py: a child past its row's deadline is killed with what it
    started and the row reads as timed out (no row blocks the table); the proxy's log of a
    run is sorted into what each request was for (the per-step, per-save, per-resume figures)."""
    sf = _load("storage_faults")
    import time

    bench = sf.Bench(gcs_server, str(tmp_path), time.monotonic() + 60)
    t0 = time.monotonic()
    child = bench.spawn(["-c", "import time; time.sleep(60)"], bench.env(gcs_server.url))
    try:
        bench.wait([child], t0 + 1.0)
        raise AssertionError("the sleeping child was not stopped")
    except sf.TimedOut:
        pass
    assert time.monotonic() - t0 < 10 and child[0].poll() is not None
    assert bench.run(["-c", "import sys; sys.exit('last words')"], bench.env("x"), t0 + 30) == (
        1,
        "last words",
    )
    b = "/storage/v1/b/bkt"
    log = [
        ("GET", "/download/storage/v1/b/bkt/o/prep%2Ftrain_00000.bin?alt=media"),
        ("GET", "/download/storage/v1/b/bkt/o/prep%2Fval_00000.bin?alt=media"),
        ("GET", f"{b}/o/prep%2Fmanifest.json"),
        (
            "POST",
            "/upload/storage/v1/b/bkt/o?uploadType=multipart&name=r/diff/seed_0/metrics.jsonl",
        ),
        ("GET", f"{b}/o/r%2Fdiff%2Fseed_0%2Fcheckpoints%2F2%2Fstate"),
        ("GET", f"{b}/o/r%2Fdiff%2Fseed_0%2Fcheckpoints%2F6%2Fstate"),
        ("GET", f"{b}?projection=noAcl"),
    ]
    kinds = [sf.request_kind(m, p, {"6"}) for m, p in log]
    assert kinds == [
        "training windows",
        "validation windows",
        "prepared data: manifest, listing, indexes",
        "metrics syncs (metrics.jsonl uploads)",
        "earlier checkpoints: restore",
        "checkpoint saves",
        "bucket access checks",
    ]
