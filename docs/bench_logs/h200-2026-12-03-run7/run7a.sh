#!/usr/bin/env bash
# Seventh H200 run, call A: install TE (last part), GPU tests of our kernels and auto, the
# weight-gradient band sweep, the grouped-GEMM benchmark with TE and Pallas in one run.
bash .te/recv.sh || exit 1
source .te/env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/a0_machine.log
python -c "import jax; print(jax.__version__, jax.devices()[0].compute_capability)" >> $OUT/a0_machine.log 2>&1
cat $OUT/a0_machine.log
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 220 python -m pytest -m gpu tests/backends/test_gpu_backends.py -k "mosaic or pallas or auto" -n 4 -rA -q > $OUT/a1_gpu_tests.log 2>&1
tail -3 $OUT/a1_gpu_tests.log; grep -E "^(FAILED|ERROR)" $OUT/a1_gpu_tests.log | head
timeout 110 python .gpu/sweep7.py > $OUT/a2_wgrad_band.log 2>&1; cat $OUT/a2_wgrad_band.log | tail -14
cd experiments
timeout 230 python bench_moe.py --skip-layer --quick --strategies te,pallas,pallas-jax,jnp-capacity --out $OUT/gmm > $OUT/a3_gmm.log 2>&1
grep -v "^ *$" $OUT/a3_gmm.log | tail -30
