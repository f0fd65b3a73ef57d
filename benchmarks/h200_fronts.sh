#!/usr/bin/env bash
# Issue 22, several front processes (`legato serve --fronts N`), in one device call each:
#   served  serving_speed.py, x-vector, --max-num-seqs 256, 1,024 prompts a cell: the tree in .base/ (one front),
#           this tree with one front, and this tree with --fronts 4, one server after the other;
#   engine  engine_loop.py at c=64 and c=256 (the engine alone, for served / engine), then c=512 served with
#           --fronts 4 and --max-num-seqs 512;
#   steady  engine_loop.py at c=256 and 64 (6 x c requests, at most 1,024), then one front and four served at the
#           same c and request counts: each run's rates over its steady middle (legato/bench/steady.py) beside the
#           whole-run figures;
#           f4p3 is four fronts with --prefill-interval 3; f4g (VARIANTS=... --variant f4g=.:legato) four fronts with
#           the worker's GIL switch interval at 0.25 ms (default 1 ms); f4n four fronts with the engine thread at
#           nice -10 (LEGATO_ENGINE_NICE); f4b (--variant f4b=.base:legato) four fronts of the tree in .base/. Each served cell prints the CPU census of its steady middle (host cores
#           busy; each thread group's CPU and run-queue cores, legato/bench/cpu_census.py). PROFILE=1 then serves
#           one more c=256 cell (four fronts) under py-spy --native --idle, 4 s of its steady middle.
# Needs the server's wheels in .whl/, the base tree in .base/, prompts in .bench-data/prompts. Random 0.6B Base
# weights (written first), lengths fixed (EOS ignored).
set -uo pipefail
. "$(dirname "$0")/h200_env.sh"
export PYTHONPATH=.:$PYTHONPATH
random_checkpoint
SERVE="python3 benchmarks/serving_speed.py --ckpt $CKPT --data .bench-data/prompts --modes xvec \
  --client-procs ${PROCS:-6} --min-prompts 1024 --max-prompts 1024 --startup-timeout 150 --cell-timeout 100"
case ${1:-served} in
  served)
    timeout ${T:-450} $SERVE ${VARIANTS:---variant base=.base:legato --variant new=.:legato --variant f4=.:legato} \
      --variant-args "f4=--fronts 4" --variant-args "f2=--fronts 2" --concurrency ${CONC:-256,64} \
      --max-num-seqs 256 --out /tmp/served 2>&1 | grep -v '^{' | tail -16
    cp /tmp/served/summary.json "$OUT/served.json"
    mkdir -p "$OUT/logs" && for f in /tmp/served/server-*.log; do tail -c 300000 "$f" > "$OUT/logs/$(basename $f)"; done ;;
  engine)
    for c in ${LOOP_CONC:-256 64}; do
      timeout ${TL:-150} python3 benchmarks/engine_loop.py --concurrency $c --max-num-seqs $c --requests $((6 * c)) \
        --variants default --out "$OUT/loop-c$c.json" 2>&1 | grep '^{' | cut -c1-300
    done
    timeout ${T512:-150} $SERVE --variant f4=.:legato --variant-args "f4=--fronts 4" --concurrency 512 \
      --max-num-seqs 512 --out /tmp/served512 2>&1 | grep -v '^{' | tail -4
    cp /tmp/served512/summary.json "$OUT/served-c512.json" ;;
  steady)  # the engine alone, then one front and four, at c=256 and 64 with 6 x c requests each: steady middles
    # 6 x c requests, at most 1,024 (the prompt list holds 1,132), the same count for the engine and the server
    for c in ${LOOP_CONC:-256 64}; do
      n=$((6 * c > 1024 ? 1024 : 6 * c))
      timeout ${TL:-150} python3 benchmarks/engine_loop.py --concurrency $c --max-num-seqs $c --requests $n \
        --variants default --out "$OUT/loop-c$c.json" > "$OUT/loop-c$c.log" 2>&1
      python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['rows'][0]; print('engine alone c=$c', \
round(r['audio_s_per_s'], 1), 'audio-s/s; steady', r['steady'])" "$OUT/loop-c$c.json" 2>/dev/null \
        || tail -5 "$OUT/loop-c$c.log"
    done
    timeout ${T:-420} python3 benchmarks/serving_speed.py --ckpt $CKPT --data .bench-data/prompts --modes xvec \
      --client-procs ${PROCS:-6} --prompts-per-conc 6 --min-prompts 0 --max-prompts 1024 --startup-timeout 150 \
      --cell-timeout 100 ${VARIANTS:---variant f4=.:legato --variant f4p3=.:legato --variant f1=.:legato} \
      --variant-args "f4=--fronts 4" --variant-args "f4b=--fronts 4" --variant-args "f4p3=--fronts 4 --prefill-interval 3" \
      --variant-args "f4g=--fronts 4" --variant-env "f4g=LEGATO_GIL_SWITCH_MS=0.25" \
      --variant-args "f4n=--fronts 4" --variant-env "f4n=LEGATO_ENGINE_NICE=-10" \
      --concurrency ${CONC:-256,64} --max-num-seqs 256 --out /tmp/steady 2>&1 | grep -v '^{' | tail -24
    cp /tmp/steady/summary.json "$OUT/served-steady.json"
    if [ -n "${PROFILE:-}" ]; then  # then where the served engine thread's time goes: a profile of its steady middle
      # py-spy --native --idle from 2 s into a c=256 cell of four fronts, 4 s: GIL waits (take_gil), driver calls
      # and locks, device syncs, by thread (pauses the processes 100 times a second: a separate, unmeasured cell)
      timeout ${TP:-200} python3 benchmarks/serving_speed.py --ckpt $CKPT --data .bench-data/prompts --modes xvec \
        --client-procs ${PROCS:-6} --min-prompts 1024 --max-prompts 1024 --startup-timeout 150 --cell-timeout 100 \
        --variant f4prof=.:legato --variant-args "f4prof=--fronts 4" --concurrency 256 --max-num-seqs 256 \
        --profile xvec:256 --profile-native --profile-idle --profile-delay 2 --profile-seconds 4 \
        --out /tmp/steady-prof 2>&1 | grep -v '^{' | tail -3
      for f in /tmp/steady-prof/profile-*.txt; do
        [ -f "$f" ] && python3 benchmarks/pyspy_summary.py "$f" --threads 8 --top 25 > "$OUT/$(basename "${f%.txt}").summary.txt"
      done
      grep -h -A12 "Samples by" "$OUT"/profile-*.summary.txt 2>/dev/null | head -14
    fi ;;
esac
true
