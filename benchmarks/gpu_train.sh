#!/usr/bin/env bash
# One prepared run for a GPU machine (no internet needed there), about 8 minutes on one H100 or
# H200; every table lands under $OUT. From the repository root on the GPU machine:
#   bash benchmarks/gpu_train.sh
# Parts, each with its own time limit, the headline ones first so that they come back even if
# a later one runs long:
#   1. env.txt             the GPU, driver, jax/jaxlib and cuDNN versions
#   2. kernel_check.txt    the self-check: diffjax's kernels and the cuDNN compositions against
#                          the reference math on this GPU
#   3. attention.md/json   every kind x implementation, fwd and fwd+bwd at 2K-32K, TFLOP/s and
#                          % of the measured matmul peak, the targets (V2 vs standard with 2h
#                          query heads; V1's best vs cuDNN's four calls); impl_table.json: the
#                          repo's table with this GPU's times merged (what auto reads: commit it
#                          as diffjax/ops/impl_table.json)
#   4. train_step.md/json  configs/diff_125m.py's DIFF V1, V2 and their twin (bf16, seq 2048,
#                          documents apart) per implementation: step time, tokens/s, MFU,
#                          DIFF/twin, memory
#   5. attention_docs.*    the attention table again with 1K-token documents kept apart
# GPU_TRAIN_TINY=1 runs every part at a tiny size on any machine (a CPU rehearsal: cuDNN's
# compositions on XLA, the kernels' check interpreted); tests/test_benchmarks.py runs it so.
set -uo pipefail
OUT=${OUT:-gpu_train_out}
PY=$(command -v python3 || command -v python)
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ "${GPU_TRAIN_TINY:-0}" = 1 ]; then
  CHECK=(check.interpret=true check.impl=cudnn check.head_dim=64 check.dtype=bfloat16)
  ATT=(--seq-lens 128 --iters 1 --peak-n 128)
  ATT_DOCS=(--seq-lens 128 --iters 1 --peak-n 128 --segments 32)
  STEP=(--tiny --impls xla cudnn --steps 1 --doc-len 40)
  LIMIT=(600 600 600 600)
else
  CHECK=()
  ATT=(--seq-lens 2048 4096 8192 16384 32768)
  ATT_DOCS=(--seq-lens 2048 8192 --segments 1024)
  STEP=(--impls pallas cudnn --batch 16 --steps 10)
  LIMIT=(90 150 180 60)
fi

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
  "$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
  "$PY" - <<'PY'
from diffjax.kernels import cudnn
fa = cudnn.private_api()
try:
    version = fa.check_cudnn_version() if fa is not None else "unknown (jax's cuDNN module not used here)"
except Exception as e:  # noqa: BLE001
    version = f"none ({type(e).__name__}: {e})"
print(f"cuDNN {version}; wide values: {cudnn.wide_value_supported()}; V1 on cuDNN: "
      f"{cudnn.composition('v1', segments=False)}, with documents apart "
      f"{cudnn.composition('v1', segments=True)}")
PY
  "$PY" -m pip list 2>/dev/null | grep -E -i "^(jax|jaxlib|jax-cuda.*|nvidia-cudnn.*|flax|optax|orbax-checkpoint|numpy) "
} 2>&1 | tee "$OUT/env.txt"

if [ -d .wheels ]; then
  "$PY" -m pip install -q --no-index --find-links .wheels .wheels/*.whl 2>&1 | tail -2
fi

timeout "${LIMIT[0]}" "$PY" -m diffjax.kernels.check "${CHECK[@]}" 2>&1 | tee "$OUT/kernel_check.txt"

cp diffjax/ops/impl_table.json "$OUT/impl_table.json"
timeout "${LIMIT[1]}" "$PY" benchmarks/attention.py "${ATT[@]}" --markdown "$OUT/attention.md" \
  --json "$OUT/attention.json" --table "$OUT/impl_table.json" 2>&1 | tee "$OUT/attention.txt"

timeout "${LIMIT[2]}" "$PY" benchmarks/train_step.py "${STEP[@]}" --markdown "$OUT/train_step.md" \
  --json "$OUT/train_step.json" 2>&1 | tee "$OUT/train_step.txt"

timeout "${LIMIT[3]}" "$PY" benchmarks/attention.py "${ATT_DOCS[@]}" --markdown "$OUT/attention_docs.md" \
  --json "$OUT/attention_docs.json" --table "$OUT/impl_table.json" 2>&1 | tee "$OUT/attention_docs.txt"
echo "gpu_train.sh: done; tables in $OUT"
