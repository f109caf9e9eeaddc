#!/usr/bin/env bash
# Fifteenth H200 run, call E (no TE): the pure-jnp default's train step (jnp-capacity), batch 8,
# with this run's gate-and-up matmul (its last figure is from the fifth run).
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/experiments
cd experiments
timeout 330 python bench_train.py --preset proxy-2b --seq 2048 --attention-impl cudnn \
  --backends jnp-capacity --unroll-layers --batch 8 --steps 3 --out $OUT/results \
  > $OUT/e1_train_jnp_capacity_b8.log 2>&1
tail -n 4 $OUT/e1_train_jnp_capacity_b8.log
