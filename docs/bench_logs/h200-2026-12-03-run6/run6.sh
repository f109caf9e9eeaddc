#!/usr/bin/env bash
# Sixth H200 run: the Mosaic weight gradient (scratch check), then pallas tests and benchmarks.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
timeout 120 python .gpu/wg.py > $OUT/h0_weight_grad.log 2>&1
if grep -q "BAD\|FAILED" $OUT/h0_weight_grad.log || ! grep -q "exact?" $OUT/h0_weight_grad.log; then
  cp .gpu/pallas_rowonly.py dropless/backends/pallas.py; echo "WGRAD: JAX's (ours failed)"
else echo "WGRAD: ours"; fi
grep -v "^  " $OUT/h0_weight_grad.log | tail -16
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python -m pytest -m gpu tests/backends/test_gpu_backends.py -k pallas -n 4 -q > $OUT/h1_gpu_tests_pallas.log 2>&1
tail -3 $OUT/h1_gpu_tests_pallas.log
cd experiments
timeout 130 python bench_moe.py --skip-layer --quick --strategies pallas,pallas-jax,jnp-capacity --out $OUT/gmm > $OUT/h2_gmm.log 2>&1
grep -v "^ *$" $OUT/h2_gmm.log | tail -24
timeout 110 python bench_moe.py --skip-gmm --layer-backends pallas --out $OUT/layer > $OUT/h3_layer.log 2>&1
tail -6 $OUT/h3_layer.log
timeout 80 python bench_train.py --preset proxy-2b --batch 8 --seq 2048 --attention-impl cudnn --backends pallas --steps 3 --out $OUT/train > $OUT/h4_train.log 2>&1
tail -3 $OUT/h4_train.log
