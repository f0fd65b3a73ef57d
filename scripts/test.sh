#!/usr/bin/env bash
# Installs legato with its test extra into the active Python environment and runs the test suite.
# Idempotent: a second run only runs the tests. Without a torch it installs torch==2.13.0; on Linux without a GPU,
# install PyTorch's CPU build of it first (README), since PyPI's Linux wheel is the multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[test]"
# The official implementation, used only as a parity oracle: its declared dependencies (gradio,
# torchaudio, sox, onnxruntime) are not needed for the 12 Hz path, and tests/oracle.py stubs the imports.
"$PY" -m pip install -q --no-deps "qwen-tts==0.1.1"
# The Mooncake transfer engine (a test dependency: the `mooncake` KV backend is tested over TCP) links
# libibverbs even in its CPU/TCP build; install the system library when it is missing.
if ! "$PY" -c "import mooncake.engine" 2>/dev/null && command -v apt-get >/dev/null; then
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get install -y -q libibverbs1 >/dev/null 2>&1 || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q libibverbs1 >/dev/null; }
fi
"$PY" -m ruff check legato tests
# CI runs the slow parity checks too (full-size configs, ~1 min more).
export LEGATO_SLOW_TESTS=${LEGATO_SLOW_TESTS:-1}
# The slowest tests print at the end, so a suite that grows toward the 45-minute budget shows where.
exec "$PY" -m pytest -q --durations=15 "$@"
