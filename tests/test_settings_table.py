"""graft.settings: one table declares every GRAFT_* variable the code reads.

* every GRAFT_* name read in graft/, ci/ and setup.py (os.environ, getenv, the snapshot's
  ``.get``, parse_bool, the settings accessors, declare_env_var, a shell ``$GRAFT_X``, or a
  string literal that is exactly a variable name) is declared in graft.settings (or is a
  GRAFT_<OP>/GRAFT_<FAMILY> priority variable); tests/ and ci/ may also read the test-only
  ones of tests/_test_settings.py; a planted undeclared read is caught;
* docs/settings.md is what graft.tools.settings_doc generates;
* the typed accessors reject bad values naming the value and what is valid;
* no GRAFT_TEST_ name in graft/; no variable declared twice.
"""
from __future__ import annotations

import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from _test_settings import TEST_SETTINGS, is_test_setting
from graft import config, settings
from graft.errors import GraftConfigError

ROOT = Path(__file__).resolve().parents[1]
NAME = r"GRAFT_[A-Z0-9_]*[A-Z0-9]"
# Calls that read a variable by name (first argument a string literal, f-strings included).
READ_CALL = re.compile(
    r"(?:environ(?:\.get|\.setdefault|\.pop)?|getenv|\.get|parse_bool|settings\.(?:get|raw|setting)|declare_env_var"
    r"|env_int|override|override_config)\s*[\(\[]\s*f?[\"'](" + NAME + r")[\"']"
)
SHELL_READ = re.compile(r"\$\{?(" + NAME + r")")
# Names that are not environment variables: an attribute of DeepSpeed op builders, a line
# prefix of the vLLM bench's protocol, C/C++ macros (not scanned: only .py/.sh files are).
NOT_VARIABLES = {"GRAFT_OP"}
# Names tests use on purpose: planted typos and undeclared names, rows built in a test, and the
# GRAFT_<OP> variable of a toy op test_selection registers.
TESTS_OWN_NAMES = {"GRAFT_ATENTION", "GRAFT_STRICTT", "GRAFT_NOT_DECLARED_X", "GRAFT_X", "GRAFT_FUSED_TOY_SCALE"}


def _ops() -> dict:
    from graft.plugins import get_host

    return get_host().registry.families()


def python_reads(text: str) -> set[str]:
    """GRAFT_* names a Python source reads: read calls, and string literals that are exactly a name."""
    found = set(READ_CALL.findall(text))
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.STRING:
            body = re.sub(r"^[rbfuRBFU]*", "", tok.string).strip("\"'")
            if re.fullmatch(NAME, body):
                found.add(body)
    return found - NOT_VARIABLES


def shell_reads(text: str) -> set[str]:
    return set(SHELL_READ.findall(text))


def undeclared(names, ops, allow_test=False) -> list[str]:
    return sorted(n for n in names
                  if not settings.is_declared(n, ops) and not (allow_test and is_test_setting(n)))


def _sources(*folders, suffixes=(".py",)):
    for folder in folders:
        base = ROOT / folder
        paths = [base] if base.is_file() else sorted(base.rglob("*"))
        for path in paths:
            if path.is_file() and path.suffix in suffixes and "__pycache__" not in path.parts:
                yield path


def test_every_variable_graft_reads_is_declared():
    ops = _ops()
    missing = {}
    for path in _sources("graft", "setup.py"):
        bad = undeclared(python_reads(path.read_text()), ops)
        if bad:
            missing[str(path.relative_to(ROOT))] = bad
    for path in _sources("ci", ".ci", suffixes=(".sh", "")):
        bad = undeclared(shell_reads(path.read_text()), ops, allow_test=True)
        if bad:
            missing[str(path.relative_to(ROOT))] = bad
    for path in _sources("ci", suffixes=(".py",)):
        bad = undeclared(python_reads(path.read_text()), ops, allow_test=True)
        if bad:
            missing[str(path.relative_to(ROOT))] = bad
    assert not missing, f"GRAFT_* variables read but declared nowhere (add them to graft/settings.py): {missing}"


def test_every_variable_the_tests_read_is_declared_somewhere():
    ops = _ops()
    missing = {}
    for path in _sources("tests"):
        names = python_reads(path.read_text()) - TESTS_OWN_NAMES
        bad = undeclared(names, ops, allow_test=True)
        if bad:
            missing[str(path.relative_to(ROOT))] = bad
    assert not missing, f"declare these in graft/settings.py or tests/_test_settings.py: {missing}"


