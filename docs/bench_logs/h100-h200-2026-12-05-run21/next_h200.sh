#!/usr/bin/env bash
# Written after the twenty-first run, for the next GPU (batch 24 needs an H200; pass 16 on an
# H100): the step with float32 logits (the default) against the fused SwiGLU with its mended
# backward (`fused32`) and against the routing weights before the down projection (`early`,
# `moe_weights_before_down=true`), two rounds in one process (step_h200.py), after the GPU
# tests of the fused SwiGLU and of the MoE layer. `.whl` carried. About 8 minutes. If `fused32`
# or `early` wins by 1% or more in both rounds, make it the default (then try the two
# together).
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments:$PWD/docs/bench_logs/h100-h200-2026-12-05-run21
(nvidia-smi; python -c "import jax; print(jax.__version__, jax.devices())") > $OUT/n0_machine.log 2>&1
grep -E "NVIDIA H|MiB" $OUT/n0_machine.log | head -3
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 python -m pytest -q -p no:cacheprovider -m gpu \
  tests/backends/test_gpu_backends.py -k "swiglu or moe_layer" > $OUT/n1_gpu_tests.log 2>&1
tail -1 $OUT/n1_gpu_tests.log
cd experiments
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 440 python ../docs/bench_logs/h100-h200-2026-12-05-run21/step_h200.py \
  ${1:-24} 2 f32,fused32,early > $OUT/n2_step_b${1:-24}.log 2>&1
grep -E "Error|RESOURCE" $OUT/n2_step_b${1:-24}.log | cut -c 1-300; grep -E "^==" $OUT/n2_step_b${1:-24}.log
