"""The extension-point series against real upstream code.

* Pinned releases: the installed packages' Python sources (same files as the release, no
  compiled extensions, no tests/): the series applies, the patched modules import, and the
  patch's own tests pass in the patched tree (DeepSpeed's with its default ``tests/pytest.ini``
  marker selection in place).
* Newest upstream: ``tests/upstream_snapshots/<snapshot>/`` holds only the files the templates
  touch, at the commit ``SOURCES.json`` records; each template records the snapshot commit it
  was last checked against, and the series must apply there.
"""
import importlib.metadata
import json
import shutil
from pathlib import Path

import pytest

from graft.tools.patches.check import APPLIES, check
from graft.tools.patches.generate import select_templates

from test_patches import _installed_sources, bench_json, gen, git

SNAPSHOTS = Path(__file__).parent / "upstream_snapshots"
SOURCES = json.loads((SNAPSHOTS / "SOURCES.json").read_text())
SERIES = {"vllm": "vllm-oot-custom-op-name", "deepspeed": "deepspeed-adam-builder-from-accelerator",
          "megatron": "megatron-local-spec-backend"}
DISTRIBUTION = {"vllm": "vllm", "deepspeed": "deepspeed", "megatron": "megatron-core"}
PACKAGE = {"vllm": "vllm", "deepspeed": "deepspeed", "megatron": "megatron"}
NEW_TESTS_PASSED = {"vllm": 5, "deepspeed": 2, "megatron": 4}  # every test the patch adds runs and passes


def _template(framework):
    (template,) = select_templates(framework, [SERIES[framework]])
    return template


def _snapshots(framework):
    return [name for name, entry in SOURCES.items() if isinstance(entry, dict) and entry["project"] == framework]


@pytest.mark.parametrize("framework", sorted(SERIES))
def test_each_template_records_what_it_was_last_checked_against(framework):
    template = _template(framework)
    assert template.checked_against.get("release") == importlib.metadata.version(DISTRIBUTION[framework]), (
        f"{template.name} was checked against {framework} {template.checked_against.get('release')}; "
        "the installed (pinned) release differs: re-check the anchors and update checked_against")
    snapshots = {k: v for k, v in template.checked_against.items() if k != "release"}
    assert snapshots and set(snapshots) == set(_snapshots(framework))
    for name, commit in snapshots.items():
        assert SOURCES[name]["commit"] == commit, (
            f"tests/upstream_snapshots/{name} is now {SOURCES[name]['commit']}; {template.name} records {commit}")


@pytest.mark.parametrize("framework", sorted(SERIES))
def test_series_applies_to_the_newest_upstream_snapshot(framework, tmp_path):
    for name in _snapshots(framework):
        tree = tmp_path / name
        shutil.copytree(SNAPSHOTS / name, tree)
        git(tree, "init", "-q")
        git(tree, "add", "-A")
        git(tree, "commit", "-q", "-m", f"upstream {SOURCES[name]['commit']}")
        out = tmp_path / f"{name}-out"
        (patch,) = gen(framework, tree, out, names=[SERIES[framework]])
        report = check(tree, out, import_check=False)
        assert [p.status for p in report.patches] == [APPLIES] and report.ok, report.failures()
        assert not report.warnings, report.warnings  # inside the declared version range
    if framework == "megatron":  # the kernel patch follows main too, when it has GPU numbers to carry
        tree = tmp_path / "megatron-main"
        gen(framework, tree, tmp_path / "kernel-out", names=["megatron-triton-rms-norm"],
            bench_results=bench_json(tmp_path / "bench.json"))
        assert check(tree, tmp_path / "kernel-out", import_check=False).ok


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("framework", sorted(SERIES))
def test_series_on_the_pinned_release_imports_and_its_tests_pass(framework, tmp_path):
    tree = _installed_sources(PACKAGE[framework], tmp_path / "src")
    if framework == "deepspeed":  # DeepSpeed's default marker selection (addopts -m "not ... inference_ops ...")
        (tree / "tests").mkdir()
        shutil.copy(SNAPSHOTS / "deepspeed-main" / "tests" / "pytest.ini", tree / "tests" / "pytest.ini")
        git(tree, "add", "-A")
        git(tree, "commit", "-q", "-m", "tests/pytest.ini")
    out = tmp_path / "out"
    gen(framework, tree, out, names=[SERIES[framework]], upstream_version=_template(framework).checked_against["release"])
    report = check(tree, out, run_tests=True)
    assert report.ok, report.failures() + [t.output[-3000:] for t in report.tests]
    assert report.imports and all(error is None for _, error in report.imports)
    new = report.tests[0]
    assert new.baseline is None and new.counts.get("passed") == NEW_TESTS_PASSED[framework], new.summary
    assert not new.counts.get("deselected") and not new.counts.get("skipped"), new.summary


def _snapshot_tree(name, dest):
    shutil.copytree(SNAPSHOTS / name, dest)
    git(dest, "init", "-q")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", f"upstream {SOURCES[name]['commit']}")
    return dest


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("framework,source", [("deepspeed", "release"), ("megatron", "release"),
                                              ("megatron", "megatron-main"), ("deepspeed", "deepspeed-main")])
def test_series_passes_the_projects_own_linters(framework, source, tmp_path):
    """Formatted by, and clean under, the project's linters at the versions its tree pins
    (Megatron main: black 26 from its .pre-commit-config.yaml); a release copy without the
    config files is linted with the project's stored ones, and the report says so. The pinned
    linters are installed into $GRAFT_PATCH_LINTERS on first use."""
    if source == "release":
        tree = _installed_sources(PACKAGE[framework], tmp_path / "src")
        version = _template(framework).checked_against["release"]
    else:
        tree, version = _snapshot_tree(source, tmp_path / "src"), None
    out = tmp_path / "out"
    gen(framework, tree, out, names=[SERIES[framework]], upstream_version=version, format_code=True)
    report = check(tree, out, upstream_version=version, import_check=False, lint=True)
    assert report.lint and report.ok, [r.output for r in report.lint]
    stored = [w for w in report.warnings if "unpacked sdists leave it out" in w]
    assert bool(stored) == (source == "release"), report.warnings
