#!/usr/bin/env bash
# Twelfth H200 run, call A (no TE): the stacked-weight cast A/B (bench_cast.py, command buffers
# on), then batch 32 in four micro-batches on the new code, then the profiled step (command
# buffers off) with its HLO kept.
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/a0_machine.log
python -c "import jax; print(jax.__version__)" >> $OUT/a0_machine.log 2>&1
cd experiments
cp ../docs/bench_logs/h200-2026-12-04-run12/{bench_cast.py,profile_step.py} .
timeout 260 python bench_cast.py > $OUT/a1_cast.log 2>&1
grep -E "^==|Error" $OUT/a1_cast.log
timeout 170 python bench_train.py --preset proxy-2b --batch 32 --micro-batches 4 --seq 2048 \
  --attention-impl cudnn --backends pallas --steps 3 --unroll-layers > $OUT/a2_train_b32_m4.log 2>&1
tail -1 $OUT/a2_train_b32_m4.log
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 150 python profile_step.py > $OUT/a3_profile.log 2>&1
head -12 $OUT/a3_profile.log
