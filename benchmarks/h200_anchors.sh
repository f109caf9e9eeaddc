#!/usr/bin/env bash
# The side-by-side GPU anchors (our kernels, tokamax, TE, ragged_dot, dense) on one H200, in
# the device tool's calls (stages in order; the machine warm between calls), e.g.
# `bash benchmarks/h200_anchors.sh tests gmm1`:
#   tests  GPU tests of the tokamax and pallas grouped matmuls (and TE's, where staged)
#   gmm1   grouped GEMM fwd / fwd+bwd over dense: 8x2048 and 64x512 (experts x rows per expert)
#   gmm2   the same at 256x256 and 256x128
#   layer  MoE layer fwd+bwd over a dense SwiGLU of equal active FLOPs, 8192-32768 tokens
# Every strategy is timed beside the dense reference in the same process (bench_moe.py).
# Carry: .whl (benchmarks/stage_tokamax.sh fills it), .git-rev (`git rev-parse --short HEAD`)
# and, for TE, .te/env.sh after staging the
# .te parts as ../shared/device/README.md says. Everything lands under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ ! -f /tmp/site/.tokamax-ready ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl && touch /tmp/site/.tokamax-ready
fi
[ -f .te/env.sh ] && source .te/env.sh
export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks:$PWD/experiments${PYTHONPATH:+:$PYTHONPATH}
git_rev=$(cat .git-rev 2>/dev/null || echo unknown)
(nvidia-smi; python3 -c "import jax; print(jax.__version__, jax.devices())"; echo "commit $git_rev") \
  > "$OUT/machine.log" 2>&1
strategies=pallas,tokamax,te,ragged_dot,jnp-capacity
for stage in "$@"; do
case $stage in
  tests)
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/backends/test_tokamax.py \
      tests/backends/test_gpu_backends.py -k "tokamax or (equals_oracle and (pallas or te))" \
      2>&1 | tee "$OUT/gpu_tests.log" | tail -15 ;;
  gmm1|gmm2)
    shapes=$([ "$stage" = gmm1 ] && echo 8x2048,64x512 || echo 256x256,256x128)
    timeout 420 python3 benchmarks/bench_moe.py --skip-layer --strategies $strategies \
      --shapes $shapes --out "$OUT/$stage" 2>&1 | tee "$OUT/$stage.log" | grep -v Warning ;;
  layer)
    timeout 560 python3 benchmarks/bench_moe.py --skip-gmm --tokens 8192,16384,32768 \
      --layer-backends pallas,tokamax,te-gmm,jnp-capacity --out "$OUT/layer" 2>&1 \
      | tee "$OUT/layer.log" | grep -v Warning ;;
  *) echo "unknown stage $stage: tests, gmm1, gmm2 or layer"; exit 2 ;;
esac
done
