#!/usr/bin/env bash
# Written after the twenty-first run, for the next GPU (batch 24 needs an H200; pass 16 on an
# H100); updated in the twenty-third session. Arguments: batch (24), variants
# (f32,fused32,early,fused_early), rounds (1), tests (1 = run the GPU tests first). The step
# with float32 logits (the default) against the fused SwiGLU with its mended backward
# (`fused32`), the routing weights before the down projection (`early`,
# `moe_weights_before_down=true`) and the two together (`fused_early`, the scale in the fused
# kernel's epilogue), in one process (step_h200.py), after the GPU tests of the fused SwiGLU
# and of the MoE layer. `.whl` carried. Four variants take about 7 minutes a round with the
# compilations, so run two calls on the warm machine (the persistent cache in /tmp/jax_cache
# then saves most of the second call's compiling):
#   bash .../next_h200.sh 24 f32,fused32,early,fused_early 1 1
#   bash .../next_h200.sh 24 fused_early,early,fused32,f32 1 0
# Make the default whichever wins by 1% or more in both rounds.
# If only one call is likely (no machine was lent in sessions 25-32): the two ends in both
# rounds, `bash .../next_h200.sh 24 f32,fused_early 2 1`.
# After the A/B, on the same machine (not run by this script):
#   the batch-24 profile with the winner (docs/bench_logs/h200-2026-12-05-run18/run18d.sh's
#   command): check the attention scope's q concatenations are gone (137ab83);
#   cd experiments && python bench_moe.py --skip-layer --strategies pallas   (grouped GEMM table)
#   python bench_moe.py --skip-gmm --quick --profile --layer-backends jnp-capacity   (issue 2)
export PYTHONUNBUFFERED=1
batch=${1:-24}; variants=${2:-f32,fused32,early,fused_early}; rounds=${3:-1}; tests=${4:-1}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments:$PWD/docs/bench_logs/h100-h200-2026-12-05-run21
(nvidia-smi; python -c "import jax; print(jax.__version__, jax.devices())") > $OUT/n0_machine.log 2>&1
grep -E "NVIDIA H|MiB" $OUT/n0_machine.log | head -3
if [ "$tests" = 1 ]; then
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python -m pytest -q -p no:cacheprovider -m gpu \
    tests/backends/test_gpu_backends.py -k "swiglu or moe_layer" > $OUT/n1_gpu_tests.log 2>&1
  tail -1 $OUT/n1_gpu_tests.log
fi
log=$OUT/n2_step_b${batch}_${variants//,/-}.log
cd experiments
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 420 python ../docs/bench_logs/h100-h200-2026-12-05-run21/step_h200.py \
  $batch $rounds $variants > $log 2>&1
grep -E "Error|RESOURCE" $log | cut -c 1-300; grep -E "^==" $log
