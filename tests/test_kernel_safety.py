"""Kernels are bounds-safe on any values, whatever the value checks are set to.

Every case of tests/_safety_cases.py runs through the public ops with GRAFT_CHECK_VALUES=0
on each backend available on the CPU (the torch reference and Triton, interpreted), in a
subprocess: an out-of-bounds read or write crashes that process (rc -11 / 134) and fails
the test instead of killing pytest. With the checks on, the same values are a
GraftInputError naming the bad value and the valid range. The >2^31-element offset case,
impossible to run here, is checked on the compiled kernel: every ``index * stride``
product of the prefill kernel is 64-bit in its sm_90 TTIR.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from graft.errors import GraftInputError

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = pytest.mark.timeout(1200)  # the module fixture runs every case on two backends, interpreted
BACKENDS = ("torch", "triton")
CASES = (
    "align_invalid_ids",
    "fused_experts_invalid_ids",
    "routing_nan_scores",
    "fused_experts_fp16_overflow",
    "decode_bad_block_ids",
    "decode_bad_seq_lens",
    "rotary_bad_positions",
    "w4a16_inf_scale",
)


def _run(backend: str, cases) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAFT_")}
    env.update(GRAFT_CHECK_VALUES="0", GRAFT_STRICT="1", TRITON_INTERPRET="1", PYTHONFAULTHANDLER="1")
    return subprocess.run([sys.executable, "-W", "ignore", os.path.join(HERE, "_safety_cases.py"), backend, *cases],
                          env=env, capture_output=True, text=True, timeout=600)


def outcomes(proc: subprocess.CompletedProcess, cases) -> dict:
    """case -> "PASS", the failure text, or what a crash left (the process died in that case)."""
    found, current = {}, None
    for line in proc.stdout.splitlines():
        if line.startswith("START "):
            current = line[6:]
        elif line.startswith("PASS "):
            found[line[5:]], current = "PASS", None
        elif line.startswith("FAIL "):
            found[line[5:]] = proc.stdout.split(line, 1)[1].split(f"END {line[5:]}", 1)[0]
            current = None
    crash = f"the process died in this case (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    if current is not None:
        found[current] = crash
    return {case: found.get(case, f"not reached (exit {proc.returncode}): {proc.stderr[-2000:]}") for case in cases}


@pytest.fixture(scope="module")
def results():
    """One subprocess per backend runs every case (interpreter start-up dominates)."""
    return {backend: outcomes(_run(backend, CASES), CASES) for backend in BACKENDS}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_bad_values_with_checks_off(results, case, backend):
    assert results[backend][case] == "PASS", f"{case} on {backend}: {results[backend][case]}"


def test_a_crash_fails_the_case_it_happened_in(tmp_path):
    """A segfault in a case is reported against that case (the subprocess dies, pytest does not)."""
    script = tmp_path / "crash.py"
    script.write_text("import ctypes\nprint('START a\\nPASS a\\nSTART b', flush=True)\nctypes.string_at(0)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    found = outcomes(proc, ["a", "b", "c"])
    assert found["a"] == "PASS"
    assert found["b"].startswith("the process died in this case") and found["c"].startswith("not reached")


# ----------------------------------------------------------------------------- checks on


def _decode_args():
    q = torch.randn(2, 4, 64)
    k = torch.randn(6, 4, 2, 64)
    table = torch.zeros(2, 4, dtype=torch.int32)
    return q, k, k.clone(), table, torch.tensor([16, 5], dtype=torch.int32)


def test_checks_on_name_the_bad_value(fresh_graft):
    from graft.ops import attention, fused, moe

    q, k, v, table, lens = _decode_args()
    table[1, 1] = 6
    with pytest.raises(GraftInputError, match=r"block_tables .*\[0, num_blocks = 6\).* got 6"):
        attention.decode_paged(q, k, v, table, lens)
    table[1, 1], table[1, 3] = 0, -1  # past seq_len 5 (2 blocks): not used, accepted
    attention.decode_paged(q, k, v, table, lens)

    cache = fused.cos_sin_cache(32, 64)
    x = torch.randn(3, 64)
    for bad in (32, -1, 10**8):
        with pytest.raises(GraftInputError, match=rf"positions must lie in \[0, max_position = 32\).* got {bad}"):
            fused.rotary_embedding(torch.tensor([0, bad, 1]), x, x, 64, cache)

    with pytest.raises(GraftInputError, match=r"topk_ids must lie in \[0, 4\).* or be -1 .* got 4"):
        moe.align_block_size(torch.tensor([[0, 4]], dtype=torch.int32), 4, 4)
    moe.align_block_size(torch.tensor([[0, -1]], dtype=torch.int32), 4, 4)  # another rank's expert: valid


@pytest.mark.parametrize("call", [
    lambda: __import__("graft.ops.fused", fromlist=["x"]).rms_norm(torch.randn(2, 8), torch.ones(8), float("nan")),
    lambda: __import__("graft.ops.fused", fromlist=["x"]).adam_step(
        *(torch.zeros(4),) * 4, float("nan"), 0.9, 0.999, 1e-8, 1),
    lambda: __import__("graft.ops.fused", fromlist=["x"]).adam_step(
        *(torch.zeros(4),) * 4, 1e-3, float("nan"), 0.999, 1e-8, 1),
], ids=["rms_norm-eps", "adam-lr", "adam-beta1"])
def test_nan_hyperparameters_rejected(fresh_graft, call):
    with pytest.raises(GraftInputError, match="nan"):
        call()


# ----------------------------------------------------------------------------- 64-bit offsets

_STRIDE_ARG = re.compile(r"%(stride_\w+)\b")


def _narrow_stride_products(ttir: str) -> list[str]:
    """``arith.muli`` lines of a TTIR function that multiply by a value derived from a
    ``stride_*`` argument (through splat/broadcast/expand_dims/extsi/casts) in 32 bits."""
    derived = set(_STRIDE_ARG.findall(ttir.split("{", 1)[0]))  # the function's stride arguments
    narrow = []
    for line in ttir.splitlines():
        m = re.match(r"\s*%([\w.#]+) = (\S+) (.*)", line)
        if not m:
            continue
        result, op, rest = m.groups()
        operands = set(re.findall(r"%([\w.#]+)", rest.split(" loc(")[0]))
        if op in ("tt.splat", "tt.broadcast", "tt.expand_dims", "arith.extsi", "tt.int_to_ptr") and operands & derived:
            derived.add(result)
        elif op == "arith.muli" and operands & derived:
            derived.add(result)
            if re.search(r":\s*(tensor<[^>]*x)?i32>?\s*(loc|$)", rest):
                narrow.append(line.strip())
    return narrow


def test_narrow_product_detector_flags_32_bit_stride_products():
    ttir = ("tt.func public @k(%x: !tt.ptr<f16>, %stride_t: i32, %stride_h: i32) {\n"
            "  %a = arith.muli %head, %stride_h : i32 loc(#loc1)\n"
            "  %b = arith.extsi %stride_t : i32 to i64 loc(#loc2)\n"
            "  %c = tt.splat %b : i64 -> tensor<64x1xi64> loc(#loc3)\n"
            "  %d = arith.muli %rows, %c : tensor<64x1xi64> loc(#loc4)\n"
            "  %e = tt.splat %stride_t : i32 -> tensor<1x64xi32> loc(#loc5)\n"
            "  %f = arith.muli %cols, %e : tensor<1x64xi32> loc(#loc6)\n")
    assert _narrow_stride_products(ttir) == [
        "%a = arith.muli %head, %stride_h : i32 loc(#loc1)",
        "%f = arith.muli %cols, %e : tensor<1x64xi32> loc(#loc6)",
    ]


@pytest.mark.parametrize("module", ["attention_prefill", "attention_prefill_paged"])
def test_prefill_offsets_are_64_bit_on_sm90(tmp_path, module):
    """q/k/v/out offsets (``token * stride``, ``head * stride``) pass 2^31 elements at about
    350k tokens of a fused-QKV view, and a paged cache's ``block * stride`` on caches of a few
    GB: the kernels must compute them in int64. Compiled for sm_90 with the JIT's
    specialisation (a subprocess: the interpreter is on in this one)."""
    code = (
        f"from graft.kernels.triton import _aot, {module} as ap\n"
        "for v in ap.aot_variants()[:1]:\n"
        "    for aligned in (True, False):\n"
        "        print(_aot.compile_variant(v, 'sm_90', aligned).asm['ttir'])\n"
        "        print('=====')\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for ttir in proc.stdout.split("=====")[:2]:
        assert "stride_kt" in ttir and "arith.muli" in ttir
        assert _narrow_stride_products(ttir) == []
