#!/usr/bin/env bash
# Written after the twentieth run, for any Hopper GPU: our forward and input-gradient kernels
# at proxy-2b's batch-24 shapes ([1024 -> 1024] gate and up, [512 -> 1024] down; 64 experts x
# 4608 rows) with the default tiles against the short-contraction candidates added to
# tune_mosaic.py (32-column contractions with four stages, chained or not; 64-row blocks,
# chained), kernel time over dense, three interleaved rounds; then the gate-and-up kernel with
# the SwiGLU in its epilogue against the kernel plus XLA's SwiGLU (bench_swiglu_epilogue.py),
# and the GPU tests of our kernels (the new fused and 32-column ones among them). `.whl`
# carried (pytest-xdist). About 7 minutes.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/experiments:/tmp/site
(nvidia-smi; python -c "import jax; print(jax.__version__, jax.devices())") > $OUT/t0_machine.log 2>&1
cd experiments
timeout 330 python tune_mosaic.py --cases proxy --ops fwd,dgrad --repeats 3 --budget 280 \
  --candidates "128x2x128 s3 b4|k32|chain 64x2x128|chain 128x2x64 s4 b8" --out /tmp/tune \
  > $OUT/t1_tune_proxy.log 2>&1
grep -E "FAILED|INEXACT|Error" $OUT/t1_tune_proxy.log | cut -c 1-200; tail -12 $OUT/t1_tune_proxy.log
timeout 60 python bench_swiglu_epilogue.py --out /tmp/swiglu > $OUT/t2_swiglu_epilogue.log 2>&1
grep -E "Error" $OUT/t2_swiglu_epilogue.log | cut -c 1-300; tail -4 $OUT/t2_swiglu_epilogue.log
cd .. && XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python -m pytest -q -p no:cacheprovider -m gpu \
  tests/backends/test_gpu_backends.py -k "mosaic" > $OUT/t3_mosaic_gpu_tests.log 2>&1; tail -3 $OUT/t3_mosaic_gpu_tests.log
