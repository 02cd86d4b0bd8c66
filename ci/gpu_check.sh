#!/usr/bin/env bash
# GPU check (run by hand or by a GPU CI job on a machine with one NVIDIA/AMD GPU):
#   1. the kernel numerics tests, on the GPU, with Triton compiled (not interpreted);
#   2. `graft conformance --device cuda --tags gpu`: every kernel on benchmark-sized shapes,
#      with its throughput ratio against the torch reference and the upstream baseline.
# Installs nothing: uses $PYTHON, else .venv/bin/python (ci/setup.sh), else python3.
# Sized for < 8 minutes on one H200; each step has its own time limit. Fails loudly without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
OUT="${GPU_REPORT_DIR:-gpu-conformance-report}"

if ! "$PY" - <<'PYEOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no GPU (cuda available: False)")
print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
      f"{'ROCm ' + torch.version.hip if torch.version.hip else 'CUDA ' + str(torch.version.cuda)}")
PYEOF
then
    echo "ci/gpu_check.sh: FAILED: no GPU visible to torch; this check must run on a GPU machine" >&2
    exit 1
fi

export GRAFT_TEST_DEVICE=cuda TRITON_INTERPRET=0
KERNEL_TESTS=$(ls tests/test_attention*.py tests/test_gemm*.py tests/test_moe*.py tests/test_fused*.py tests/test_optim_adam.py tests/test_compile.py tests/test_triton_aot.py 2>/dev/null || true)
echo "== kernel numerics on the GPU: $KERNEL_TESTS"
# shellcheck disable=SC2086
timeout 300 "$PY" -m pytest -q -x --timeout 240 -p no:cacheprovider $KERNEL_TESTS

echo "== conformance: gpu-sized cases, throughput vs baselines (absolute times are device-specific)"
status=0
timeout 240 "$PY" -m graft conformance --device cuda --tags gpu --repeats 10 --warmup 3 --out "$OUT" --quiet \
    || status=$?
if [ ! -f "$OUT/report.json" ]; then
    echo "ci/gpu_check.sh: FAILED: the conformance run wrote no report (exit status $status)" >&2
    exit 1
fi

"$PY" - "$OUT/report.json" <<'PYEOF'
import json, sys
data = json.load(open(sys.argv[1]))
print(f"\n{'op':<28} {'case':<36} {'dtype':<9} {'impl':<16} {'numerics':<8} ratios (baseline/impl median)")
for case in data["cases"]:
    for impl in case["impls"]:
        if impl["status"] == "skipped":
            continue
        ratios = ", ".join(f"{r:.2f}x vs {name}" for name, r in impl["speedups"].items()) or "-"
        print(f"{case['op']:<28} {case['case']:<36} {case['dtype']:<9} {impl['backend']:<16} {impl['status']:<8} {ratios}")
PYEOF
echo "report: $OUT/report.html"
exit $status
