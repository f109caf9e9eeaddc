#!/usr/bin/env bash
# Eighteenth H200 run, call A (no TE): cuDNN attention at proxy-2b's head shape against 8 heads
# of DeepSeek-V3's widths, alone and in the step (batch: the first argument, 24 if none); the
# gradient's global norm.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/experiments:/tmp/site
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
(nvidia-smi; python -c "import jax; print(jax.__version__, jax.devices())") > $OUT/a0_machine.log 2>&1
cd experiments
timeout 60 python bench_attention.py --widths 96/64 --heads 16 --out /tmp/results_a16 > $OUT/a1_attention_16_heads.log 2>&1
tail -n 2 $OUT/a1_attention_16_heads.log
timeout 60 python bench_attention.py --widths 192/128,128/128 --heads 8 --out /tmp/results_a8 > $OUT/a1_attention_8_heads.log 2>&1
tail -n 3 $OUT/a1_attention_8_heads.log
timeout 60 python ../docs/bench_logs/h200-2026-12-05-run18/grad_norm.py > $OUT/a3_grad_norm.log 2>&1
tail -n 7 $OUT/a3_grad_norm.log
timeout 400 python ../docs/bench_logs/h200-2026-12-05-run18/step_heads.py ${1:-24} > $OUT/a2_step_heads_b${1:-24}.log 2>&1
grep -E "Error|RESOURCE" $OUT/a2_step_heads_b${1:-24}.log | cut -c 1-300; grep -E "^==" $OUT/a2_step_heads_b${1:-24}.log