def test_a_planted_undeclared_read_is_caught():
    ops = _ops()
    planted = 'import os\nlimit = os.environ.get("GRAFT_NOT_DECLARED_X", "1")\n'
    assert undeclared(python_reads(planted), ops) == ["GRAFT_NOT_DECLARED_X"]
    assert undeclared(python_reads('from graft import settings\nsettings.raw("GRAFT_NOT_DECLARED_X")\n'), ops) \
        == ["GRAFT_NOT_DECLARED_X"]
    assert undeclared(python_reads('VAR = "GRAFT_NOT_DECLARED_X"\n'), ops) == ["GRAFT_NOT_DECLARED_X"]
    assert undeclared(shell_reads('if [ "${GRAFT_NOT_DECLARED_X:-1}" != 0 ]; then\n'), ops) == ["GRAFT_NOT_DECLARED_X"]
    # ...while declared names, per-op variables and messages that only mention a name pass
    fine = ('x = os.environ.get("GRAFT_STRICT")\ny = current().get("GRAFT_FUSED_RMS_NORM")\n'
            'raise ValueError(f"GRAFT_DISABLE={off} is wrong")\n')
    assert undeclared(python_reads(fine), ops) == []


def test_no_test_only_variable_in_the_product():
    offenders = [str(p.relative_to(ROOT)) for p in _sources("graft", suffixes=(".py", ".c", ".cpp", ".pyi", ".md"))
                 if "GRAFT_TEST_" in p.read_text()]
    assert offenders == []
    assert not [n for n in settings.TABLE if n.startswith("GRAFT_TEST_")]


def test_no_variable_is_declared_twice():
    names = [s.name for s in settings.rows()]
    assert len(names) == len(set(names)) == len(settings.TABLE)
    assert not set(settings.ALIASES) & set(names)
    assert not set(TEST_SETTINGS) & set(names)
    with pytest.raises(ValueError, match="must start with GRAFT_"):
        settings.Setting("NOT_GRAFT", "bool", False, "doc", "owner")
    with pytest.raises(ValueError, match="needs its choices"):
        settings.Setting("GRAFT_X", "choice", "a", "doc", "owner")


def test_every_row_is_complete():
    for s in settings.rows():
        assert s.type in settings.TYPES and s.doc and s.owner.startswith("graft"), s
        assert "\n" not in s.doc, s
        if s.default is not None and not s.aliases:
            assert s.parse(None) == s.default


def test_docs_settings_md_is_generated_from_the_table():
    from graft.tools.settings_doc import markdown

    path = ROOT / "docs" / "settings.md"
    assert path.read_text() == markdown(), "regenerate: python -m graft.tools.settings_doc > docs/settings.md"
    for s in settings.rows():
        assert f"`{s.name}`" in path.read_text()


