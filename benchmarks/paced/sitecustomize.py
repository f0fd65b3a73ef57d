"""Imported by Python at start-up when this folder is on PYTHONPATH (paced_serve.py puts it there): a worker process
of a paced server builds the paced stand-in engine too. Does nothing unless LEGATO_PACED_STEP_MS is set."""

import os
import sys

if os.environ.get("LEGATO_PACED_STEP_MS"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import paced_serve

    paced_serve.install(float(os.environ["LEGATO_PACED_STEP_MS"]), bool(os.environ.get("LEGATO_PACED_PROMPTS")),
                        int(os.environ.get("LEGATO_PACED_HOST_OPS") or 0))
