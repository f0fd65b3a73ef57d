#!/usr/bin/env bash
# One device session's GPU work, each job on its own GPU of one host (jobs share the host's CPUs):
#   A  tests/test_gpu.py, then `legato probe`: single vs 1p1d (process workers, shm) and single vs
#      single with 2 code-predictor replicas — codes compared, TTFP and frames/s side by side
#   B  bench sweep 1p1d (+ single control)    C  bench sweep replicas:2 (+ single)    D  bench sweep split (+ single)
# With fewer GPUs than jobs, the later jobs are skipped (and say so). Results go to $RES (default /tmp/res).
set -uo pipefail
export RES=${RES:-/tmp/res}
LIMIT=${LIMIT:-540}
export CKPT=${CKPT:-/tmp/qwen3tts-0.6b-random} PROMPTS=${PROMPTS:-.bench-data/prompts} PYTHONUNBUFFERED=1 PY=${PY:-python3}
mkdir -p "$RES"
[ -f "$CKPT/model.safetensors" ] || $PY -c "import torch; from legato.models.qwen3_tts.config import preset; \
from legato.models.qwen3_tts.testing import write_checkpoint; \
write_checkpoint('$CKPT', preset('0.6B', 'base'), dtype=torch.bfloat16)"
NGPU=$(nvidia-smi -L | wc -l)
job_a() {
  timeout 150 $PY -m pytest -q tests/test_gpu.py -p no:cacheprovider
  $PY -m legato.cli probe --topology 1p1d --workers process --kv-transfer shm --model "$CKPT" \
    --requests 32 --frames 64 --concurrency 1,8,32 --out "$RES/probe-1p1d.json"
  $PY -m legato.cli probe --topology single --mtp-replicas 2 --model "$CKPT" \
    --requests 64 --frames 64 --concurrency 1,8,32,64 --out "$RES/probe-mtp2.json"
}
sweep() { OUT="$RES/sweep-$2" bash benchmarks/h200_serving.sh "$1" 1,8,32,64 100; }
jobs=("job_a" "sweep 1p1d pd" "sweep replicas:2 replicas" "sweep split split")
for i in "${!jobs[@]}"; do
  if [ "$i" -ge "$NGPU" ]; then echo "skipped (only $NGPU GPUs): ${jobs[$i]}"; continue; fi
  (export CUDA_VISIBLE_DEVICES=$i; timeout "$LIMIT" bash -c "$(declare -f job_a sweep); ${jobs[$i]}" \
     > "$RES/job$i.log" 2>&1; echo "job $i (${jobs[$i]}) exit $?") &
done
wait
