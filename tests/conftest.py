"""Test set-up shared by every test module.

Triton kernels run on the CPU only in the interpreter, and TRITON_INTERPRET must be
set before triton is first imported, so it is set here, at collection start, unless
the environment already chose (the GPU check runs with TRITON_INTERPRET=0).
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# The conformance pytest plugin (graft.tools) runs its cases on the test suite's device.
if os.environ.get("GRAFT_TEST_DEVICE", "").strip():
    os.environ.setdefault("GRAFT_CONFORMANCE_DEVICE", os.environ["GRAFT_TEST_DEVICE"])

import pytest  # noqa: E402


class _GraftMonkeyPatch(pytest.MonkeyPatch):
    """pytest's monkeypatch, plus: changing a GRAFT_* variable reloads graft's configuration.

    graft reads its GRAFT_* variables once (a user calls graft.reload_config() after
    changing them); tests change them all the time, so the reload happens here.
    """

    def setenv(self, name, value, prepend=None):
        super().setenv(name, value, prepend)
        _reload_if_graft(name)

    def delenv(self, name, raising=True):
        super().delenv(name, raising)
        _reload_if_graft(name)

    def undo(self):
        super().undo()
        _reload_if_graft("GRAFT_")


def _reload_if_graft(name):
    import sys

    if str(name).startswith("GRAFT_") and "graft.config" in sys.modules:
        sys.modules["graft.config"].reload()


@pytest.fixture
def monkeypatch():
    mp = _GraftMonkeyPatch()
    yield mp
    mp.undo()


def _graft_environ() -> dict:
    return {k: v for k, v in os.environ.items() if k.startswith("GRAFT_")}


@pytest.fixture(autouse=True)
def _no_leaked_graft_variables():
    """A test that leaves a GRAFT_* variable changed fails, and the variables are put back:
    otherwise every later test runs under it (a leaked GRAFT_CHECK_VALUES=0 once made value
    checks pass in isolation and fail in the full suite)."""
    before = _graft_environ()
    yield
    after = _graft_environ()
    if after != before:
        changed = sorted(set(before.items()) ^ set(after.items()))
        for key in after.keys() - before.keys():
            del os.environ[key]
        os.environ.update(before)
        _reload_if_graft("GRAFT_")
        pytest.fail(f"the test left GRAFT_* variables changed: {changed} (restored)")


@pytest.fixture
def fresh_graft(monkeypatch):
    """A clean plugin host and selection caches, with no GRAFT_* variables set."""
    from graft import plugins

    for key in list(os.environ):
        if key.startswith("GRAFT_") and key not in ("GRAFT_TEST_DEVICE", "GRAFT_CONFORMANCE_DEVICE"):
            monkeypatch.delenv(key)
    plugins.reset()
    yield
    plugins.reset()


@pytest.fixture
def device():
    """Tests run on the CPU here; GRAFT_TEST_DEVICE=cuda runs them on a GPU (ci/gpu_check.sh)."""
    import torch

    name = os.environ.get("GRAFT_TEST_DEVICE", "cpu")
    if name != "cpu" and not torch.cuda.is_available():
        pytest.skip(f"GRAFT_TEST_DEVICE={name} but no GPU is available")
    return torch.device(name)


# The fast selection (-m "not slow") is for iterating: it leaves out what spawns
# torch.distributed ranks (5-30 s a test on 2 cores), what is marked slow itself, and the
# modules below, whose tests run child processes, compilers or linters (their totals in a
# -m "not slow" run on the 2-core machine, before they were listed); the full suite (CI)
# runs everything.
SLOW_MODULES = {
    "test_fuzz.py": "graft fuzz in child processes (93 s)",
    "test_hostile_cases.py": "hostile-input cases, one child process each (71 s)",
    "test_patches.py": "git, upstream trees and their linters (49 s)",
    "test_vllm_integration.py": "vLLM imported in child processes (46 s)",
    "test_hip_kernels.py": "C++ compiles with nvcc / torch cpp_extension (35 s)",
    "test_kernel_safety.py": "every kernel interpreted on hostile values (28 s)",
    "test_triton36.py": "kernel tests again under Triton 3.6 (26 s)",
    "test_triton_aot.py": "ahead-of-time compiles for sm_90 and gfx942 (20 s)",
    "test_gpu_bench_script.py": "the GPU script run on a fake device (15 s)",
    "test_gpu_lease_script.py": "the whole GPU lease script run on the CPU (25 s)",
    "test_vllm_cpu_platform.py": "vLLM's CPU platform in its own venv (14 s)",
    "test_packaging.py": "wheel builds and import scans (14 s)",
}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("slow") is not None:
            continue
        if item.get_closest_marker("multiprocess") is not None or item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
