"""`graft info`: text and JSON output, configuration errors, typo warnings."""
import json
import os
import subprocess
import sys


def graft(*args, env=None):
    base = {k: v for k, v in os.environ.items() if not k.startswith("GRAFT_")}
    base.update(env or {})
    return subprocess.run([sys.executable, "-m", "graft", *args], capture_output=True, text=True, env=base, timeout=180)


def test_info_json_lists_builtin_plugins_and_every_op():
    proc = graft("info", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    names = {p["name"]: p for p in report["plugins"]}
    assert {"torch", "triton", "hip"} <= set(names)
    assert all(p["version"] == "0.1.0" for n, p in names.items() if p["distribution"] == "graft")
    assert report["device"]["type"] in {"cpu", "cuda"}
    for op in report["ops"]:
        assert op["selected"] is not None, op
        backends = [c["backend"] for c in op["candidates"]]
        assert backends[-1] == "torch" or "torch" in backends
        for c in op["candidates"]:
            assert c["usable"] or c["reason"], c  # every skipped candidate says why


def test_info_text_shows_reasons_and_environment():
    proc = graft("info", env={"GRAFT_BACKENDS": "torch", "GRAFT_ATENTION": "triton"})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "GRAFT_BACKENDS=torch" in out
    assert "GRAFT_ATENTION is set but nothing reads it" in out
    assert "plugins:" in out and "ops (selected implementation marked '>')" in out
    assert "dispatch entry: C (graft._fastcall)" in out  # built by ci/setup.sh


def test_invalid_env_value_exits_2_with_valid_names():
    proc = graft("info", env={"GRAFT_BACKENDS": "triton,cudaa"})
    assert proc.returncode == 2
    assert "unknown backend(s) 'cudaa'" in proc.stderr and "valid backends are:" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_op_and_dtype_are_usage_errors():
    proc = graft("info", "--op", "nope.op")
    assert proc.returncode == 2 and "unknown op 'nope.op'" in proc.stderr
    proc = graft("info", "--dtype", "float17")
    assert proc.returncode == 2 and "is not a torch dtype" in proc.stderr


def test_info_for_a_gpu_this_machine_may_not_have():
    proc = graft("info", "--json", "--device", "cuda", "--arch", "gfx942", "--op", "fused.rms_norm")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["device"] == {"type": "cuda", "vendor": "amd", "arch": "gfx942", "generation": "cdna3",
                                "name": "gfx942 (not this machine's)"}
    assert report["ops"][0]["selected"] is not None
    proc = graft("info", "--device", "cuda", "--op", "attention.prefill")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr


def test_info_says_when_the_op_rejects_the_dtype():
    proc = graft("info", "--op", "fused.rms_norm", "--dtype", "int8")
    assert proc.returncode == 0
    assert "! fused.rms_norm does not accept dtype int8 (accepts float16, bfloat16, float32)" in proc.stdout


def test_no_command_prints_help():
    proc = graft()
    assert proc.returncode == 2 and "info" in proc.stdout


def test_info_lists_framework_integrations_and_their_switches():
    report = json.loads(graft("info", "--json", "--op", "gemm.linear",
                              env={"GRAFT_VLLM": "0", "GRAFT_BACKENDS": "torch"}).stdout)
    rows = {i["name"]: i for i in report["integrations"]}
    assert {"vllm", "deepspeed", "megatron"} <= set(rows)
    assert rows["vllm"]["can_activate"] is False and rows["vllm"]["reason"] == "GRAFT_VLLM=0"
    assert rows["deepspeed"]["can_activate"] is True and "0.19" in rows["deepspeed"]["reason"]
    # No tuning table and no GRAFT_* variable: graft is not known faster, DeepSpeed keeps its own.
    default = json.loads(graft("info", "--json", "--op", "gemm.linear").stdout)
    ds = {i["name"]: i for i in default["integrations"]}["deepspeed"]
    assert ds["can_activate"] is False and ds["reason"].startswith("graft serves no part here: adam (graft is not"), ds
    off = json.loads(graft("info", "--json", "--op", "gemm.linear", env={"GRAFT_DISABLE": "all"}).stdout)
    assert all(not i["can_activate"] and i["reason"] == "GRAFT_DISABLE=all" for i in off["integrations"])


def test_info_for_an_unknown_device_type_is_a_usage_error():
    proc = graft("info", "--device", "tpu")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--device 'tpu'" in proc.stderr and "cpu, cuda" in proc.stderr
