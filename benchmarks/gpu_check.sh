#!/usr/bin/env bash
# One prepared run for a GPU machine (no internet needed there): the kernels' self-check, the
# attention benchmark, then the kernel tests on the compiled Triton kernels; everything it prints
# lands under $OUT. Run it from the repository root on the GPU machine:
#   bash benchmarks/gpu_check.sh
# It needs jax with CUDA, flax, optax, orbax-checkpoint, chex, safetensors, tokenizers, pytest,
# pytest-xdist and hypothesis (a machine without internet gets the missing ones as wheels in
# .wheels/, installed first). The three parts have their own time limits (about 9 minutes in all)
# and the benchmark comes before the tests, so the timings come back even if the tests run long.
set -uo pipefail
OUT=${OUT:-gpu_check_out}
PY=$(command -v python3 || command -v python)
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
  "$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
  "$PY" -m pip list 2>/dev/null | grep -E -i "^(jax|jaxlib|jax-cuda.*|flax|optax|orbax-checkpoint|chex|triton|numpy) "
} 2>&1 | tee "$OUT/env.txt"

if [ -d .wheels ]; then
  "$PY" -m pip install -q --no-index --find-links .wheels .wheels/*.whl 2>&1 | tail -2
fi

# The kernels' self-check: every case's error against the reference math, the device kind,
# jax/jaxlib versions and a verdict (docs/results.md records it beside the timings).
timeout 100 "$PY" -m diffjax.kernels.check 2>&1 | tee "$OUT/kernel_check.txt"

# The benchmark: T = 1K..32K, bf16, d = 128, causal; a variant that fails at a size (e.g. the
# XLA path out of memory at 32K) is printed as an error row and the rest continue.
timeout 250 "$PY" benchmarks/attention.py --markdown "$OUT/attention.md" 2>&1 | tee "$OUT/attention.txt"

# The GPU kernel tests compile the real kernels (interpret mode elsewhere); 4 workers share the
# GPU, so none preallocates its memory.
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 180 "$PY" -m pytest -q -p no:cacheprovider -n 4 \
  tests/test_kernels_gpu.py tests/test_kernels.py 2>&1 | tee "$OUT/tests.txt" | tail -40
