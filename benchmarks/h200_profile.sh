#!/usr/bin/env bash
# Where the host time of a c=256 step goes (issues 21/22), in one call: py-spy (in .whl/) of
#   1. the engine alone (engine_loop.py, 256 live streams, 6 x 256 requests), 5 s of its measured loop,
#      plus a torch.profiler window that names the host phase open when the GPU idles;
#   2. the server and its worker (serving_speed.py, c=256, 1,024 prompts so the cell is long), 8 s; SERVE_BASE=1 serves
#      .base/ (commit BASE) first, in the same call; GIL=1 samples only the thread holding the GIL (py-spy --gil),
#      NATIVE=1 adds C frames (py-spy --native: a CUDA driver call or a lock the engine thread waits in).
#   0. BURST=1: first a burst of C x-vector requests through LocalEngineClient's admission beside 64 running
#      streams (admission_burst.py), for .base/ (with SERVE_BASE=1) and the tree: the prepare stage and TTFP.
# Each profile is summarised by benchmarks/pyspy_summary.py into its .summary.txt.
# C sets the concurrency (256), PROMPTS the served cell (4 x C), CLIENT_PROCS the bench client's processes (a comma
# list runs the cell once per count: is the client the limit?), FRONTS the served tree's --fronts. Random 0.6B Base weights, fixed lengths (EOS ignored). OUT: a results folder.
set -uo pipefail
. "$(dirname "$0")/h200_env.sh"
export PATH=/tmp/site/bin:$PATH PYTHONPATH=.:$PYTHONPATH
py-spy --version || echo "py-spy missing: no profiles"
CKPT=/tmp/qwen3tts-0.6b-random
[ -f $CKPT/model.safetensors ] || python3 -c "import torch; from legato.models.qwen3_tts.config import preset; \
from legato.models.qwen3_tts.testing import write_checkpoint; \
write_checkpoint('$CKPT', preset('0.6B', 'base'), dtype=torch.bfloat16)"
C=${C:-256}
if [ -n "${BURST:-}" ]; then
  for tree in ${SERVE_BASE:+.base} .; do
    name=$([ "$tree" = . ] && echo new || echo base)
    PYTHONPATH=$tree:$PYTHONPATH timeout ${T0:-150} python3 benchmarks/admission_burst.py --size 0.6B --device cuda \
      --burst $C --background 64 --rounds 3 --label $name --out "$OUT/burst-$name.json" > "$OUT/burst-$name.log" 2>&1
    python3 -c "import json,sys; [print(sys.argv[2], r) for r in json.load(open(sys.argv[1]))['rounds']]" \
      "$OUT/burst-$name.json" $name 2>/dev/null || tail -3 "$OUT/burst-$name.log"
  done
fi
rm -f /tmp/loop-ready
timeout ${T1:-240} python3 benchmarks/engine_loop.py --concurrency $C --max-num-seqs $C --requests $((6 * C)) \
  --variants ${LOOP_VARIANTS:-default,default+trace} --trace-steps 40 --trace-after 60 --ready-file /tmp/loop-ready \
  --out "$OUT/loop-c$C.json" > "$OUT/loop-c$C.log" 2>&1 &
pid=$!
for _ in $(seq 480); do [ -f /tmp/loop-ready ] && break; sleep 0.5; done
[ -f /tmp/loop-ready ] && py-spy record --pid $pid --duration 5 --rate 200 --format raw --threads --nonblocking \
  --output "$OUT/loop-c$C-pyspy.txt" > /dev/null 2>&1
wait $pid
grep '^{' "$OUT/loop-c$C.log" | cut -c1-600
timeout ${T2:-300} python3 benchmarks/serving_speed.py --ckpt $CKPT --data .bench-data/prompts --modes xvec \
  --client-procs ${CLIENT_PROCS:-2} --startup-timeout 200 --cell-timeout 150 ${SERVE_BASE:+--variant base=.base:legato} \
  --variant new=.:legato ${FRONTS:+--variant-args "new=--fronts $FRONTS"} --concurrency $C ${GIL:+--profile-gil} ${NATIVE:+--profile-native} \
  --max-num-seqs $C --min-prompts ${PROMPTS:-$((4 * C))} --max-prompts ${PROMPTS:-$((4 * C))} --profile xvec:$C --profile-seconds 8 \
  --out /tmp/served 2>&1 | grep -v '^{' | tail -6
cp /tmp/served/summary.json "$OUT/served-c$C.json"
cp /tmp/served/profile-*.txt "$OUT/" 2>/dev/null
for f in "$OUT"/*pyspy.txt "$OUT"/profile-*.txt; do
  [ -f "$f" ] && python3 benchmarks/pyspy_summary.py "$f" > "${f%.txt}.summary.txt"
done
grep -h -A3 "Samples by" "$OUT"/*.summary.txt 2>/dev/null
true
