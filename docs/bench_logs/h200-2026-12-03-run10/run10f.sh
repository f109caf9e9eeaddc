#!/usr/bin/env bash
# Tenth H200 run, call F (TE installed by call E): the grouped GEMM of bench_moe.py with te and
# pallas in the same interleaved rounds, then the MoE layer with both.
export PYTHONUNBUFFERED=1
source .te/env.sh
export PYTHONPATH=$PWD:$PYTHONPATH
cd experiments
timeout 320 python bench_moe.py --skip-layer --strategies te,pallas --out /tmp/bench > $OUT/f1_bench_gmm.log 2>&1
cp /tmp/bench/grouped_matmul.csv $OUT/f1_grouped_matmul.csv
grep -E "^ *(te|pallas) " $OUT/f1_bench_gmm.log | head -40; tail -3 $OUT/f1_bench_gmm.log
timeout 200 python bench_moe.py --skip-gmm --layer-backends te,pallas --tokens 8192,16384 --out /tmp/layer > $OUT/f2_bench_layer.log 2>&1
grep -v "^ *$" $OUT/f2_bench_layer.log | tail -8