def test_settings_doc_runs_as_a_module():
    proc = subprocess.run([sys.executable, "-m", "graft.tools.settings_doc"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (ROOT / "docs" / "settings.md").read_text()


@pytest.mark.parametrize("name,value,message", [
    ("GRAFT_STRICT", "maybe", "GRAFT_STRICT='maybe' is not a boolean; use one of 1/0, true/false, yes/no, on/off"),
    ("GRAFT_HIP_BUILD", "sometimes", "GRAFT_HIP_BUILD='sometimes' is not valid; use one of: lazy, off"),
    ("GRAFT_COLLECTIVES_VALIDATE", "never", "GRAFT_COLLECTIVES_VALIDATE='never' is not valid; use one of: "
                                            "signature, always"),
    ("GRAFT_OVERLAP_CHUNKS", "many", "GRAFT_OVERLAP_CHUNKS='many' is not an integer; give a whole number "
                                     "(suffixes KiB/MiB/GiB allowed), e.g. 4"),
    ("GRAFT_OVERLAP_CHUNKS", "2000", "GRAFT_OVERLAP_CHUNKS='2000' must be <= 1024"),
    ("GRAFT_CUSTOM_ALLREDUCE_MAX_WORLD", "0", "GRAFT_CUSTOM_ALLREDUCE_MAX_WORLD='0' must be >= 1"),
    ("GRAFT_COLLECTIVES_TIMEOUT", "soon", "GRAFT_COLLECTIVES_TIMEOUT='soon' is not a number"),
    ("GRAFT_VLLM_OPS", "rms_norm,lm_head", "GRAFT_VLLM_OPS='rms_norm,lm_head': unknown or empty; give a "
                                           "comma-separated list of rms_norm, silu_and_mul, rotary_embedding"),
])
def test_typed_accessors_name_the_bad_value_and_what_is_valid(name, value, message):
    with pytest.raises(GraftConfigError) as err:
        settings.get(name, {name: value})
    assert message in str(err.value)


def test_typed_accessors_parse_by_type_and_read_the_snapshot(monkeypatch):
    assert settings.get("GRAFT_STRICT", {}) is False
    assert settings.get("GRAFT_STRICT", {"GRAFT_STRICT": " Yes "}) is True
    assert settings.get("GRAFT_DISPATCH_C", {"GRAFT_DISPATCH_C": ""}) is True  # empty = unset
    assert settings.get("GRAFT_OVERLAP_MIN_BYTES", {"GRAFT_OVERLAP_MIN_BYTES": "2MiB"}) == 2 * 1024 * 1024
    assert settings.get("GRAFT_COLLECTIVES_TIMEOUT", {"GRAFT_COLLECTIVES_TIMEOUT": "2.5"}) == 2.5
    assert settings.get("GRAFT_COLLECTIVES_VALIDATE", {"GRAFT_COLLECTIVES_VALIDATE": "1"}) == "signature"
    assert settings.get("GRAFT_HIP_BUILD", {"GRAFT_HIP_BUILD": "OFF"}) == "off"
    assert settings.get("GRAFT_VLLM_OPS", {"GRAFT_VLLM_OPS": "moe, attention"}) == ["moe", "attention"]
    assert settings.get("GRAFT_CHECK_VALUES", {}) is None  # the default depends on the device
    monkeypatch.setenv("GRAFT_OVERLAP_CHUNKS", "8")  # (the test monkeypatch reloads the snapshot)
    assert settings.get("GRAFT_OVERLAP_CHUNKS") == 8 and settings.raw("GRAFT_OVERLAP_CHUNKS") == "8"
    with config.override(GRAFT_OVERLAP_CHUNKS="16"):
        assert settings.get("GRAFT_OVERLAP_CHUNKS") == 16
    with pytest.raises(KeyError, match="not declared in graft.settings.TABLE"):
        settings.get("GRAFT_NOT_DECLARED_X")


def test_a_deprecated_alias_is_read_when_the_new_name_is_unset(caplog):
    settings._warned.discard("GRAFT_HIP_VERBOSE")
    with caplog.at_level("WARNING", logger="graft"):
        assert settings.get("GRAFT_BUILD_VERBOSE", {"GRAFT_HIP_VERBOSE": "1"}) is True
        assert settings.get("GRAFT_BUILD_VERBOSE", {"GRAFT_HIP_VERBOSE": "1"}) is True
    assert [r.getMessage() for r in caplog.records] == [
        "GRAFT_HIP_VERBOSE is deprecated; set GRAFT_BUILD_VERBOSE instead"]  # once
    assert settings.get("GRAFT_BUILD_VERBOSE", {"GRAFT_HIP_VERBOSE": "1", "GRAFT_BUILD_VERBOSE": "0"}) is False
    with pytest.raises(GraftConfigError, match="GRAFT_HIP_VERBOSE='loud' is not a boolean"):
        settings.get("GRAFT_BUILD_VERBOSE", {"GRAFT_HIP_VERBOSE": "loud"})


def test_declare_env_var_only_checks_the_table():
    before = dict(config.KNOWN_ENV_VARS)
    assert config.declare_env_var("GRAFT_TUNING_TABLE", "a different description") == "GRAFT_TUNING_TABLE"
    assert config.KNOWN_ENV_VARS == before  # adds nothing
    with pytest.raises(ValueError, match="GRAFT_NOT_DECLARED_X is not declared in graft.settings.TABLE"):
        config.declare_env_var("GRAFT_NOT_DECLARED_X", "doc")
    with pytest.raises(ValueError, match="must start with GRAFT_"):
        config.declare_env_var("OTHER", "doc")


def test_unknown_env_vars_come_from_the_table():
    ops = _ops()
    env = {"GRAFT_STRICT": "1", "GRAFT_HIP_VERBOSE": "1", "GRAFT_FUSED_RMS_NORM": "torch", "GRAFT_FUSED": "torch",
           "GRAFT_STRICTT": "1", "GRAFT_TEST_DEVICE": "cpu"}
    assert config.unknown_env_vars(ops, env) == ["GRAFT_STRICTT", "GRAFT_TEST_DEVICE"]
    assert set(config.KNOWN_ENV_VARS) == set(settings.TABLE)
