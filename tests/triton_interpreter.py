"""Running Triton kernels on the CPU for their tests: Triton's interpreter (`TRITON_INTERPRET=1`), chosen when a
kernel is defined, so a check script runs in a subprocess of its own (`run_checks_script`), and imports this
module first (`patch_for_numpy`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def patch_for_numpy() -> None:
    """Triton 3.6's interpreter turns a scalar kernel argument used as a loop bound into an index with
    `int(array)`, which numpy >= 2.4 refuses for a one-element 1-D array: read its element instead."""
    import triton.runtime.interpreter as interp

    patch = interp._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = _patch_lang_tensor


def run_checks_script(name: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """`python tests/<name> cpu` under the interpreter, with the repository and tests/ importable."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(HERE / name), "cpu"], env=env, capture_output=True, text=True,
                          timeout=timeout_s)
