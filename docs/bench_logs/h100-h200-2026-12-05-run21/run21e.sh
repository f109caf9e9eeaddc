#!/usr/bin/env bash
# Twenty-first run, call E (any Hopper; batch 24 needs an H200): after the fused SwiGLU's
# epilogue took its gate and up from registers instead of reading them back from shared memory,
# its GPU tests, its kernel bench at proxy-2b's gate-and-up shape, then the step with the
# variants named in $2 (default f32,bf16,fused) at batch $1 (default 24), two rounds
# (step_h200.py). `.whl` carried. Logs to $OUT.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:$PWD/experiments:/tmp/site:$PWD/docs/bench_logs/h100-h200-2026-12-05-run21
(nvidia-smi; python -c "import jax; print(jax.__version__, jax.devices())") > $OUT/e0_machine.log 2>&1
grep -E "NVIDIA H|MiB" $OUT/e0_machine.log | head -3
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 80 python -m pytest -q -p no:cacheprovider -m gpu \
  tests/backends/test_gpu_backends.py -k "swiglu" > $OUT/e1_swiglu_gpu_tests.log 2>&1; tail -1 $OUT/e1_swiglu_gpu_tests.log
cd experiments
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 60 python bench_swiglu_epilogue.py --cases 1024x512@64x4608 \
  --out /tmp/swiglu > $OUT/e2_swiglu_epilogue.log 2>&1
grep -E "Error" $OUT/e2_swiglu_epilogue.log | cut -c 1-300; tail -3 $OUT/e2_swiglu_epilogue.log
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout ${3:-430} python ../docs/bench_logs/h100-h200-2026-12-05-run21/step_h200.py \
  ${1:-24} 2 ${2:-f32,bf16,fused} > $OUT/e3_step_b${1:-24}.log 2>&1
grep -E "Error|RESOURCE" $OUT/e3_step_b${1:-24}.log | cut -c 1-300; grep -E "^==" $OUT/e3_step_b${1:-24}.log
