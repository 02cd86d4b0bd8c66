#!/usr/bin/env bash
# GPU kernel benchmark (one NVIDIA/AMD GPU; the whole script, install included, < 8 minutes):
#   graft's kernels vs the library baselines they replace (cuBLAS matmul, _int_mm, _scaled_mm,
#   SDPA flash/cuDNN, vLLM-style gather + prefill for paged prefill with cached context,
#   loop-over-experts and dense MoE, F.rms_norm), on Llama-3 / Mixtral /
#   DeepSeek-V3 shapes, timed under CUDA graphs with value checks off, ratios measured in the
#   same run, each case beside its roofline on the target (H200, MI300X). Writes
#   benchmarks/kernels-<gpu>.json and .html after every case (see graft/kernels/bench.py).
# Offline: uses the torch and Triton already installed. graft must be importable from outside
# this tree with its entry points (without them the registry has no implementations and every
# case fails); when it is not, graft is installed without dependencies or network
# (pip install --no-deps --no-build-isolation --no-index -e .), and where pip cannot (no
# setuptools on the image) its entry points are registered from pyproject.toml in build/.
# Environment: PYTHON (interpreter), BENCH_TOTAL_S (seconds for the whole script, default 470),
#   BENCH_BUDGET_S (seconds of cases, default: what the total leaves minus 30 s),
#   BENCH_OUT (default benchmarks), BENCH_ARGS (extra arguments, e.g. "--families gemm,moe"),
#   BENCH_DEVICE (default cuda; cpu runs the same script on the CPU: with BENCH_ARGS=--quick it
#   checks the install guard, case selection and reports, as tests/test_gpu_bench_script.py does).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd -P)
START=$SECONDS
TOTAL_S=${BENCH_TOTAL_S:-470}
DEVICE=${BENCH_DEVICE:-cuda}

if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
case "$PY" in /*) ;; */*) PY="$ROOT/$PY" ;; esac  # the checks below run from another directory

# Run from / so that the source tree on the working directory cannot stand in for an install:
# graft must import from this tree and list its kernel adapters as entry points.
graft_ready() {
    (cd / && "$PY" - "$ROOT" <<'PYEOF'
import os, sys
from importlib.metadata import entry_points
root = sys.argv[1]
try:
    import graft
except ImportError as exc:
    sys.exit(f"graft is not importable outside the source tree ({exc})")
where = os.path.realpath(os.path.dirname(graft.__file__))
if where != os.path.join(root, "graft"):
    sys.exit(f"graft imports from {where}, not from this tree ({root})")
names = {ep.name for ep in entry_points(group="graft.adapters")}
missing = sorted({"torch", "triton", "hip"} - names)
if missing:
    sys.exit(f"graft's entry points are missing: {missing} (graft.adapters lists {sorted(names)})")
PYEOF
    )
}

# pip could not install (no setuptools or wheel offline): a dist-info beside the tree carries
# pyproject.toml's entry points, and PYTHONPATH puts both on the path.
register_by_hand() {
    local site="$ROOT/build/gpu-bench-site"
    rm -rf "$site" && mkdir -p "$site"
    "$PY" - "$ROOT/pyproject.toml" "$site" <<'PYEOF'
import os, re, sys
text = open(sys.argv[1]).read()
try:
    import tomllib
    project = tomllib.loads(text)["project"]
    name, version, groups = project["name"], project["version"], project.get("entry-points", {})
except ImportError:  # Python 3.10: the few lines this needs
    name = re.search(r'^name = "([^"]+)"', text, re.M).group(1)
    version = re.search(r'^version = "([^"]+)"', text, re.M).group(1)
    groups = {}
    for group, body in re.findall(r'^\[project\.entry-points\."?([^"\]]+)"?\]\n((?:[^\[].*\n?)*)', text, re.M):
        groups[group] = dict(re.findall(r'^([\w.-]+) = "([^"]+)"', body, re.M))
info = os.path.join(sys.argv[2], f"{name}-{version}.dist-info")
os.makedirs(info)
with open(os.path.join(info, "METADATA"), "w") as f:
    f.write(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
with open(os.path.join(info, "entry_points.txt"), "w") as f:
    for group, entries in groups.items():
        f.write(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()) + "\n")
PYEOF
    export PYTHONPATH="$ROOT:$site${PYTHONPATH:+:$PYTHONPATH}"
}

