#!/usr/bin/env bash
# Set up a fresh machine for graft: a virtual environment in .venv with the CPU build of
# torch, graft itself (editable) and the frameworks it integrates with.
#   bash ci/setup.sh            # then: .venv/bin/graft info
# Safe to re-run; VENV=path overrides the location.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q -c ci/constraints.txt)
"$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel
# The CPU build first: nothing below may replace it (ci/constraints.txt pins the version).
# Where pip's default index serves the CUDA build for torch==2.13.0, point TORCH_INDEX_URL
# at a CPU wheel index; the check below stops the set-up if a CUDA build got in anyway.
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    "${PIP[@]}" --index-url "$TORCH_INDEX_URL" torch==2.13.0
else
    "${PIP[@]}" torch==2.13.0
fi
"$VENV/bin/python" -c 'import sys, torch; sys.exit(0 if torch.version.cuda is None else
    f"ci/setup.sh: got a CUDA build of torch ({torch.__version__}); set TORCH_INDEX_URL to a CPU wheel index")'
"${PIP[@]}" -e '.[test]'
# DeepSpeed: no op pre-building; on CPU it picks its CPU accelerator and gloo.
DS_BUILD_OPS=0 "${PIP[@]}" deepspeed==0.19.8
# megatron-core and vLLM pin other torch versions in their metadata; install them without
# dependencies, then vLLM's CPU-importable runtime requirements (pinned list).
"${PIP[@]}" --no-deps megatron-core==0.16.1 vllm==0.33.0
if [ -f ci/requirements-vllm.txt ]; then
    "${PIP[@]}" -r ci/requirements-vllm.txt
fi
# Triton 3.6, the version on the GPU machines, beside the venv's own (not in it):
# tests/test_triton36.py runs a kernel test per Triton kernel file under it (PYTHONPATH), so
# an API difference fails here and not on a GPU. About 640 MB unpacked, installed once. With
# numpy < 2.4: Triton 3.6's interpreter calls int() on 1-element arrays, an error since numpy 2.4.
if [ ! -f .venv-triton36/triton/__init__.py ]; then
    "$VENV/bin/python" -m pip install -q --no-deps --target .venv-triton36 triton==3.6.0 "numpy<2.4"
fi
"$VENV/bin/python" - <<'PY'
import torch
assert torch.__version__.startswith("2.13.0") and torch.version.cuda is None, (
    f"expected the CPU build of torch 2.13.0, got {torch.__version__} (cuda={torch.version.cuda})")
print(f"graft environment ready: torch {torch.__version__} (CPU build)")
PY
