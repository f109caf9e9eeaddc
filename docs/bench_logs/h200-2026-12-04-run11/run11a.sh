#!/usr/bin/env bash
# Eleventh H200 run, call A (no TE): the MLA tests (cuDNN with value heads at their own width),
# then the unrolled proxy-2b step with and without that change, profiled (bench_attention.py).
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/a0_machine.log
python -c "import jax, jax._src.cudnn.fused_attention_stablehlo as f; print(jax.__version__, 'cuDNN', f.check_cudnn_version())" >> $OUT/a0_machine.log 2>&1
cat $OUT/a0_machine.log
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 python -m pytest -m gpu tests/nn/test_mla.py -q -p no:cacheprovider > $OUT/a1_gpu_tests.log 2>&1
tail -3 $OUT/a1_gpu_tests.log
cd experiments
cp ../docs/bench_logs/h200-2026-12-04-run11/bench_attention.py .
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 400 python bench_attention.py > $OUT/a2_attention.log 2>&1
grep -E "^==|attention|Error|error" $OUT/a2_attention.log | grep -v "^ *cudnn_generated" | head -40
