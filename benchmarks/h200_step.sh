#!/usr/bin/env bash
# Issue 24's device calls (docs/benchmarks.md, "The frame step in fewer kernels"), one part per call:
#   benchmarks/h200_step.sh check     # import check, tests/test_gpu.py (TESTS selects; TESTS=none: none), the
#                                     # kernel check scripts (CHECKS: names in tests/, default attention_kernel_checks)
#   benchmarks/h200_step.sh offline   # offline.py (codec off): .base/ vs this tree vs this tree unfused (UNFUSED= skips)
#                                     # vs this tree with every matmul on cuBLAS (CUBLAS= skips; CUBLAS_BATCHES)
#                                     # and, with COMPILED=1, with the torch.compile'd sampler; PLAIN_NORM=1 adds this tree
#                                     # with a split product's sum, add and norm as two kernels (--no-fused-norm); PDL=1
#                                     # adds this tree with programmatic dependent launch (--pdl, plus PDL_FLAGS; NO_PDL=1:
#                                     # without it, --no-pdl, the default since 2026-12-07 being with it); STACK_BATCHES
#                                     # adds .base/ and this tree with the stack (--stack); BISECTION=1 this tree with the
#                                     # draw's plain bisection (--bisection-draw); DRAW_WARPS=N with N warps a draw; PER_BLOCK=1
#                                     # with the draw's Philox once per four-word block (--philox-per-block);
#                                     # NO_LOOKUP=1 a code-predictor pass's lookup and first norm as two kernels;
#                                     # NO_PROJ_LOOKUP=1 a projected code predictor's (1.7B) passes without the
#                                     # projected tables (--no-projected-lookup; PROJ_LOOKUP=1 ran with them before
#                                     # they became the default); NO_BASE=1 skips .base/
#   benchmarks/h200_step.sh loop      # engine_loop.py at c=64 and c=256: .base/ vs this tree (default, no-audio)
#   benchmarks/h200_step.sh verify    # one call for kernels changed since the last device run: the GPU tests that
#                                     # cover them (TESTS, T), offline.py .base/ vs this tree at batch 1 and 64, and
#                                     # the codec step at 64 x 1 and 256 x 4
#   benchmarks/h200_step.sh tune      # matmul_tune.py (the few-row GEMM's tiles), then offline.py with them against
#                                     # the path before it (and its rule of thumb with RULE=1)
#   benchmarks/h200_step.sh tiles     # one-row tile variants timed inside the frame (frame_tiles.py): offline.py at batch
#                                     # 1 for SIZES, this tree's table, then each variant's LEGATO_MATMUL_TILES (VARIANTS:
#                                     # name filter, a grep pattern)
#   benchmarks/h200_step.sh final     # the committed tiles' GPU tests, offline.py against the path before them
#   benchmarks/h200_step.sh splits    # the talker attention's split rule: offline.py against the same tree splitting
#                                     # at every row count (--attn-split-all), 0.6B and 1.7B
#   benchmarks/h200_step.sh stack     # the code predictor as one launch per pass: its CUDA checks, offline.py with
#                                     # it (--stack) against without (BATCHES, SIZES; STACK_BASE=1 adds .base/'s stack)
#   benchmarks/h200_step.sh profile   # c=64 decode steps of this tree by kernel (offline.py --profile-batch; PB, PMODES)
#   benchmarks/h200_step.sh launch    # the fused norm's check; offline.py: .base/, this tree, --pdl; the stack with --pdl
#                                     # (codes digests must match); GPU_TEST=1 adds the PDL engine test
#   benchmarks/h200_step.sh ncu       # Nsight Compute's warp-stall samples of one one-row stack pass, per SASS
#                                     # instruction (stall_ledger.py prints the top; the report and CSV come back)
#   benchmarks/h200_step.sh draw      # the draw's packed top-k search: draw_kernel_checks.py on CUDA (both searches
#                                     # against sampler.draw and torch.topk), draw_speed.py, the GPU draw test
#   benchmarks/h200_step.sh serve     # serving_speed.py: this tree (and .base/ with SERVE_BASE=1), x-vector at
#                                     # c=1 and 64, over HTTP and the streaming-text WebSocket (MODES, CONC; PER_CONC
#                                     # and MAX_PROMPTS size a cell; PROFILE=mode:conc,... py-spies those cells)
# Needs: the server's wheels in .whl/, the tree to compare in .base/ (its commit in BASE), OUT a results folder.
# Random weights throughout; lengths fixed (EOS ignored).
set -uo pipefail
PART=${1:-check}
BASE=${BASE:-366982a}
. "$(dirname "$0")/h200_env.sh"
offline() {  # tree tag size batches [flags]
  (cd "$1" && PYTHONPATH=.:$PYTHONPATH LEGATO_COMMIT=$([ "$1" = . ] && echo "$LEGATO_COMMIT" || echo "$BASE") \
    timeout ${T:-200} python3 benchmarks/offline.py --size "$3" --batch-sizes "$4" --frames ${FRAMES:-64} \
    --modes graphs --codec-batches none --out "$OUT/offline-$2-$3.json" ${5:-}) 2>&1 | grep -E '^\[|Error' | cut -c1-420
}
case "$PART" in
  check)  # EACH=1: one pytest (and one timeout T) per selected test, so a slow test cannot hide the others' results
    if [ -n "${EACH:-}" ]; then
      tests=$(PYTHONPATH=.:tests:$PYTHONPATH python3 -m pytest -q --co -p no:cacheprovider tests/test_gpu.py \
        -k "${TESTS:-not nothing}" 2>/dev/null | grep '::')
    else tests=tests/test_gpu.py; fi
    for t in $tests; do
      # -v: each test's result prints as it ends, so a run cut by its time limit still says what passed (a -q run
      # cut at 420 s on 2026-12-04 printed nothing at all).
      PYTHONPATH=.:tests:$PYTHONPATH timeout ${T:-300} python3 -m pytest -v -rA -p no:cacheprovider --durations=3 \
        "$t" -k "${TESTS:-not nothing}" 2>&1 | grep -E "^E |passed|failed|Error|PASS|FAIL|s call" | tail -30
      echo "[check] $t rc=${PIPESTATUS[0]}"
    done
    for c in ${CHECKS:-attention_kernel_checks}; do  # CHECKS=none: no check script
      [ "$c" = none ] && continue
      PYTHONPATH=.:tests:$PYTHONPATH timeout 120 python3 tests/$c.py cuda 2>&1 | grep -v Warn | tail -${CHECK_LINES:-8}
    done ;;
  offline)
    for size in ${SIZES:-0.6B 1.7B}; do
      [ -z "${NO_BASE:-}" ] && offline .base base "$size" "${BATCHES:-1,64,256}"
      offline . new "$size" "${BATCHES:-1,64,256}"
      [ -n "${UNFUSED-1}" ] && offline . unfused "$size" "${BATCHES:-1,64,256}" --unfused-attention
      [ -n "${CUBLAS-1}" ] && offline . cublas "$size" "${CUBLAS_BATCHES:-1,8}" --cublas-linear
      [ -n "${COMPILED:-}" ] && offline . compiled-sampler "$size" "${BATCHES:-1,64,256}" --compiled-sampler
      [ -n "${PLAIN_NORM:-}" ] && offline . plain-norm "$size" "${BATCHES:-1,64,256}" --no-fused-norm
      [ -n "${PDL:-}" ] && offline . pdl "$size" "${BATCHES:-1,64,256}" "--pdl ${PDL_FLAGS:-}"
      [ -n "${NO_PDL:-}" ] && offline . no-pdl "$size" "${BATCHES:-1,64,256}" "--no-pdl ${PDL_FLAGS:-}"
      [ -n "${BISECTION:-}" ] && offline . bisection "$size" "${BATCHES:-1,64,256}" --bisection-draw
      [ -n "${DRAW_WARPS:-}" ] && offline . warps$DRAW_WARPS "$size" "${BATCHES:-1,64,256}" "--draw-warps $DRAW_WARPS"
      [ -n "${PER_BLOCK:-}" ] && offline . per-block "$size" "${BATCHES:-1,64,256}" --philox-per-block
      [ -n "${NO_LOOKUP:-}" ] && offline . no-lookup "$size" "${BATCHES:-1,64,256}" --no-lookup-norm
      [ -n "${NO_PROJ_LOOKUP:-}" ] && offline . no-proj-lookup "$size" "${BATCHES:-1,64,256}" --no-projected-lookup
      if [ -n "${STACK_BATCHES:-}" ]; then
        offline .base base-stack "$size" "$STACK_BATCHES" --stack
        offline . stack "$size" "$STACK_BATCHES" --stack
      fi
    done ;;
  loop)
    for c in ${CONC:-64 256}; do
      (cd .base && PYTHONPATH=.:$PYTHONPATH LEGATO_COMMIT=$BASE timeout 200 python3 benchmarks/engine_loop.py \
        --concurrency $c --max-num-seqs $c --requests $((4 * c)) --variants ${VARIANTS:-default,no-audio} \
        --out "$OUT/loop-base-c$c.json") 2>&1 | grep '^{' | cut -c1-400
      PYTHONPATH=.:$PYTHONPATH timeout 200 python3 benchmarks/engine_loop.py --concurrency $c --max-num-seqs $c \
        --requests $((4 * c)) --variants ${VARIANTS:-default,no-audio} --out "$OUT/loop-new-c$c.json" \
        2>&1 | grep '^{' | cut -c1-400
    done ;;
  serve)
    CKPT=/tmp/qwen3tts-0.6b-random
    [ -f $CKPT/model.safetensors ] || PYTHONPATH=.:$PYTHONPATH python3 -c "import torch; \
from legato.models.qwen3_tts.config import preset; from legato.models.qwen3_tts.testing import write_checkpoint; \
write_checkpoint('$CKPT', preset('0.6B', 'base'), dtype=torch.bfloat16)"
    PYTHONPATH=.:$PYTHONPATH timeout ${T:-560} python3 benchmarks/serving_speed.py --ckpt $CKPT \
      --data .bench-data/prompts --variant new=.:legato ${SERVE_BASE:+--variant base=.base:legato} --out /tmp/serve \
      --concurrency ${CONC:-1,64} --modes ${MODES:-xvec,xvec-ws} --max-num-seqs 64 --min-prompts 8 \
      --prompts-per-conc ${PER_CONC:-4} --max-prompts ${MAX_PROMPTS:-256} ${PROFILE:+--profile $PROFILE} \
      --startup-timeout 200 --cell-timeout 150 2>&1 | tail -${SERVE_LINES:-14}
    cp /tmp/serve/summary.json "$OUT/serve.json"
    mkdir -p "$OUT/serve-runs" && cp /tmp/serve/runs/*.json /tmp/serve/profile-*.txt /tmp/serve/server-*.log \
      "$OUT/serve-runs/" 2>/dev/null ;;
  verify)
    PYTHONPATH=.:tests:$PYTHONPATH timeout ${T:-400} python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
      -k "${TESTS:-fused_decode or draw or codec_graphs or graph_decode}" 2>&1 | grep -E "^E |passed|failed" | tail -20
    offline .base base 0.6B "${BATCHES:-1,64}"
    offline . new 0.6B "${BATCHES:-1,64}"
    PYTHONPATH=.:$PYTHONPATH timeout 150 python3 benchmarks/codec_step.py --variants new --dtypes bfloat16 \
      --no-fidelity --cells 64x1,256x4 --profile-cells none --out "$OUT/codec_step.json" 2>&1 | grep -v '^{' | tail -8 ;;
  tune)  # matmul_tune.py's tiles (TUNE_SIZES, TUNE_T), then offline.py with them against the path before
         # layers/small_matmul.py (--no-small-matmul) and, with RULE=1, against its rule of thumb alone
    PYTHONPATH=.:$PYTHONPATH timeout ${TUNE_T:-240} python3 benchmarks/matmul_tune.py --sizes ${TUNE_SIZES:-0.6B,1.7B} \
      --out "$OUT/tiles.json" 2>&1 | grep -E '^\[tune\]|Error' | cut -c1-220
    LEGATO_MATMUL_TILES=$OUT/tiles.json offline . tuned 0.6B "${BATCHES:-1,64,256}"
    offline . before 0.6B "${BATCHES:-1,64,256}" --no-small-matmul
    [ -n "${RULE:-}" ] && offline . rule 0.6B "${BATCHES:-1,64,256}" ;;
  tiles)
    for size in ${SIZES:-0.6B}; do
      offline . table "$size" 1
      for f in $(python3 benchmarks/frame_tiles.py --out-dir /tmp/frame-tiles --size "$size" | grep -E "${VARIANTS:-.}"); do
        LEGATO_MATMUL_TILES=$f offline . "$(basename "$f" .json)" "$size" 1
      done
    done ;;
  final)  # the committed tiles: their GPU tests, then offline.py against the path before small_matmul (0.6B at
          # BATCHES, 1.7B at BIG_BATCHES)
    PYTHONPATH=.:tests:$PYTHONPATH timeout ${T_TESTS:-150} python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
      -k "${TESTS:-small_matmul}" 2>&1 | grep -E "^E |passed|failed" | tail -20
    offline . new 0.6B "${BATCHES:-1,64,256}"
    offline . before 0.6B "${BATCHES:-1,64,256}" --no-small-matmul
    offline . new 1.7B "${BIG_BATCHES:-1}"
    offline . before 1.7B "${BIG_BATCHES:-1}" --no-small-matmul ;;
  splits)  # fused_attention.ONE_SPLIT_ROWS: offline.py at BATCHES for SIZES, the rule against --attn-split-all (the
           # path before it) in the same call. Its GPU tests run through `check` with EACH=1 (one pytest and one
           # time limit per test: one pytest for all of them hit its limit before it reported, 2026-12-04).
    for size in ${SIZES:-0.6B 1.7B}; do
      offline . rule "$size" "${BATCHES:-1,8,64,256}"
      offline . split-all "$size" "${BATCHES:-1,8,64,256}" --attn-split-all
    done ;;
  stack)  # the code predictor's one-launch pass (layers/decoder_stack.py): its check script on CUDA, each phase's
          # time (stack_phases.py), then offline.py
          # with it (--stack) against without (the unfused layers, the default) at BATCHES for SIZES, in the same call
    [ -n "${SKIP_CHECK:-}" ] || PYTHONPATH=.:tests:$PYTHONPATH timeout ${T_CHECK:-200} python3 tests/decoder_stack_checks.py cuda \
      "${STACK_MODEL:-0.6B code predictor}" 2>&1 | grep -v Warn | tee /tmp/stack-check.txt | tail -30
    # A check that failed stops the part; one cut by its time limit (no verdict printed: session of 2026-12-07 (4)
    # lost a call's timing so) is said and the timing runs.
    if [ -z "${SKIP_CHECK:-}" ] && ! grep -q "ALL OK" /tmp/stack-check.txt; then
      grep -q -E "FAIL|Error" /tmp/stack-check.txt && { echo "[stack] checks failed: offline.py not run"; exit 1; }
      echo "[stack] checks cut by their time limit (T_CHECK) before a verdict: timing anyway"
    fi
    [ -n "${SKIP_PHASES:-}" ] || PYTHONPATH=.:$PYTHONPATH timeout ${T_PHASES:-150} python3 benchmarks/stack_phases.py \
      --rows "${STACK_ROWS:-1,2}" --out "$OUT/stack_phases.json" 2>&1 | grep -E '^\{|Error' | cut -c1-600
    for size in ${SIZES:-0.6B 1.7B}; do
      # STACK_BASE=1: .base/'s stack first, in the same call (a kernel change against the one before it)
      [ -n "${STACK_BASE:-}" ] && offline .base base-stack "$size" "${BATCHES:-1,2,4,8}" --stack
      offline . stack "$size" "${BATCHES:-1,2,4,8}" --stack
      [ -n "${NO_STACK-1}" ] && offline . no-stack "$size" "${BATCHES:-1,2,4,8}"  # NO_STACK= skips it
    done ;;
  draw)  # the draw's forms (session of 2026-12-07 (2)): draw_speed.py (each form's time, tokens against the path
         # before), draw_kernel_checks.py on CUDA (every form against sampler.draw, the k-th value against
         # torch.topk), then the GPU draw test (TESTS)
    PYTHONPATH=.:$PYTHONPATH timeout ${T:-150} python3 benchmarks/draw_speed.py --out "$OUT/draw_speed.json" 2>&1 \
      | grep -E '^\{|Error' | cut -c1-${SPEED_CHARS:-300}
    PYTHONPATH=.:tests:$PYTHONPATH timeout ${T_CHECK:-150} python3 tests/draw_kernel_checks.py cuda 2>&1 | tail -24
    PYTHONPATH=.:tests:$PYTHONPATH timeout ${T_TEST:-150} python3 -m pytest -v -p no:cacheprovider tests/test_gpu.py \
      -k "${TESTS:-draw}" 2>&1 | grep -E "^E |passed|failed|Error" | tail -8 ;;
  launch)  # session 55's call: the fused sum/add/norm's CUDA check, then offline.py at BATCHES (0.6B): .base/, this
           # tree, this tree with PDL; with the stack at STACK_BATCHES: this tree, with PDL (that call also ran the
           # radix draw, removed since). Each run prints its codes' digest: PDL must not change it. Then (GPU_TEST=1)
           # the PDL engine test.
    PYTHONPATH=.:tests:$PYTHONPATH timeout ${T_CHECK:-60} python3 tests/small_matmul_checks.py cuda 2>&1 \
      | grep -E "add norm|ALL OK|FAIL" | tail -6
    # (PDL was opt-in when session 55 ran this part; --no-pdl now gives the runs without it)
    offline .base base 0.6B "${BATCHES:-1,64}"
    offline . new 0.6B "${BATCHES:-1,64}" --no-pdl
    offline . pdl 0.6B "${BATCHES:-1,64}" --pdl
    offline . stack 0.6B "${STACK_BATCHES:-1}" "--stack --no-pdl"
    offline . stack-pdl 0.6B "${STACK_BATCHES:-1}" "--stack --pdl"
    [ -n "${GPU_TEST:-}" ] && PYTHONPATH=.:tests:$PYTHONPATH timeout ${T_TEST:-200} python3 -m pytest -v -p no:cacheprovider \
      tests/test_gpu.py -k dependent 2>&1 | grep -E "^E |passed|failed|Error" | tail -8 ;;
  pdl)  # PDL against none in the same call: offline.py at BATCHES without (--no-pdl) and with it (the default since
         # 2026-12-07; session 55's call 2 ran this part at 8f96282, where --pdl turned it on), then with the stack at
         # STACK_BATCHES (0.6B); the digests must match pairwise
    offline . new 0.6B "${BATCHES:-1,64}" --no-pdl
    offline . pdl 0.6B "${BATCHES:-1,64}" --pdl
    offline . stack 0.6B "${STACK_BATCHES:-1}" "--stack --no-pdl"
    offline . stack-pdl 0.6B "${STACK_BATCHES:-1}" "--stack --pdl" ;;
  ncu)  # --clock-control none: METHOD.md says to leave the clocks alone
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    PYTHONPATH=.:$PYTHONPATH timeout ${T:-240} "$NCU" --clock-control none --kernel-name regex:_stack_kernel \
      --launch-skip 4 --launch-count 1 --section WarpStateStats --section SourceCounters --section SpeedOfLight \
      --section LaunchStats --import-source yes -f -o "$OUT/stack" python3 benchmarks/stack_phases.py --ncu 8 2>&1 \
      | grep -v "^==PROF==" | tail -5
    "$NCU" -i "$OUT/stack.ncu-rep" --page source --csv --print-source sass > "$OUT/stack-sass.csv" 2> /tmp/ncu-err.txt \
      || { cat /tmp/ncu-err.txt; "$NCU" -i "$OUT/stack.ncu-rep" --page source --csv > "$OUT/stack-sass.csv"; }
    "$NCU" -i "$OUT/stack.ncu-rep" --page details --csv > "$OUT/stack-details.csv"
    grep -i -E "duration|stall|warp cycles" "$OUT/stack-details.csv" | cut -c1-200 | head -40
    python3 benchmarks/stall_ledger.py "$OUT/stack-sass.csv" --top ${TOP:-45} | tee "$OUT/stack-stalls.txt" ;;
  profile)  # PB: the batch profiled; PMODES=graphs,eager adds the graph replay's (--profile-graphs), PFLAGS more
            # offline.py flags (--stack)
    PYTHONPATH=.:$PYTHONPATH timeout ${T:-200} python3 benchmarks/offline.py --size ${PSIZE:-0.6B} \
      --modes ${PMODES:-eager} --batch-sizes ${PB:-64} --eager-batch-sizes ${PB:-64} --frames 16 --codec-batches none \
      --profile-batch ${PB:-64} --profile-graphs --profile-out "$OUT/profile-b${PB:-64}.txt" ${PFLAGS:-} 2>&1 \
      | grep -v "^-\|^ " | tail -${LINES_OUT:-32} ;;
esac
