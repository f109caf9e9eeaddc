#!/usr/bin/env bash
# Sixteenth H200 run, call A (no TE): what the batch-8 step keeps for its backward (traced);
# batch 16 in one pass and batch 32 in two, with JAX's preallocation raised to 95% of the
# GPU (the 82.5 GiB allocation that failed in the seventh run was under the default 75%).
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/experiments:/tmp/site
here=$PWD/docs/bench_logs/h200-2026-12-04-run16
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/a0_machine.log
python -c "import jax; print(jax.__version__, jax.devices())" >> $OUT/a0_machine.log 2>&1
cd experiments
timeout 60 python $here/residuals.py pallas 8 cudnn > $OUT/a1_residuals.log 2>&1
tail -n 1 $OUT/a1_residuals.log
train() {  # log batch micro-batches
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 200 python bench_train.py --preset proxy-2b \
    --seq 2048 --attention-impl cudnn --backends pallas --unroll-layers --batch $2 \
    --micro-batches $3 --steps 3 --out $OUT/results > $OUT/$1 2>&1
  grep -E "Can't reduce|ran out" $OUT/$1 | cut -c 1-300; tail -n 2 $OUT/$1
}
train a2_train_b16_m1.log 16 1
train a3_train_b32_m2.log 32 2
train a4_train_b8_m1.log 8 1
