#!/usr/bin/env bash
# Twelfth H200 run, call C (no TE): the cross-entropy A/B (bench_ce.py, command buffers on),
# then the profiled step on the new code (command buffers off).
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
cd experiments
cp ../docs/bench_logs/h200-2026-12-04-run12/{bench_ce.py,profile_step.py} .
timeout 300 python bench_ce.py > $OUT/c1_ce.log 2>&1
grep -E "^==|Error" $OUT/c1_ce.log
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 160 python profile_step.py > $OUT/c2_profile.log 2>&1
rm -f $OUT/step_hlo.txt.gz
grep -A12 "^total" $OUT/c2_profile.log
