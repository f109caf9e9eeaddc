#!/usr/bin/env bash
# Twenty-first run, call D (an H200: batch 24 needs 94 GiB): the fused-SwiGLU kernel bench at
# proxy-2b's batch-24 gate-and-up shape alone (call C's default cases ran out of memory), then
# the batch-24 step with float32 against bfloat16 logits, two rounds (step_h200.py). `.whl`
# carried. Logs to $OUT.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/experiments:/tmp/site:$PWD/docs/bench_logs/h200-2026-12-05-run21
(nvidia-smi; python -c "import jax; print(jax.__version__, jax.devices())") > $OUT/d0_machine.log 2>&1
grep -E "NVIDIA H|MiB" $OUT/d0_machine.log | head -3
cd experiments
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 60 python bench_swiglu_epilogue.py --cases 1024x512@64x4608 \
  --out /tmp/swiglu > $OUT/d1_swiglu_epilogue.log 2>&1
grep -E "Error" $OUT/d1_swiglu_epilogue.log | cut -c 1-300; tail -3 $OUT/d1_swiglu_epilogue.log
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 480 python ../docs/bench_logs/h200-2026-12-05-run21/step_h200.py \
  ${1:-24} 2 f32,bf16 > $OUT/d2_step_b${1:-24}.log 2>&1
grep -E "Error|RESOURCE" $OUT/d2_step_b${1:-24}.log | cut -c 1-300; grep -E "^==" $OUT/d2_step_b${1:-24}.log
