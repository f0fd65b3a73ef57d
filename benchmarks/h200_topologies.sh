#!/usr/bin/env bash
# Issue 22's one-GPU topology table: for each topology a fresh server (every worker on cuda:0, --workers auto =
# a process per engine, --kv-transfer auto), its time to ready, then two c=64 x-vector cells in a row on that
# server: the first burst after the start and the second (the first-burst ratio). serving_speed.py does the
# work; its probe requests (one at a time) come before the first cell, as a health check's would.
#   OUT=... TOPOS="single replicas:2 split 1p1d" benchmarks/h200_topologies.sh
# TREE serves another source tree (e.g. .base, an earlier commit's, for a before/after in the same call); its
# results are named after the tree too. TAG is added to every result's name (e.g. TAG=-mps with
# SERVER_ARGS="--mps on": the co-located workers under a CUDA MPS daemon of the server's own).
# Random 0.6B Base weights, fixed lengths (EOS ignored). PER_CONC x 64 prompts per cell (default 8 = 512).
set -uo pipefail
. "$(dirname "$0")/h200_env.sh"
CKPT=/tmp/qwen3tts-0.6b-random
[ -f $CKPT/model.safetensors ] || PYTHONPATH=.:$PYTHONPATH python3 -c "import torch; \
from legato.models.qwen3_tts.config import preset; from legato.models.qwen3_tts.testing import write_checkpoint; \
write_checkpoint('$CKPT', preset('0.6B', 'base'), dtype=torch.bfloat16)"
for t in ${TOPOS:-single replicas:2 split 1p1d}; do
  wait_gpu_free 90
  tag=${t//:/}${TAG:-}$([ "${TREE:-.}" = . ] || echo "-${TREE//[^a-zA-Z0-9]/}")
  PYTHONPATH=.:$PYTHONPATH timeout ${T:-200} python3 benchmarks/serving_speed.py --ckpt $CKPT \
    --data .bench-data/prompts --variant "$tag=${TREE:-.}:legato" --out /tmp/topo-$tag --concurrency 64,64 --modes xvec \
    --max-num-seqs 64 --server-args "--topology $t --devices cuda:0 ${SERVER_ARGS:-}" --min-prompts 8 \
    --prompts-per-conc ${PER_CONC:-8} --max-prompts 1024 --startup-timeout 150 --cell-timeout 90 2>&1 \
    | grep -E '^\{|ready in|failed|Error' | cut -c1-700
  cp /tmp/topo-$tag/summary.json "$OUT/topo-$tag.json" 2>/dev/null
  # the server's warnings and last lines, and which requests had a gap in their audio and where (the last cell)
  { grep -E "WARNING|ERROR|grown" /tmp/topo-$tag/server-$tag.log | tail -20; tail -5 /tmp/topo-$tag/server-$tag.log
    python3 benchmarks/underruns.py /tmp/topo-$tag/runs/*.json --top 12; } > "$OUT/topo-$tag-server-tail.log" 2>&1
done
true
