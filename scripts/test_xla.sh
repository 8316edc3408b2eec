#!/usr/bin/env bash
# Run nbaccel's XLA tests (tests/test_xla.py, tests/test_xla_plan.py) on torch_xla's CPU PJRT runtime.
#
# NOT part of the default CI: torch_xla 2.9 needs torch 2.9.x, whose wheels from the package
# index pull ~4 GB of CUDA dependency wheels, and the main .venv runs torch 2.13 (CPU build).
# In the main environment tests/test_xla.py is skipped with its reason (no torch_xla).
#
# Builds .venv-xla (git-ignored) as a separate virtual environment: torch 2.9 + torch_xla 2.9.0
# from PyPI, nbaccel from this working tree (editable, no deps) and the runtime/test dependencies
# it needs. The first run installs (a few minutes, ~5 GB on disk); later runs reuse it.
# The tests run with PJRT_DEVICE=CPU: one CPU device, and 2 CPU devices (CPU_NUM_DEVICES=2).
# Real TPUs are not tested here.
#
#   scripts/test_xla.sh            # build if needed, then run the XLA tests
#   scripts/test_xla.sh -k single  # extra pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-xla
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import torch_xla" 2>/dev/null; then
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # torch_xla 2.9.0 is built against torch 2.9.x exactly.
    "$VENV/bin/python" -m pip install -q "torch==2.9.*" "torch_xla==2.9.0"
    # nbaccel's runtime dependencies (ranges that fit torch 2.9) and what the tests use; the
    # jupyter/ipywidgets ones let the tests drive a real kernel.
    "$VENV/bin/python" -m pip install -q "cloudpickle>=3.0" "ipywidgets>=7.7,<9" "ipykernel>=6.20" \
        "nbformat>=5.7" "PyYAML>=6.0" "psutil>=5.9" "numpy>=1.24" "safetensors>=0.4" \
        "pytest>=8" "pytest-timeout>=2.3" "jupyter_client>=8" "tqdm>=4.66"
    "$VENV/bin/python" -m pip install -q --no-deps -e .
fi
"$VENV/bin/python" - <<'PY'
import sys, torch, torch_xla
assert torch.__version__.startswith("2.9"), torch.__version__
print(f"torch {torch.__version__}, torch_xla {torch_xla.__version__}", file=sys.stderr)
PY
export PJRT_DEVICE=CPU
exec "$VENV/bin/python" -m pytest -p no:cacheprovider -o addopts="-ra" -W "ignore::DeprecationWarning" \
    tests/test_xla.py tests/test_xla_plan.py "$@"
