"""What each upstream project expects of a contribution: title tag, DCO, and its own
linters and formatters with the versions its pre-commit configuration pins.

Linter versions are taken from each project's ``.pre-commit-config.yaml`` at the
release the templates target, so ``check`` runs what the project's CI runs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Tool:
    """One linter (``check``) or formatter (``fix``) invocation on the changed files."""

    name: str
    check: tuple  # argv before the file list; run in the patched tree
    fix: tuple = ()  # argv that rewrites files into the project's style (generate); () = no fixer
    files: str = r"\.py$"  # regex: which changed files this tool looks at (the pre-commit `files:`)


@dataclass(frozen=True)
class Project:
    framework: str
    title_tag: str  # prefix of commit subjects, e.g. "[Kernel]"; "" for none
    dco: bool  # the project requires Signed-off-by (Developer Certificate of Origin)
    packages: tuple  # pinned pip requirements of the linters
    tools: tuple = field(default_factory=tuple)

    def title(self, subject: str) -> str:
        if not self.title_tag or subject.startswith(self.title_tag):
            return subject
        return f"{self.title_tag} {subject}"

    def tools_for(self, paths) -> list:
        """(tool, [paths it applies to]) for every tool with at least one matching path."""
        out = []
        for tool in self.tools:
            hits = [p for p in paths if re.search(tool.files, p)]
            if hits:
                out.append((tool, hits))
        return out


PROJECTS = {
    # vLLM: ruff v0.14.0 (.pre-commit-config.yaml), configured in pyproject.toml; DCO check on PRs;
    # PR titles carry a category tag (CONTRIBUTING: [Kernel], [Core], [Bugfix], ...).
    "vllm": Project(
        framework="vllm", title_tag="[Kernel]", dco=True, packages=("ruff==0.14.0",),
        tools=(
            Tool("ruff check", ("ruff", "check", "--no-cache"), ("ruff", "check", "--no-cache", "--fix")),
            Tool("ruff format", ("ruff", "format", "--no-cache", "--check", "--diff"),
                 ("ruff", "format", "--no-cache")),
        )),
    # DeepSpeed: yapf v0.40.0 with .style.yapf and flake8 5.0.4 with .flake8; DCO required.
    "deepspeed": Project(
        framework="deepspeed", title_tag="", dco=True, packages=("yapf==0.40.0", "flake8==5.0.4"),
        tools=(
            Tool("yapf", ("yapf", "--diff", "--style", ".style.yapf"), ("yapf", "-i", "--style", ".style.yapf")),
            Tool("flake8", ("flake8", "--config=.flake8")),
        )),
    # Megatron-LM: black 24.4.2 / isort 5.13.2 / pylint 3.2.6 (.pre-commit-config.yaml, pyproject.toml,
    # .pylintrc); pylint and isort cover megatron/core only, black also tests/unit_tests.
    "megatron": Project(
        framework="megatron", title_tag="", dco=False,
        packages=("black==24.4.2", "isort==5.13.2", "pylint==3.2.6"),
        tools=(
            Tool("black", ("black", "--check", "--diff", "--skip-magic-trailing-comma", "--skip-string-normalization"),
                 ("black", "-q", "--skip-magic-trailing-comma", "--skip-string-normalization"),
                 files=r"^(megatron/core/|tests/unit_tests/).*\.py$"),
            Tool("isort", ("isort", "--check-only", "--diff"), ("isort", "-q"), files=r"^megatron/core/.*\.py$"),
            Tool("pylint", ("pylint", "--rcfile=.pylintrc", "--score=n"), files=r"^megatron/core/.*\.py$"),
        )),
}


def project(framework: str) -> Project:
    return PROJECTS[framework]
