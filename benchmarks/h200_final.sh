#!/usr/bin/env bash
# Issue 22's closing call: this tree against the tree in .base/ (each from its own tree), in one call:
#   1. engine_loop.py at c=256 (the engine alone), .base then this tree;
#   2. serving_speed.py at c=1, 8 and 256 (x-vector, --max-num-seqs 256, 4 x c prompts, 2 client processes),
#      this tree then .base;
#   3. c=512 served (this tree, --max-num-seqs 512, 1,024 prompts).
# Random 0.6B Base weights, fixed lengths (EOS ignored). OUT: a results folder.
set -uo pipefail
. "$(dirname "$0")/h200_env.sh"
export PATH=/tmp/site/bin:$PATH
CKPT=/tmp/qwen3tts-0.6b-random
[ -f $CKPT/model.safetensors ] || PYTHONPATH=.:$PYTHONPATH python3 -c "import torch; \
from legato.models.qwen3_tts.config import preset; from legato.models.qwen3_tts.testing import write_checkpoint; \
write_checkpoint('$CKPT', preset('0.6B', 'base'), dtype=torch.bfloat16)"
for v in base new; do
  tree=.; [ $v = base ] && tree=.base
  (cd $tree && PYTHONPATH=.:$PYTHONPATH timeout 150 python3 benchmarks/engine_loop.py --concurrency 256 \
    --max-num-seqs 256 --requests 1024 --variants default --out "$OUT/loop-$v-c256.json" 2>&1 | grep '^{' | cut -c1-200)
done
export PYTHONPATH=.:$PYTHONPATH
SERVE="python3 benchmarks/serving_speed.py --ckpt $CKPT --data .bench-data/prompts --modes xvec --client-procs 2 \
  --startup-timeout 200 --cell-timeout 150"
for v in new base; do
  tree=.; [ $v = base ] && tree=.base
  timeout ${T2:-150} $SERVE --variant $v=$tree:legato --concurrency 1,8,256 --max-num-seqs 256 --min-prompts 8 \
    --max-prompts 1024 --prompts-per-conc 4 --out /tmp/served-$v 2>&1 | grep -v '^{' | tail -4
  cp /tmp/served-$v/summary.json "$OUT/served-$v.json"
done
timeout ${T3:-110} $SERVE --variant new=.:legato --concurrency 512 --max-num-seqs 512 --min-prompts 1024 \
  --max-prompts 1024 --out /tmp/served512 2>&1 | grep -v '^{' | tail -2
cp /tmp/served512/summary.json "$OUT/served-new-c512.json"
true
