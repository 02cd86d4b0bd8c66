#!/usr/bin/env bash
# HIP/CUDA kernel build check (run by hand or by a GPU CI job on a machine with one
# NVIDIA or AMD GPU, a CUDA or ROCm build of torch, and nvcc resp. hipcc):
#   1. builds graft's C++ kernels (graft.kernels.hip) with the real torch through
#      torch.utils.cpp_extension: nvcc on NVIDIA, hipify + hipcc on ROCm; fresh cache dir;
#   2. checks that backend selection now picks the hip implementations on this GPU;
#   3. runs tests/test_hip_kernels.py with GRAFT_TEST_DEVICE=cuda: every hip impl against
#      the torch reference over the ops' quick cases, plus layout tests (strided rows,
#      fp32 weights, vLLM v1 KV-cache views), and the hipify/nvcc/fake-impl tests;
#   4. runs tests/test_fused.py on the GPU (Triton compiled, not interpreted).
# Installs nothing: uses $PYTHON, else .venv/bin/python (ci/setup.sh), else python3.
# Sized for < 10 minutes on one H200 (the build dominates: ~2-5 min); each step has its own limit.
# Fails loudly without a GPU or a compiler: this check exists to prove the build works.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi

# A fresh cache dir unless the caller chose one, so this really compiles.
if [ -z "${GRAFT_CACHE_DIR:-}" ]; then
    GRAFT_CACHE_DIR="$(mktemp -d -t graft-hip-build-XXXXXX)"
fi
export GRAFT_CACHE_DIR GRAFT_BUILD_VERBOSE="${GRAFT_BUILD_VERBOSE:-1}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"  # ninja parallelism in torch.utils.cpp_extension

echo "== environment"
if ! "$PY" - <<'PYEOF'
import sys, torch
from graft.kernels.hip import _build
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no GPU (cuda available: False)")
toolkit = "ROCm " + torch.version.hip if torch.version.hip else "CUDA " + str(torch.version.cuda)
print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {toolkit}")
reason = _build.unavailable_reason()
if reason:
    sys.exit(f"the hip kernels cannot be built here: {reason}")
PYEOF
then
    echo "ci/gpu_build_check.sh: FAILED: needs a GPU, a CUDA/ROCm torch and nvcc/hipcc (see above)" >&2
    exit 1
fi

echo "== build graft.kernels.hip in $GRAFT_CACHE_DIR"
timeout 900 "$PY" - <<'PYEOF'
import time
from graft.kernels.hip import _build
start = time.perf_counter()
module = _build.load_extension()
print(f"built {module.__name__} in {time.perf_counter() - start:.0f} s: {sorted(n for n in dir(module) if not n.startswith('_'))}")
PYEOF

echo "== selection on this GPU picks hip"
timeout 120 "$PY" - <<'PYEOF'
import sys
import torch
import graft
from graft.selection import decide
from graft.platform import device_info

info = device_info("cuda")
registry = graft.get_registry()
bad = []
for op in ("fused.rms_norm", "fused.silu_and_mul", "attention.decode_paged", "gemm.w4a16", "moe.topk_routing"):
    decision = decide(registry, op, "cuda", torch.float16, info.arch)
    hip = [c for c in decision.candidates if c.impl.backend == "hip"]
    status = "usable" if hip and hip[0].reason is None else f"NOT usable: {hip[0].reason if hip else 'not registered'}"
    print(f"  {op:<24} selected={decision.selected.backend:<7} hip {status}")
    if decision.selected.backend != "hip":
        bad.append(op)
if bad:
    sys.exit(f"hip not selected for: {', '.join(bad)}")
PYEOF

export GRAFT_TEST_DEVICE=cuda TRITON_INTERPRET=0
echo "== hip kernel tests on the GPU"
timeout 600 "$PY" -m pytest -q --timeout 300 -p no:cacheprovider tests/test_hip_kernels.py

echo "== fused Triton kernels on the GPU"
timeout 300 "$PY" -m pytest -q -x --timeout 240 -p no:cacheprovider tests/test_fused.py

echo "ci/gpu_build_check.sh: OK"
