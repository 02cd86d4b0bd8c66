#!/usr/bin/env bash
# GPU kernel benchmark (one NVIDIA/AMD GPU; sized for < 8 minutes on one H200):
#   graft's kernels vs the library baselines they replace (cuBLAS matmul, _int_mm, _scaled_mm,
#   SDPA flash/cuDNN, vLLM-style gather + prefill for paged prefill with cached context,
#   loop-over-experts and dense MoE, F.rms_norm), on Llama-3 / Mixtral /
#   DeepSeek-V3 shapes, timed under CUDA graphs with value checks off, ratios measured in the
#   same run. Writes benchmarks/kernels-<gpu>.json and .html (see graft/kernels/bench.py).
# Uses the torch and Triton already installed; installs graft itself without dependencies:
#   pip install --no-deps --no-build-isolation -e .
# Environment: PYTHON (interpreter), BENCH_BUDGET_S (seconds of cases, default 400),
#   BENCH_OUT (default benchmarks), BENCH_ARGS (extra arguments, e.g. "--families gemm,moe").
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi

if ! "$PY" -c "import graft" 2>/dev/null; then
    echo "== installing graft (no dependencies: the machine's torch and Triton stay)"
    "$PY" -m pip install --quiet --no-deps --no-build-isolation -e .
fi

"$PY" - <<'PYEOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"ci/gpu_bench.sh: FAILED: torch {torch.__version__} sees no GPU")
import triton
print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}, "
      f"{'ROCm ' + torch.version.hip if torch.version.hip else 'CUDA ' + str(torch.version.cuda)}")
PYEOF

export TRITON_INTERPRET=0 GRAFT_CHECK_VALUES=0
# The budget stops new cases; the outer timeout only guards against a hang (a case already
# running finishes; reports are written after the last case).
# shellcheck disable=SC2086
timeout 470 "$PY" -m graft.kernels.bench --device cuda --budget-s "${BENCH_BUDGET_S:-400}" \
    --out "${BENCH_OUT:-benchmarks}" ${BENCH_ARGS:-}
