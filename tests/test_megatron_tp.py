"""graft's layer spec under tensor parallelism (2 gloo ranks): column-parallel linears are
served by graft on Megatron's ``allreduce_dgrad`` path (dgrad all-reduce overlapped with the
wgrad GEMM), and a GPTModel matches the local spec's losses and gradients."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

SCRIPT = Path(__file__).with_name("_megatron_tp.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(tmp_path, world=2, timeout=240):
    port = _free_port()
    out = tmp_path / "tp"
    procs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith("GRAFT_") or k == "GRAFT_TEST_DEVICE"}
        env.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", GRAFT_BACKENDS="torch")
        log = open(f"{out}.log{rank}", "w")
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), "--out", str(out)], env=env, stdout=log,
                                      stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = "\n".join(Path(f"{out}.log{r}").read_text()[-3000:] for r in range(world))
    assert all(p.returncode == 0 for p in procs), logs
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(world)]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_gpt_model_tp2_served_and_matches_local(tmp_path):
    for rank, result in enumerate(_run_ranks(tmp_path)):
        local, grafted = result["losses"]["local"], result["losses"]["graft"]
        assert len(local) == 2 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(grafted, local)), (rank, result)
        worst = max(result["grad_diff"].items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-4, (rank, worst)
        calls = result["calls"]
        # Per layer and step: 2 norms, 4 linears (qkv and fc1 column-parallel with the TP dgrad
        # all-reduce; proj and fc2 row-parallel), 1 attention; 2 layers, 2 steps.
        assert calls.get("gemm.linear:torch") == 2 * 2 * 4, calls
        assert calls.get("fused.rms_norm:torch") == 2 * 2 * 2, calls
        assert calls.get("attention.prefill:torch") == 2 * 2, calls
        assert not [k for k in calls if k.startswith("fallback.")], calls
        assert result["served"] == calls, (result["served"], calls)
