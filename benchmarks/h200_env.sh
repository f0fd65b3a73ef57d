# Sourced by the h200_*.sh scripts: OUT made, the wheels in .whl/ installed (the device image lacks the server's
# packages), the commit named for the JSON, and an import check that fails in seconds rather than mid-run.
# .whl/ (git-ignored locally via .git/info/exclude; pass it in the device call's carry) is made on the CPU box with
#   pip download -d .whl --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 \
#     --platform manylinux_2_28_x86_64 --platform any fastapi uvicorn websockets pydantic prometheus-client \
#     python-multipart httpx pyzmq pyyaml soundfile safetensors tokenizers opentelemetry-api annotated-doc py-spy \
#     httptools
# then the packages the image already has beside torch removed (numpy, filelock, fsspec, typing_extensions).
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
# Only 8 files (2 folders deep) come back from a device call: a session of 2026-12-06 lost half its JSON and
# probably the py-spy profiles of the session before to that. On exit, when $OUT holds more than 7 files, all but
# run.log and earlier packs go into one results-*.tgz (each pack under 16 MiB comes back).
pack_out() {
  local files
  files=$(find "$OUT" -type f ! -name run.log ! -name 'results-*.tgz' | sed "s|^$OUT/||")
  [ "$(find "$OUT" -type f | wc -l)" -gt 7 ] && [ -n "$files" ] || return 0
  local pack="results-$(date +%H%M%S)-$$.tgz"
  (cd "$OUT" && echo "$files" | tar -czf "$pack" -T - && echo "$files" | xargs rm -f) \
    && echo "packed $(echo "$files" | wc -l) result files into \$OUT/$pack"
}
trap pack_out EXIT
# Everything the script prints also goes to $OUT/run.log, which comes back even when the call's time limit kills
# it (a `| tail` on the command line then prints nothing: the session of 2026-12-04 lost a call's output so).
exec > >(tee -a "$OUT/run.log") 2>&1
if [ -d .whl ]; then  # once per machine: later parts of the same call find them installed
  if [ ! -f /tmp/site/.installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl && touch /tmp/site/.installed || exit 1
  fi
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-} PATH=/tmp/site/bin:$PATH  # the wheels' scripts (py-spy)
fi
# Name the tree in LEGATO_COMMIT on the device: git there reported a42d6bf for later trees (docs/benchmarks.md).
export PYTHONUNBUFFERED=1 LEGATO_COMMIT=${LEGATO_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}
python3 -c "import torch, triton, fastapi, zmq, soundfile, httptools; print('torch', torch.__version__, 'triton', \
triton.__version__, torch.cuda.get_device_name())" || exit 1
# The host beside the GPU: served figures depend on it (an H100 host served c=256 at half an H200 host's rate while
# the engine alone matched, docs/benchmarks.md, session of 2026-12-05 (6)).
echo "host: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), load $(cut -d' ' -f1-3 /proc/loadavg)"
# The random 0.6B Base checkpoint the serving scripts run (written once per machine): `random_checkpoint; ... $CKPT`.
random_checkpoint() {
  CKPT=/tmp/qwen3tts-0.6b-random
  [ -f $CKPT/model.safetensors ] || PYTHONPATH=.:${PYTHONPATH:-} python3 -c "import torch; \
from legato.models.qwen3_tts.config import preset; from legato.models.qwen3_tts.testing import write_checkpoint; \
write_checkpoint('$CKPT', preset('0.6B', 'base'), dtype=torch.bfloat16)"
}
# Waits (up to $1 s, default 90) until no process holds GPU memory: the last server's workers may still be freeing
# theirs after it exited, and the next server's KV budget is taken from what is free (a session of 2026-12-06 saw
# 1p1d refuse to start 12 s after split's server had exited, its budget -0.15 GiB).
wait_gpu_free() {
  local deadline=$((SECONDS + ${1:-90})) used
  while :; do
    used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | sort -n | tail -1)
    [ -z "$used" ] || [ "$used" -lt 2048 ] && return 0
    [ $SECONDS -ge $deadline ] && { echo "GPU memory still in use after ${1:-90} s: ${used} MiB"; return 1; }
    sleep 1
  done
}
