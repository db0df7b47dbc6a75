#!/usr/bin/env bash
# The ~30M comparison of configs/gpu_stage0.py in one device call (<= 9 minutes wall on one
# H100/H200, compiles included); its report and plots land under $OUT. From the repository root:
#   bash benchmarks/gpu_stage0.sh
# 1. env.txt: the GPU, jax/jaxlib, the corpus.
# 2. probe.json: benchmarks/train_step.py times each model's step (DIFF V1, DIFF V2, the twin)
#    at the config's batch, so the tokens per model are what fits STAGE0_TRAIN_S seconds of
#    training for every run (2 seeds x DIFF V1, twin, DIFF V2, matched DIFF V2), at most the
#    config's 100M; the count is kept in $RUN/tokens.txt, so a second call resumes the same run.
# 3. python -m diffjax.sweep: trains every arm and seed (checkpoints every 200 steps; stopped by
#    its time limit it saves and exits 75, and the same command resumes), then sweep.md and
#    curves.png: DIFF - twin over training with its band, the crossover, the final difference
#    with its interval, tokens/s and MFU per model.
# STAGE0_TINY=1 runs it all at a tiny size on any machine (the CPU rehearsal that
# tests/test_benchmarks.py runs).
set -uo pipefail
OUT=${OUT:-gpu_stage0_out}
RUN=${STAGE0_RUN:-runs/gpu_stage0}
PY=$(command -v python3 || command -v python)
START=$(date +%s)
WALL=${STAGE0_WALL_S:-540}   # the whole call
TRAIN=${STAGE0_TRAIN_S:-330} # the training steps of every run together
mkdir -p "$OUT" "$RUN"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$RUN/jax_cache}
CONFIG=configs/gpu_stage0.py
if [ "${STAGE0_TINY:-0}" = 1 ]; then
  TINY=(model.d_model=32 model.num_layers=1 model.max_seq_len=64 data.seq_len=64
        data.stdlib.tests=false data.max_files=12 train.batch_size=4 train.warmup_steps=1
        train.eval_batches=1 train.checkpoint_every=4 model.dtype=float32 train.progress=false
        sweep.evals=2)
  PROBE=(--tiny --batch 4 --seq 64 --steps 2 --doc-len 40)
else
  TINY=()
  PROBE=(--batch 64 --steps 5)
fi

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
  "$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
} 2>&1 | tee "$OUT/env.txt"

# the steps' times, then the tokens per model that fit (kept for a resumed call)
if [ ! -s "$RUN/tokens.txt" ]; then
  "$PY" benchmarks/train_step.py --config "$CONFIG" --impls auto "${PROBE[@]}" \
    --json "$OUT/probe.json" 2>&1 | tee "$OUT/probe.txt"
  "$PY" - "$OUT/probe.json" "$TRAIN" "${STAGE0_TINY:-0}" > "$RUN/tokens.txt" <<'PY'
import json, sys
probe, budget, tiny = json.load(open(sys.argv[1])), float(sys.argv[2]), sys.argv[3] == "1"
ms = {r["model"]: r["step_ms"] for r in probe["rows"] if "error" not in r}
env = probe["env"]
tokens_per_step = env["batch"] * env["seq_len"]
# per seed: DIFF V1, the twin, DIFF V2 and the matched V2 (about V2's step); 2 seeds; 10% for
# the evaluations and checkpoints
per_step = 2 * (ms["DIFF V1"] + ms["twin"] + 2 * ms["DIFF V2"]) / 1e3 * 1.10
steps = max(int(budget // per_step), 4)
if tiny:
    steps = 6
print(min(steps * tokens_per_step, 100_000_000))
PY
fi
TOKENS=$(cat "$RUN/tokens.txt")
echo "tokens per model: $TOKENS (target 100,000,000)" | tee -a "$OUT/env.txt"

LEFT=$(( WALL - ($(date +%s) - START) - 20 ))
timeout --signal=TERM --kill-after=30 "$LEFT" "$PY" -m diffjax.sweep --config "$CONFIG" \
  "run.dir=$RUN" "sweep.tokens=$TOKENS" "${TINY[@]}" 2>&1 | tee "$OUT/sweep.txt"
status=${PIPESTATUS[0]}

for f in sweep.md curves.png sweep_plan.json v1/report.md v1/loss.png v2/report.md v2m/report.md; do
  [ -f "$RUN/$f" ] && mkdir -p "$OUT/$(dirname "$f")" && cp "$RUN/$f" "$OUT/$f"
done
"$PY" - "$RUN" <<'PY' | tee "$OUT/reached.txt"
import glob, json, os, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*", "*", "seed_*", "result.json"))):
    r = json.load(open(path))
    print(f"{os.path.relpath(path, sys.argv[1])}: {r['tokens_seen']:,} tokens, "
          f"{r['tokens_per_s']:,.0f} tokens/s, MFU {r.get('mfu')}, attention {r.get('attention_impl')}")
PY
if [ "$status" = 75 ] || [ "$status" = 124 ]; then
  echo "gpu_stage0.sh: stopped by its time limit (saved); the same command resumes"
fi
echo "gpu_stage0.sh: exit $status; report in $OUT"
exit "$status"
