#!/usr/bin/env bash
# The serving sweeps of docs/benchmarks.md, as run on the lent H200 (one GPU, several workers may share it).
# Needs: the server's wheels installed (fastapi, uvicorn, pyzmq, ...), PROMPTS pointing at a copy of
# shared/data/prompts, OUT a results folder. Writes a random-weight 0.6B checkpoint first (random weights:
# lengths are fixed from the text, EOS ignored).
#   usage: benchmarks/h200_serving.sh TOPOLOGIES [CONCURRENCY] [NUM_PROMPTS]
set -euo pipefail
TOPOLOGIES=${1:-single}
CONC=${2:-1,8,32,64}
NPROMPTS=${3:-100}
PROMPTS=${PROMPTS:-../shared/data/prompts}
OUT=${OUT:-bench-out}
CKPT=${CKPT:-/tmp/qwen3tts-0.6b-random}
PY=${PY:-python3}
DEV=${DEV:-cuda:0}
if [ ! -f "$CKPT/model.safetensors" ]; then
  $PY -c "import torch; from legato.models.qwen3_tts.config import preset; \
from legato.models.qwen3_tts.testing import write_checkpoint; \
write_checkpoint('$CKPT', preset('0.6B', 'base'), dtype=torch.bfloat16)"
fi
# Every worker shares the one GPU: replicas:2, 1p1d (process workers, shm KV links) and split (talker and codec
# worker processes) count as 1 GPU.
$PY -m legato.cli bench sweep --dataset-path "$PROMPTS" --locale en --num-prompts "$NPROMPTS" \
  --fixed-length --topologies "$TOPOLOGIES" --concurrency "$CONC" \
  --gpus replicas:2=1 --gpus 1p1d=1 --gpus split=1 \
  --topology-args "replicas:2=--devices $DEV" --topology-args "split=--devices $DEV --workers process" \
  --topology-args "1p1d=--devices $DEV --workers process --kv-transfer shm ${PD_ARGS:-}" \
  --server-args "--model $CKPT --max-num-seqs 64 ${SERVER_ARGS:-}" \
  --no-progress --out-dir "$OUT"