if ! reason=$(graft_ready 2>&1); then
    echo "== installing graft ($reason); no dependencies, no network: the machine's torch and Triton stay"
    if ! "$PY" -m pip install --quiet --no-deps --no-build-isolation --no-index -e .; then
        echo "== pip could not install graft here: registering its entry points from pyproject.toml instead"
        register_by_hand
    fi
    if ! reason=$(graft_ready 2>&1); then
        echo "ci/gpu_bench.sh: FAILED: graft is still not usable after installing it: $reason" >&2
        exit 1
    fi
fi

if [ "$DEVICE" = cuda ]; then
    "$PY" - <<'PYEOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"ci/gpu_bench.sh: FAILED: torch {torch.__version__} sees no GPU")
import triton
print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}, "
      f"{'ROCm ' + torch.version.hip if torch.version.hip else 'CUDA ' + str(torch.version.cuda)}")
PYEOF
else
    echo "== BENCH_DEVICE=$DEVICE: the script's logic without a GPU (timings mean nothing)"
fi

# Compiled Triton on the GPU; on the CPU only the interpreter runs it.
if [ "$DEVICE" = cpu ]; then export TRITON_INTERPRET=1; else export TRITON_INTERPRET=0; fi
export GRAFT_CHECK_VALUES=0

# What the total leaves: the outer timeout (a hang guard; SIGTERM makes the benchmark write its
# report, marking the case it was in as killed; SIGKILL 10 s later) and, inside it, the case
# budget (a case starts only when its family's longest case so far still fits). A benchmark
# process that lost its device (a sticky CUDA error, a hung case) exits 75 after writing its
# report; it is started again with --resume while time is left, keeping what finished.
RESUME=""
bench=""
CASES_START=$SECONDS
trap '[ -n "$bench" ] && kill -TERM "$bench" 2>/dev/null || true' TERM INT
while :; do
    LIMIT=$((TOTAL_S - (SECONDS - START) - 10))
    if [ -n "${BENCH_BUDGET_S:-}" ]; then BUDGET=$((BENCH_BUDGET_S - (SECONDS - CASES_START)))
    else BUDGET=$((LIMIT - 30))
    fi
    if [ "$LIMIT" -le 30 ] || { [ -n "$RESUME" ] && [ "$BUDGET" -le 0 ]; }; then
        if [ -n "$RESUME" ]; then
            echo "ci/gpu_bench.sh: no time left to resume (${LIMIT}s); the report holds every finished case" >&2
            exit 75
        fi
        echo "ci/gpu_bench.sh: FAILED: BENCH_TOTAL_S=$TOTAL_S leaves ${LIMIT}s for the cases after the install" >&2
        exit 1
    fi
    echo "== benchmark${RESUME:+ (resumed)}: ${BUDGET}s of cases, stopped at ${LIMIT}s (script total ${TOTAL_S}s)"
    # In the background with the signal forwarded: timeout(1) runs the benchmark in its own process
    # group, so a SIGTERM to this script's group (a cancelled CI job) would otherwise miss it.
    # shellcheck disable=SC2086
    timeout -k 10 "$LIMIT" "$PY" -m graft.tools.bench.kernels --device "$DEVICE" --budget-s "$BUDGET" \
        --out "${BENCH_OUT:-benchmarks}" $RESUME ${BENCH_ARGS:-} &
    bench=$!
    while :; do
        status=0
        wait "$bench" || status=$?
        kill -0 "$bench" 2>/dev/null || break  # ended (else: a forwarded signal interrupted the wait)
    done
    if [ "$status" -eq 75 ]; then
        echo "== the benchmark process lost its device (see the case above); resuming in a new process"
        RESUME=--resume
        continue
    fi
    break
done
if [ "$status" -eq 124 ] || [ "$status" -eq 143 ]; then
    echo "ci/gpu_bench.sh: stopped after ${LIMIT}s; the report in ${BENCH_OUT:-benchmarks} holds every finished case" >&2
fi
exit "$status"
