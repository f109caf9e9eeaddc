#!/usr/bin/env bash
# Nineteenth H200 run, call A (no TE): the step with the one-pass loss against the chunked head
# and loss (step_loss_chunk.py).
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/experiments:/tmp/site
(nvidia-smi; python -c "import jax; print(jax.__version__, jax.devices())") > $OUT/a0_machine.log 2>&1
cd experiments
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 560 python ../docs/bench_logs/h200-2026-12-05-run19/step_loss_chunk.py \
  ${1:-24,32} > $OUT/a1_step_loss_chunk.log 2>&1
grep -E "^==" $OUT/a1_step_loss_chunk.log | cut -c 1-400
