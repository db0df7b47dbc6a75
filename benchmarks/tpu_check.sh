#!/usr/bin/env bash
# One prepared run for a TPU VM: the kernels' self-check on the compiled Mosaic kernels, then the
# attention benchmark; everything it prints lands under $OUT. (tests/test_kernels_tpu.py runs the
# kernels interpreted, on any machine: the self-check is what runs them compiled.)
#
# From the repository root on the TPU VM (pip install -e ".[tpu]" first):
#   bash benchmarks/tpu_check.sh
set -uo pipefail
OUT=${OUT:-tpu_check_out}
mkdir -p "$OUT"
{
  date -u
  python -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
} 2>&1 | tee "$OUT/env.txt"

# The kernels' self-check: every case's error against the reference math, the device kind,
# jax/jaxlib versions and a verdict (docs/results.md records it beside the timings).
timeout 600 python -m diffjax.kernels.check 2>&1 | tee "$OUT/kernel_check.txt"

timeout 900 python benchmarks/attention.py --markdown "$OUT/attention.md" 2>&1 | tee "$OUT/attention.txt"
