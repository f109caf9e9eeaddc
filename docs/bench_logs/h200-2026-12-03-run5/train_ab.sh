#!/usr/bin/env bash
# A/B of the train step: e50685b (bf16 slot output) vs 2e39bd9, alternating, jnp-capacity only.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
cp dropless/backends/jnp.py /tmp/jnp_new.py
cd experiments
for v in new old new old; do
  if [ $v = old ]; then cp ../.gpu/jnp_old.py ../dropless/backends/jnp.py; else cp /tmp/jnp_new.py ../dropless/backends/jnp.py; fi
  echo "== $v"; timeout 100 python3 bench_train.py --preset proxy-2b --batch 8 --seq 2048 --attention-impl cudnn --backends jnp-capacity --steps 3 --out /tmp/r/t 2>&1 | tail -1
done
