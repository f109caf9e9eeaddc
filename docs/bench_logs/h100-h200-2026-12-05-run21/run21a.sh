#!/usr/bin/env bash
# Twenty-first run, call A (any Hopper GPU): our kernels at proxy-2b's batch-24 shapes, default
# tiles against the short-contraction candidates (tune_mosaic.py --cases proxy); the gate-and-up
# kernel with the SwiGLU in its epilogue against kernel + XLA SwiGLU (bench_swiglu_epilogue.py);
# then the GPU tests of our kernels (fused SwiGLU and 32-column ones among them) and of the
# loss. `.whl` carried. Logs to $OUT.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/experiments:/tmp/site
(nvidia-smi; python -c "import jax; print(jax.__version__, jax.devices())") > $OUT/a0_machine.log 2>&1
grep -E "NVIDIA H|MiB" $OUT/a0_machine.log | head -3
cd experiments
timeout 280 python tune_mosaic.py --cases proxy --ops fwd,dgrad --repeats 3 --budget 230 \
  --candidates "128x2x128 s3 b4|k32|chain 64x2x128|chain 128x2x64 s4 b8" --out /tmp/tune \
  > $OUT/a1_tune_proxy.log 2>&1
grep -E "FAILED|INEXACT|Error" $OUT/a1_tune_proxy.log | cut -c 1-200; tail -12 $OUT/a1_tune_proxy.log
timeout 60 python bench_swiglu_epilogue.py --out /tmp/swiglu > $OUT/a2_swiglu_epilogue.log 2>&1
grep -E "Error" $OUT/a2_swiglu_epilogue.log | cut -c 1-300; tail -4 $OUT/a2_swiglu_epilogue.log
cd .. && XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python -m pytest -q -p no:cacheprovider -m gpu \
  tests/backends/test_gpu_backends.py -k "mosaic or swiglu" > $OUT/a3_gpu_tests.log 2>&1
tail -3 $OUT/a3_gpu_tests.log
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 70 python -m pytest -q -p no:cacheprovider \
  tests/train/test_cross_entropy.py >> $OUT/a3_gpu_tests.log 2>&1; tail -2 $OUT/a3_gpu_tests.log
