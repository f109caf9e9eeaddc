#!/usr/bin/env bash
# The side-by-side GPU anchors (our kernels, tokamax, TE, ragged_dot, dense) on one H200, in
# the device tool's calls (stages in order; the machine warm between calls), e.g.
# `bash benchmarks/h200_anchors.sh tests gmm1`:
#   tests  GPU tests of the tokamax and pallas grouped matmuls (and TE's, where staged)
#   gmm1   grouped GEMM fwd / fwd+bwd over dense: 8x2048 and 64x512 (experts x rows per expert)
#   gmm2   the same at 256x256 and 256x128
#   layer  MoE layer fwd+bwd over a dense SwiGLU of equal active FLOPs, 8192-32768 tokens
#   e1     proxy-2b train-step MFU: the defaults (bf16 set, all else as `dropless train` picks)
#          beside the hand-set best (pallas, cuDNN attention, unrolled layers)
#   m1     optimizer-moment host offload on proxy-2b: device memory and step time
#   memory XLA's memory figure of a real compile and the measured peak of one step
#          (gpu_memory_check.py), and the H200's own target description for compiles without one
# Every strategy is timed beside the dense reference in the same process (bench_moe.py).
# Carry: .whl (benchmarks/stage_tokamax.sh fills it), .git-rev (`git rev-parse --short HEAD`)
# and, for TE, .te/env.sh after staging the
# .te parts as ../shared/device/README.md says. Everything lands under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ ! -f /tmp/site/.tokamax-ready ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl || exit 1
  # tokamax imports xprof's kernel-stats tool at start-up; only its xprof timers use it
  mkdir -p /tmp/site/xprof/cli/tools
  touch /tmp/site/xprof/__init__.py /tmp/site/xprof/cli/__init__.py \
    /tmp/site/xprof/cli/tools/__init__.py /tmp/site/xprof/cli/tools/get_kernel_stats_tool.py
  touch /tmp/site/.tokamax-ready
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
  e1)
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
    for args in "--backends auto" \
        "--backends pallas --attention-impl cudnn --unroll-layers" \
        "--backends pallas --attention-impl cudnn"; do
      timeout 200 python3 benchmarks/bench_train.py --preset proxy-2b --seq 2048 --batch 24 \
        --steps 5 --compute-dtype bfloat16 $args --out "$OUT/e1" 2>&1 | grep -v Warning
    done | tee "$OUT/e1.log"
    unset XLA_PYTHON_CLIENT_MEM_FRACTION ;;
  m1)
    timeout 300 python3 benchmarks/bench_offload.py --preset proxy-2b --batch-size 8 \
      --seq-len 2048 --steps 6 --out "$OUT/offload_h200.json" 2>&1 | grep -v Warning \
      | tee "$OUT/m1.log" ;;
  memory)
    timeout 240 python3 benchmarks/gpu_memory_check.py --out "$OUT/gpu_memory_h200.json" \
      --save-target "$OUT/h200_target_config.txtpb" 2>&1 | tee "$OUT/memory.log" ;;
  *) echo "unknown stage $stage: tests, gmm1, gmm2, layer, e1, m1 or memory"; exit 2 ;;
esac
done
