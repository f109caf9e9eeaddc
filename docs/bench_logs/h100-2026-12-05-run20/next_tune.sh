#!/usr/bin/env bash
# Written after the twentieth run, for any Hopper GPU: our forward and input-gradient kernels
# at proxy-2b's batch-24 shapes ([1024 -> 1024] gate and up, [512 -> 1024] down; 64 experts x
# 4608 rows) with the default tiles against the short-contraction candidates added to
# tune_mosaic.py (32-column contractions with four stages, chained or not; 64-row blocks,
# chained), kernel time over dense, three interleaved rounds. About 5 minutes.
export PYTHONUNBUFFERED=1
(nvidia-smi; python -c "import jax; print(jax.__version__, jax.devices())") > $OUT/t0_machine.log 2>&1
cd experiments
timeout 420 python tune_mosaic.py --cases proxy --ops fwd,dgrad --repeats 3 --budget 360 \
  --candidates "128x2x128 s3 b4|k32|chain 64x2x128|chain 128x2x64 s4 b8" --out $OUT \
  > $OUT/t1_tune_proxy.log 2>&1
grep -E "FAILED|INEXACT|Error" $OUT/t1_tune_proxy.log | cut -c 1-200; tail -12 $OUT/t1_tune_proxy.log
