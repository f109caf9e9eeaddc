#!/usr/bin/env bash
# Eighth H200 run, call A (no TE): GPU tests of our kernels (chained pipelines included), then
# the tile search of experiments/tune_mosaic.py.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/a0_machine.log
python -c "import jax; print(jax.__version__, jax.devices()[0].compute_capability)" >> $OUT/a0_machine.log 2>&1
cat $OUT/a0_machine.log
cd experiments
timeout 480 python tune_mosaic.py --budget 400 --repeats 3 --candidates "128x2x128 s3 b4|128x2x128 s3 b8|chain|k64 s3" --out $OUT/tune > $OUT/b1_tune.log 2>&1
grep -v "^ *$" $OUT/b1_tune.log | tail -30
