#!/usr/bin/env bash
# Twentieth run, call A (no TE): the step with float32 against bfloat16 logits (the nineteenth
# run's step_logits.py,
# two rounds) at batch 24 on an H200 or batch 16 on an H100 (78 GiB), then the step's profile
# with bfloat16 logits (command buffers off); on an H100 also batch 24 with bfloat16 logits.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/experiments:/tmp/site
(nvidia-smi; python -c "import jax; print(jax.__version__, jax.devices())") > $OUT/a0_machine.log 2>&1
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
batch=16; [ "$mib" -gt 100000 ] && batch=24
echo "GPU memory $mib MiB -> batch $batch"; head -12 $OUT/a0_machine.log | grep -E "NVIDIA|MiB"
cd experiments
timeout 330 python ../docs/bench_logs/h200-2026-12-05-run19/step_logits.py $batch 2 > $OUT/a1_step_logits_b$batch.log 2>&1
grep -E "Error|RESOURCE" $OUT/a1_step_logits_b$batch.log | cut -c 1-300; grep -E "^==" $OUT/a1_step_logits_b$batch.log
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 150 python bench_train.py --preset proxy-2b --seq 2048 \
  --attention-impl cudnn --backends pallas --unroll-layers --batch $batch --steps 2 --profile --profile-top 40 \
  --out /tmp/rc --set logits_dtype=bfloat16 > $OUT/a2_profile_b${batch}_bf16_logits.log 2>&1
grep -E "Error|RESOURCE" $OUT/a2_profile_b${batch}_bf16_logits.log | cut -c 1-300
sed -n '/device time per step by scope/,/^$/p;/^head: kernels/,/^$/p;/^head (bwd): kernels/,/^$/p' $OUT/a2_profile_b${batch}_bf16_logits.log
[ $batch = 24 ] && exit 0
timeout 120 python bench_train.py --preset proxy-2b --seq 2048 --attention-impl cudnn --backends pallas \
  --unroll-layers --batch 24 --steps 3 --out /tmp/r24 --set logits_dtype=bfloat16 > $OUT/a3_train_b24_bf16_logits.log 2>&1
grep -E "Error|RESOURCE" $OUT/a3_train_b24_bf16_logits.log | cut -c 1-300; tail -5 $OUT/a3_train_b24_bf16_logits.log
