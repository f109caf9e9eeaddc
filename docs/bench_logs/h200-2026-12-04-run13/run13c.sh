#!/usr/bin/env bash
# Thirteenth H200 run, call C (no TE): kernel time of the split layers against the unrolled
# scan, per scope and per kernel, one process (command buffers off).
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
cd experiments
cp ../docs/bench_logs/h200-2026-12-04-run13/profile_split.py .
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 400 python profile_split.py > $OUT/c1_profile_split.log 2>&1
grep -v -i "warn\|donat" $OUT/c1_profile_split.log | tail -52
