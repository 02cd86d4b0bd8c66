"""pytest plugin: the conformance cases as tests, one per op x implementation x case x dtype.

Opt-in: nothing is collected unless ``--graft-conformance`` is given, and importing this
module imports only pytest, so having graft installed costs other test suites nothing::

    pytest --graft-conformance -m graft_conformance            # only the conformance tests
    pytest --graft-conformance --graft-conformance-op fused.rms_norm -m graft_conformance

(``-m graft_conformance`` drops the ordinary tests of the directory you run in.) It is
registered through the ``pytest11`` entry point; ``-p graft.tools.conformance.pytest_plugin``
loads it explicitly where entry points are disabled. A failing case fails its test with
the same message ``graft conformance`` prints (op, impl, case, dtype, errors, worst element).
Tests only check numerics; throughput belongs to ``graft conformance``.
"""
from __future__ import annotations

import os

import pytest

MARKER = "graft_conformance"


def pytest_addoption(parser):
    group = parser.getgroup("graft-conformance", "graft conformance suite")
    group.addoption("--graft-conformance", action="store_true", default=False,
                    help="collect graft's conformance cases as tests (marker: graft_conformance)")
    group.addoption("--graft-conformance-op", action="append", default=[], metavar="OP", help="only this op")
    group.addoption("--graft-conformance-family", action="append", default=[], metavar="F", help="only this family")
    group.addoption("--graft-conformance-impl", action="append", default=[], metavar="BACKEND",
                    help="only this backend's implementations")
    group.addoption("--graft-conformance-tags", default="quick", help="case tags (default: quick)")
    group.addoption("--graft-conformance-device", default=None,
                    help="device (default: $GRAFT_CONFORMANCE_DEVICE, else cpu)")


def _device(config) -> str:
    from graft import settings  # no torch, no triton

    return config.getoption("--graft-conformance-device") or settings.get("GRAFT_CONFORMANCE_DEVICE", os.environ)


def pytest_configure(config):
    config.addinivalue_line("markers", f"{MARKER}: a graft conformance case (op x impl x case x dtype)")
    if config.getoption("--graft-conformance"):
        from graft.tools.conformance.runner import enable_cpu_interpreter

        enable_cpu_interpreter(_device(config))  # before anything imports triton


class ConformanceFailure(AssertionError):
    """A numerics mismatch or an implementation error; its message is the report's."""


def _runner(config):
    runner = getattr(config, "_graft_conformance_runner", None)
    if runner is None:
        from graft.tools.conformance.runner import Options, Runner

        opt = config.getoption
        device = _device(config)
        tags = tuple(t.strip() for t in opt("--graft-conformance-tags").split(",") if t.strip())
        options = Options(device=device, ops=tuple(opt("--graft-conformance-op")),
                          families=tuple(opt("--graft-conformance-family")),
                          impls=tuple(opt("--graft-conformance-impl")), tags=tags, timing=False)
        runner = Runner(options=options)
        config._graft_conformance_runner = runner
    return runner


class ConformanceItem(pytest.Item):
    def __init__(self, *, case, dtype, impl, skip_reason=None, **kwargs):
        super().__init__(**kwargs)
        self.case, self.dtype, self.impl, self.skip_reason = case, dtype, impl, skip_reason
        self.add_marker(MARKER)

    def runtest(self):
        from graft.tools.conformance.runner import ERROR, FAIL, SKIPPED

        if self.skip_reason:
            pytest.skip(self.skip_reason)
        result = _runner(self.config).run_case(self.case, self.dtype, impls=[self.impl])
        if result.status == ERROR:
            raise ConformanceFailure(result.reason)
        if result.status == SKIPPED:
            pytest.skip(result.reason)
        (r,) = result.impls
        if r.status == SKIPPED:
            pytest.skip(f"{r.name} cannot serve this case: {r.reason}")
        if r.status in (FAIL, ERROR):
            raise ConformanceFailure(r.message)

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, ConformanceFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return "graft-conformance", None, self.name


class ConformanceCollector(pytest.Collector):
    def collect(self):
        from graft.tools.conformance.cases import MULTI_PROCESS_FAMILIES
        from graft.tools.conformance.runner import dtype_name

        runner = _runner(self.config)
        for case in runner.cases():
            family = runner.registry.op(case.op).family
            for dtype in runner.case_dtypes(case):
                for impl in runner.impls_for(case.op):
                    name = f"{case.op}[{case.name}-{dtype_name(dtype)}-{impl.backend}-{impl.provider}]"
                    yield ConformanceItem.from_parent(self, name=name, case=case, dtype=dtype, impl=impl,
                                                      skip_reason=MULTI_PROCESS_FAMILIES.get(family))


@pytest.hookimpl(tryfirst=True)  # before -m/-k deselection, so they apply to these items too
def pytest_collection_modifyitems(session, config, items):
    if not config.getoption("--graft-conformance"):
        return
    collector = ConformanceCollector.from_parent(session, name="graft-conformance")
    items.extend(collector.collect())
