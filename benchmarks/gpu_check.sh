#!/usr/bin/env bash
# One prepared run for a GPU machine (no internet needed there): the kernel tests on the compiled
# Triton kernels, then the attention benchmark; everything it prints lands under $OUT.
#
# Prepare here (with internet), then run from the repository root on the GPU machine:
#   pip download --dest .wheels hypothesis pytest pytest-xdist tensorboardX grain   # carried along
#   bash benchmarks/gpu_check.sh                                                    # on the GPU
set -uo pipefail
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
  python -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
} 2>&1 | tee "$OUT/env.txt"

if [ -d .wheels ]; then
  pip install -q --no-index --find-links .wheels hypothesis pytest pytest-xdist 2>&1 | tail -2
fi
pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2

# First the kernels' self-check: every case's error against the reference math, the device kind,
# jax/jaxlib versions and a verdict (docs/results.md records it beside the timings).
timeout 300 python -m diffjax.kernels.check 2>&1 | tee "$OUT/kernel_check.txt"

# The GPU kernel tests compile the real kernels on a GPU (interpret mode elsewhere).
timeout 420 python -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py tests/test_kernels.py \
  2>&1 | tee "$OUT/tests.txt" | tail -30

# The benchmark: T = 1K..32K, bf16, d = 128, causal; a variant that fails at a size (e.g. the
# XLA path out of memory at 32K) is printed as an error row and the rest continue.
timeout 420 python benchmarks/attention.py --markdown "$OUT/attention.md" 2>&1 | tee "$OUT/attention.txt"
