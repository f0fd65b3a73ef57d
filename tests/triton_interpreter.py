"""Running Triton kernels on the CPU for their tests: Triton's interpreter (`TRITON_INTERPRET=1`), chosen when a
kernel is defined, so a check script runs in a subprocess of its own (`run_checks_script`), and imports this
module first (`patch_for_numpy`); `rel_err` and `report` are the scripts' common measure and verdict."""

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


def rel_err(a, b) -> float:
    """Relative L2 error of tensor `a` against `b` in float64 (inf when `a` has a non-finite value)."""
    a, b = a.double().cpu(), b.double().cpu()
    if not a.isfinite().all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()


def report(results: dict[str, tuple[float, float]]) -> int:
    """Prints each check's (error, tolerance) as ok or FAIL, then ALL OK or the count failed; the exit status."""
    bad = 0
    for name, (err, tol) in results.items():
        ok = err <= tol
        bad += not ok
        print(f"{name}: {err:.2e} {'ok' if ok else 'FAIL'}")
    print("ALL OK" if not bad else f"{bad} FAILED")
    return 1 if bad else 0


def check_script_main(run_checks, cuda_checks=None) -> int:
    """A check script's `python <script> [cuda|cpu]`: `run_checks(device, dtype)` in bf16 and fp16 (plus
    `cuda_checks(dtype)`, if given) on CUDA with tolerance 1e-2, in fp32 on the CPU under the interpreter with 1e-5;
    the exit status is `report`'s."""
    import sys

    import torch

    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    results = {}
    for dtype in ((torch.bfloat16, torch.float16) if device == "cuda" else (torch.float32,)):
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        errors = run_checks(device, dtype)
        if device == "cuda" and cuda_checks is not None:
            errors.update(cuda_checks(dtype))
        results.update({f"{str(dtype)[6:]} {name}": (err, tol) for name, err in errors.items()})
    return report(results)


def run_checks_script(name: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """`python tests/<name> cpu` under the interpreter, with the repository and tests/ importable."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(HERE / name), "cpu"], env=env, capture_output=True, text=True,
                          timeout=timeout_s)


def skip_unless_ptxas() -> None:
    """Skips the calling test unless Triton and its bundled ptxas are installed (GPU-compiler checks)."""
    import pytest

    pytest.importorskip("triton", reason="Triton is not installed (the test extra installs it)")
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton build has no ptxas to compile for a GPU")


def compile_for_hopper(kernel, constexprs: dict, types: dict[str, str]) -> int:
    """Compiles a Triton kernel to an sm_90 cubin on this machine (no GPU needed: Triton's own ptxas) and returns
    the cubin's size. Pointer arguments are bf16 and scalars int32 unless `types` names them. The interpreter
    runs a kernel's semantics, not the GPU compiler: this catches a construct the GPU backend refuses."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for param in kernel.params:
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
        else:
            signature[name] = types.get(name, "*bf16" if name.endswith("_ptr") else "i32")
    compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32))
    return len(compiled.asm["cubin"])
