#!/usr/bin/env bash
# Issue 22, the admission change (ClipCache + voice key + cheaper prompts), in one call: serving_speed.py at
# c=64 and c=256 with long cells (4 x c prompts), x-vector, --max-num-seqs 256, 2 bench-client processes,
# this tree against the tree in .base/ (each server from its own tree), a py-spy of this tree's server and
# worker at c=256; then engine_loop.py at c=64 and c=256 (the engine alone, this tree) for served / engine.
# Random 0.6B Base weights, fixed lengths (EOS ignored). OUT: a results folder.
set -uo pipefail
. "$(dirname "$0")/h200_env.sh"
export PATH=/tmp/site/bin:$PATH PYTHONPATH=.:$PYTHONPATH
CKPT=/tmp/qwen3tts-0.6b-random
[ -f $CKPT/model.safetensors ] || python3 -c "import torch; from legato.models.qwen3_tts.config import preset; \
from legato.models.qwen3_tts.testing import write_checkpoint; \
write_checkpoint('$CKPT', preset('0.6B', 'base'), dtype=torch.bfloat16)"
SERVE="python3 benchmarks/serving_speed.py --ckpt $CKPT --data .bench-data/prompts --modes xvec --client-procs 2 \
  --startup-timeout 200 --cell-timeout 150 --max-num-seqs 256"
timeout ${T1:-200} $SERVE --variant new=.:legato --concurrency 64,256 --min-prompts 1024 --max-prompts 1024 \
  --profile xvec:256 --profile-seconds 8 --out /tmp/served-new 2>&1 | grep -v '^{' | tail -4
timeout ${T2:-180} $SERVE --variant base=.base:legato --concurrency 64,256 --min-prompts 1024 --max-prompts 1024 \
  --out /tmp/served-base 2>&1 | grep -v '^{' | tail -3
python3 -c "import json,sys; json.dump(json.load(open('/tmp/served-new/summary.json')) + \
json.load(open('/tmp/served-base/summary.json')), open('$OUT/served-ab.json', 'w'), indent=1)"
cp /tmp/served-new/profile-*.txt "$OUT/" 2>/dev/null
for c in 64 256; do
  timeout 100 python3 benchmarks/engine_loop.py --concurrency $c --max-num-seqs $c --requests $((4 * c)) \
    --variants default --out "$OUT/loop-c$c.json" 2>&1 | grep '^{' | cut -c1-260
done
true
