#!/usr/bin/env bash
# The codec issue's device calls (docs/benchmarks.md, "The codec at GEMM speed"), one part per call:
#   benchmarks/h200_codec.sh check   # import check, the codec's GPU tests, codec_step.py (old vs new, fidelity)
#   benchmarks/h200_codec.sh final   # the codec's GPU tests, codec_step.py of .base/ (BASE names it) and of this tree
#   benchmarks/h200_codec.sh tune    # the codec's GPU tests, then codec_tune.py (tile sizes per conv)
#   benchmarks/h200_codec.sh loop    # engine_loop.py at c=64 and c=256, 8c76ab2 (.base/) vs this tree
#   benchmarks/h200_codec.sh unit    # unit_tune.py: one-kernel residual units and split-K against their plain paths
#   benchmarks/h200_codec.sh knobs   # codec_step.py: the tree's step with each codec_stages knob off in turn (rounds),
#                                    # then the fidelity report of the tree's defaults
#   benchmarks/h200_codec.sh tests   # the codec's and the few-row GEMM's GPU tests
#   benchmarks/h200_codec.sh narrow  # the few-row GEMM's checks and codec shapes, then codec_tune.py on the convs of
#                                    # few rows (narrow tiles, K split) and the whole step under each knob
#   benchmarks/h200_codec.sh serve   # serving_speed.py at c=1/8/64 and 256, both modes, 8c76ab2 vs this tree
# Needs: the server's wheels in .whl/ (see docs/benchmarks.md), the tree of 8c76ab2 in .base/ for `loop`,
# prompts in .bench-data/prompts for `serve`, OUT a results folder. Random weights throughout; lengths fixed (EOS ignored).
set -uo pipefail
PART=${1:-check}
. "$(dirname "$0")/h200_env.sh"
case "$PART" in
  check)
    PYTHONPATH=.:tests:$PYTHONPATH timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
      -k "${TESTS:-codec or snake}" 2>&1 | grep -E "^E |passed|failed|Error" | tail -30
    PYTHONPATH=.:$PYTHONPATH timeout 330 python3 benchmarks/codec_step.py --variants "${VARIANTS:-old,plain,new,fused}" \
      --out "$OUT/codec_step.json" \
      2>&1 | grep -v '^{' ;;
  final)  # GPU tests, then the codec step of .base/'s tree beside this tree's (and this tree's fidelity report)
    PYTHONPATH=.:tests:$PYTHONPATH timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
      -k "${TESTS:-codec or snake}" 2>&1 | grep -E "^E |passed|failed|Error" | tail -30
    (cd .base && PYTHONPATH=.:$PYTHONPATH LEGATO_COMMIT=${BASE:-base} timeout 200 python3 benchmarks/codec_step.py \
      --variants new --dtypes bfloat16 --no-fidelity --out "$OUT/codec_step-base.json") 2>&1 | grep -v '^{'
    PYTHONPATH=.:$PYTHONPATH timeout 330 python3 benchmarks/codec_step.py --variants ${VARIANTS:-old,new} \
      --dtypes ${DTYPES:-float32,bfloat16} --out "$OUT/codec_step-new.json" 2>&1 | grep -v '^{' ;;
  tune)
    PYTHONPATH=.:tests:$PYTHONPATH timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
      -k "streaming_codec" 2>&1 | grep -E "^E |passed|failed|Error" | tail -30
    PYTHONPATH=.:$PYTHONPATH timeout ${TUNE_TIMEOUT:-400} python3 benchmarks/codec_tune.py --cells "${CELLS:-64x1,256x4}" \
      --out "$OUT/codec_tune.json" 2>&1 ;;
  loop)
    for c in 64 256; do
      (cd .base && PYTHONPATH=.:$PYTHONPATH LEGATO_COMMIT=8c76ab2 timeout 150 python3 benchmarks/engine_loop.py \
        --concurrency $c --max-num-seqs $c --requests $((4 * c)) --variants default --out "$OUT/loop-base-c$c.json") \
        2>&1 | grep '^{' | cut -c1-400
      PYTHONPATH=.:$PYTHONPATH timeout 200 python3 benchmarks/engine_loop.py --concurrency $c --max-num-seqs $c \
        --requests $((4 * c)) --variants ${VARIANTS:-default,no-audio} --out "$OUT/loop-new-c$c.json" \
        2>&1 | grep '^{' | cut -c1-400
    done ;;
  knobs)
    PYTHONPATH=.:$PYTHONPATH timeout ${T_STEP:-300} python3 benchmarks/codec_step.py --dtypes bfloat16 --no-fidelity \
      --variants "${VARIANTS:-new,new-group-tr-dead,new-tr,new-group,new-dead}" --cells "${CELLS:-64x1,64x4,256x4}" \
      --rounds ${ROUNDS:-3} --out "$OUT/codec_step-knobs.json" 2>&1 | cut -c1-240  # rows as they come: a cut call keeps them
    PYTHONPATH=.:$PYTHONPATH timeout ${T_FID:-150} python3 benchmarks/codec_step.py --no-speed --dtypes float32,bfloat16 \
      --variants new --out "$OUT/codec_fidelity.json" 2>&1 | cut -c1-260 ;;
  tests)
    PYTHONPATH=.:tests:$PYTHONPATH timeout ${T_TESTS:-400} python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
      -k "${TESTS:-codec or snake or small_matmul}" 2>&1 | grep -E "^E |passed|failed|Error" | tail -30 ;;
  narrow)
    PYTHONPATH=.:tests:$PYTHONPATH timeout 150 python3 tests/small_matmul_checks.py cuda 2>&1 | grep -v ' ok$' | tail -8
    PYTHONPATH=.:$PYTHONPATH timeout 150 python3 benchmarks/matmul_tune.py --sizes codec --rows 64,256 \
      --block-n 16,32,64 --block-k 64,128 --splits 1,2,4 --out "$OUT/mm-codec.json" 2>&1 | grep '^\[tune\]'
    PYTHONPATH=.:$PYTHONPATH timeout ${TUNE_TIMEOUT:-420} python3 benchmarks/codec_tune.py --cells "${CELLS:-64x1,256x4}" \
      --max-rows 256 --step-only "${STEP_ONLY:-256x4}" --out "$OUT/codec_tune.json" 2>&1 ;;
  unit)
    PYTHONPATH=.:$PYTHONPATH timeout 200 python3 benchmarks/unit_tune.py --out "$OUT/unit_tune.json" 2>&1 \
      | cut -c1-600 ;;
  serve)
    CKPT=/tmp/qwen3tts-0.6b-random
    [ -f $CKPT/model.safetensors ] || PYTHONPATH=.:$PYTHONPATH python3 -c "import torch; \
from legato.models.qwen3_tts.config import preset; from legato.models.qwen3_tts.testing import write_checkpoint; \
write_checkpoint('$CKPT', preset('0.6B', 'base'), dtype=torch.bfloat16)"
    for run in "1,8,64 64" "256 256"; do
      set -- $run
      PYTHONPATH=.:$PYTHONPATH timeout 290 python3 benchmarks/serving_speed.py --ckpt $CKPT --data .bench-data/prompts \
        --variant new=.:legato --variant old=.base:legato --out /tmp/serve-c$2 --concurrency $1 \
        --modes ${MODES:-xvec,clone} --max-num-seqs $2 --startup-timeout 120 --cell-timeout 120 2>&1 | tail -12
      cp /tmp/serve-c$2/summary.json "$OUT/serve-c$2.json"
    done ;;
esac
