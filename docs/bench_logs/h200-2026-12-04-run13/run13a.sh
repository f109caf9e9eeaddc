#!/usr/bin/env bash
# Thirteenth H200 run, call A (no TE): stacked-gradient assembly micro-benchmark, the step's
# kernels per scope (command buffers off), then the unrolled scan against the layers split with
# their gradients written by dynamic_update_slice (run12's split_layers.patch, command buffers on).
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
R=docs/bench_logs/h200-2026-12-04-run13
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/a0_machine.log
python -c "import jax; print(jax.__version__)" >> $OUT/a0_machine.log 2>&1
cd experiments
cp ../$R/{bench_stack.py,profile_scopes.py} ../docs/bench_logs/h200-2026-12-04-run12/bench_unroll.py .
timeout 90 python bench_stack.py > $OUT/a1_stack.log 2>&1
grep -E "^==|Error" $OUT/a1_stack.log
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 180 python profile_scopes.py > $OUT/a2_scopes.log 2>&1
head -20 $OUT/a2_scopes.log | grep -v Warn
P=docs/bench_logs/h200-2026-12-04-run12/split_layers.patch
(cd .. && (git apply $P 2>/dev/null || patch -p1 < $P))
timeout 300 python bench_unroll.py "scan unrolled (before)" "split, dynamic_update_slice" > $OUT/a3_unroll.log 2>&1
grep -E "^==|Error" $OUT/a3_unroll.log
