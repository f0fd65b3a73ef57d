#!/usr/bin/env bash
# Issue 22's device call (docs/benchmarks.md, "Served against the engine alone"): in one call,
#   1. serving_speed.py at c=64 and c=256 (x-vector, --max-num-seqs 256, the bench client in 2 processes),
#      this tree against 8c76ab2 (.base/), each server run from its own tree;
#   2. engine_loop.py at c=64 and c=256 (this tree): the engine alone, for served / engine;
#   3. c=512 served (this tree, --max-num-seqs 512);
#   4. client_limit.py on this host: the bench client against the stand-in at c=256 and 512.
# Needs: the server's wheels in .whl/, 8c76ab2's tree in .base/, prompts in .bench-data/prompts, OUT a results
# folder. Random weights (a 0.6B Base checkpoint written first); lengths fixed (EOS ignored).
set -uo pipefail
. "$(dirname "$0")/h200_env.sh"
export PYTHONPATH=.:$PYTHONPATH
CKPT=/tmp/qwen3tts-0.6b-random
[ -f $CKPT/model.safetensors ] || python3 -c "import torch; from legato.models.qwen3_tts.config import preset; \
from legato.models.qwen3_tts.testing import write_checkpoint; \
write_checkpoint('$CKPT', preset('0.6B', 'base'), dtype=torch.bfloat16)"
SERVE="python3 benchmarks/serving_speed.py --ckpt $CKPT --data .bench-data/prompts --modes xvec --client-procs 2 \
  --startup-timeout 200 --cell-timeout 120"
timeout ${T1:-330} $SERVE --variant new=.:legato --variant base=.base:legato --concurrency 64,256 \
  --max-num-seqs 256 --out /tmp/served 2>&1 | grep -v '^{' | tail -8
cp /tmp/served/summary.json "$OUT/served-c64-256.json"
for c in 64 256; do
  timeout 120 python3 benchmarks/engine_loop.py --concurrency $c --max-num-seqs $c --requests $((4 * c)) \
    --variants default --out "$OUT/loop-c$c.json" 2>&1 | grep '^{' | cut -c1-300
done
timeout ${T3:-120} $SERVE --variant new=.:legato --concurrency 512 --max-num-seqs 512 --max-prompts 1024 \
  --out /tmp/served512 2>&1 | grep -v '^{' | tail -4
cp /tmp/served512/summary.json "$OUT/served-c512.json"
timeout ${T4:-100} python3 benchmarks/client_limit.py --concurrency 256,512 --client-procs 1,2 --frames 25 --speed 2 \
  --out /tmp/climit 2>&1 | tail -6
cp /tmp/climit/*.json "$OUT/" 2>/dev/null
true
