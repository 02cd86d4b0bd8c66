"""The documentation runs: README.md and every page under docs/.

Convention for fenced code blocks (written down in docs/index.md, "Examples in these pages"):

* ```python blocks run, in order, in one fresh interpreter per page (a page's blocks share
  their names, so a later block may use what an earlier one built);
* ```console blocks run each ``$ `` line (a trailing ``\\`` continues it) with bash, in a
  scratch folder, ``graft`` and ``python`` being this interpreter; their other lines are
  output and are not compared;
* other languages (bash, toml, text) are illustrations and never run;
* a python or console block right after ``<!-- not run: reason -->`` is skipped (a GPU, a
  second environment, minutes of work: the reason says which), one after
  ``<!-- slow: reason -->`` runs only in the full suite (marked slow).

Every page has at least one block that runs, unless it says why not with
``<!-- no example: reason -->``. Every relative link names a file that exists, and the
README stays a front door: at most 250 lines, the four frameworks named at the top, the two
commands, and the test command that .ci/run runs.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MAIN_JOB = "bash ci/setup.sh && .venv/bin/graft conformance --out conformance-report"
TEST_COMMAND = "bash ci/setup.sh && .venv/bin/python -m pytest -q"

FENCE = re.compile(r"^(\s*)```([A-Za-z0-9_+-]*)\s*$")
MARK = re.compile(r"^\s*<!--\s*(not run|slow|no example):\s*(.+?)\s*-->\s*$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    mark: str = ""  # "", "not run" or "slow"
    reason: str = ""

    @property
    def name(self) -> str:
        return f"{os.path.relpath(self.page, ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2), i
        body = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mark = MARK.match(prev)
        block = Block(page, start + 1, lang, "\n".join(body) + "\n")
        if mark and mark.group(1) != "no example":
            block.mark, block.reason = mark.group(1), mark.group(2)
        found.append(block)
        i += 1
    return found


def runnable(block: Block) -> bool:
    return block.lang in ("python", "console") and block.mark != "not run"


def commands(block: Block) -> list[str]:
    out, current = [], None
    for line in block.code.splitlines():
        if current is not None:
            current += "\n" + line
        elif line.startswith("$ "):
            current = line[2:]
        if current is not None and not current.endswith("\\"):
            out.append(current)
            current = None
    return out


def _env(tmp: Path) -> dict:
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, argv in (("graft", f'"{sys.executable}" -m graft'), ("python", f'"{sys.executable}"')):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec {argv} "$@"\n')
        shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRAFT_", "TRITON_"))}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["DOCS_ROOT"] = str(ROOT)  # a block may name repository files through it
    return env


# One fresh interpreter runs a page's fast python blocks in order, in one namespace; a failure
# names the block's line.
RUNNER = r"""
import json, sys, traceback
blocks = json.loads(sys.stdin.read())
ns = {"__name__": "__main__"}
for name, code in blocks:
    try:
        exec(compile(code, name, "exec"), ns)
    except BaseException:
        print(f"\n--- block {name} failed ---", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
"""


def _run_python(blocks_: list[Block], tmp: Path) -> None:
    import json

    payload = json.dumps([(b.name, b.code) for b in blocks_])
    proc = subprocess.run([sys.executable, "-c", RUNNER], input=payload, capture_output=True, text=True,
                          cwd=tmp, env=_env(tmp), timeout=300)
    assert proc.returncode == 0, f"{[b.name for b in blocks_]}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def _run_console(block: Block, tmp: Path) -> None:
    for command in commands(block):
        proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=tmp,
                              env=_env(tmp), timeout=300)
        assert proc.returncode == 0, f"{block.name}: $ {command}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def _cases():
    for page in PAGES:
        page_blocks = [b for b in blocks(page) if runnable(b)]
        fast_python = [b for b in page_blocks if b.lang == "python" and b.mark != "slow"]
        if fast_python:
            yield pytest.param("python", fast_python, id=f"{page.relative_to(ROOT)}:python")
        for b in page_blocks:
            marks = [pytest.mark.slow] if b.mark == "slow" else []
            if b.lang == "console" or b.mark == "slow":
                yield pytest.param(b.lang, [b], id=b.name, marks=marks)


def _run(lang: str, page_blocks: list, tmp: Path) -> None:
    if lang == "python":
        _run_python(page_blocks, tmp)
    else:
        _run_console(page_blocks[0], tmp)


@pytest.fixture(scope="module")
def started(request, tmp_path_factory):
    """Start every selected block at once, two at a time (each is a fresh interpreter that
    mostly waits on imports): {test id: future}."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=2)
    futures = {}
    for item in request.session.items:
        if getattr(item, "originalname", None) == "test_code_block_runs" and item.module is sys.modules[__name__]:
            params = item.callspec.params
            tmp = tmp_path_factory.mktemp("block")
            futures[item.callspec.id] = pool.submit(_run, params["lang"], params["page_blocks"], tmp)
    yield futures
    pool.shutdown(wait=False, cancel_futures=True)


@pytest.mark.parametrize("lang,page_blocks", list(_cases()))
def test_code_block_runs(lang, page_blocks, started, request, tmp_path):
    future = started.get(request.node.callspec.id)
    if future is None:  # not collected up front (e.g. run by node id from another session)
        _run(lang, page_blocks, tmp_path)
    else:
        future.result()


def test_convention_parses(tmp_path):
    """The parser itself: marks, languages, continuation lines."""
    assert ROOT / "docs" / "index.md" in PAGES
    page = tmp_path / "probe.md"
    page.write_text("x\n<!-- not run: a GPU -->\n```python\nimport nothing\n```\n\n"
                    "```console\n$ graft info \\\n  --json\nout\n```\n")
    (gpu, cli) = blocks(page)
    assert (gpu.lang, gpu.mark, gpu.reason, runnable(gpu)) == ("python", "not run", "a GPU", False)
    assert runnable(cli) and commands(cli) == ["graft info \\\n  --json"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_page_has_a_runnable_example(page):
    text = page.read_text(encoding="utf-8")
    if re.search(r"<!--\s*no example:\s*\S", text):
        return
    assert any(runnable(b) for b in blocks(page)), f"{page.relative_to(ROOT)}: no python/console block runs"


@pytest.mark.parametrize("page", [*PAGES, ROOT / "ARCHITECTURE.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    text = page.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # links inside code are code
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve()
        assert path.exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"
        if anchor and path.suffix == ".md":
            assert anchor in anchors(path), f"{page.relative_to(ROOT)} links to {target}: no such heading"


def anchors(page: Path) -> set:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_docs_pages_are_listed_in_the_index():
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    for page in PAGES:
        if page.parent == ROOT or page.name == "index.md":
            continue
        assert f"({page.relative_to(ROOT / 'docs')})" in index, page


def test_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    top = " ".join(text.splitlines()[:8])
    for framework in ("vLLM", "TorchTitan", "Megatron-core", "DeepSpeed"):
        assert framework in top, framework
    assert MAIN_JOB in text and TEST_COMMAND in text
    for page in ("docs/selection.md", "docs/writing-a-plugin.md", "docs/frameworks/vllm.md",
                 "docs/frameworks/torchtitan.md", "docs/frameworks/megatron.md",
                 "docs/frameworks/deepspeed.md", "docs/gpu-kernels.md", "docs/costs.md",
                 "docs/profiling.md", "docs/patches.md", "docs/index.md"):
        assert f"]({page})" in text, page


def test_ci_runs_exactly_the_readme_test_command():
    run = (ROOT / ".ci" / "run").read_text(encoding="utf-8").split("\n")
    steps = [line for line in run if line and not line.startswith(("#", "set ", "cd ", "rm "))]
    assert " && ".join(steps) == TEST_COMMAND


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_marks_sit_on_blocks_that_would_run(page):
    """A not-run or slow mark on a block that never runs anyway (bash, toml) says nothing."""
    for b in blocks(page):
        if b.mark:
            assert b.lang in ("python", "console"), f"{b.name}: '{b.mark}' on a {b.lang or 'plain'} block"


def test_copies_match_the_block_that_runs():
    """A block skipped because "<page> runs it" is the start of a block there that runs."""
    for page in PAGES:
        for b in blocks(page):
            m = re.fullmatch(r"(\S+\.md) runs it", b.reason)
            if m:
                other = blocks(ROOT / m.group(1))
                assert any(o.code.startswith(b.code) and runnable(o) for o in other), f"{b.name}: not in {m.group(1)}"
