"""The reproducers of issue #25 (reliability, round 3), run in a fresh process per group.

Run by tests/test_reproducers.py as ``python tests/_reproducers_round3.py GROUP``, with the
protocol of tests/_reproducers.py (``START case``, then ``PASS case`` or ``FAIL case`` with
the traceback and ``END case``; an abort leaves a START without its outcome). The layout
group runs twice, once per dispatch entry (``GRAFT_DISPATCH_C`` is read at import).
"""
from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import warnings
import weakref

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _reproducers import _clean, _raises  # noqa: E402

warnings.filterwarnings("ignore", message=".*(Sparse|nested).*")


def _extra_impl(op: str, backend: str, fn, available=None):
    """An implementation of ``op`` registered in this process only (a vendor's, in effect)."""
    from graft.plugins import get_registry
    from graft.registry import Implementation

    get_registry().add_impl(Implementation(op=op, backend=backend, fn=fn, provider="repro",
                                           devices=frozenset({"cpu"}), available=available))


# ------------------------------------------------------------------------------ abort (layouts)

LAYOUTS = {
    "torch.sparse_csr": lambda t: t.to_sparse_csr(),
    "torch.sparse_csc": lambda t: t.to_sparse_csc(),
    "torch.sparse_bsr": lambda t: t.to_sparse_bsr((2, 2)),
    "torch.sparse_coo": lambda t: t.to_sparse(),
    "torch._mkldnn": lambda t: t.to_mkldnn(),
    "nested (torch.strided)": lambda t: torch.nested.nested_tensor(list(t.unsqueeze(0).expand(2, -1, -1))),
}


def case_non_strided_layouts_are_named_before_and_after_a_signature_is_remembered():
    from graft.errors import GraftInputError
    from graft.ops import fused, gemm

    _clean()
    x, w, g = torch.randn(4, 8), torch.randn(6, 8), torch.ones(8)
    calls = {
        "fused.silu_and_mul x": (lambda bad: fused.silu_and_mul(bad(x)), "x"),
        "fused.rms_norm x": (lambda bad: fused.rms_norm(bad(x), g, 1e-6), "x"),
        "gemm.linear x": (lambda bad: gemm.linear(bad(x), w), "x"),
        "gemm.linear weight": (lambda bad: gemm.linear(x, bad(w)), "weight"),
    }
    for warm in (False, True):  # cold, then with the dense signature remembered (the C entry's table)
        if warm:
            for _ in range(3):
                fused.silu_and_mul(x), fused.rms_norm(x, g, 1e-6), gemm.linear(x, w)
        for what, (run, arg) in calls.items():
            for layout, make in LAYOUTS.items():
                _raises(lambda: run(make), GraftInputError, f"{arg} has layout {layout}", "strided")
    # A nested tensor with the remembered tensor's dimensions reaches torch's check on a hit:
    x3 = torch.randn(2, 4, 8)
    for _ in range(3):
        fused.silu_and_mul(x3)
    nested = torch.nested.nested_tensor([x3[0], x3[1]])
    _raises(lambda: fused.silu_and_mul(nested), GraftInputError, "x has layout nested")
    assert torch.equal(fused.silu_and_mul(x3), fused.silu_and_mul(x3.clone()))  # still served


# ------------------------------------------------------------------------------ stale configuration


def case_a_reload_during_a_call_never_leaves_an_excluded_implementation_served():
    """The call in flight builds its plan under the old configuration while the reload
    lands (deterministically: from inside the vendor's availability check, which plan
    building runs); afterwards neither entry may serve the now-disabled implementation."""
    import graft
    from graft import dispatch
    from graft.ops.fused import rms_norm_reference

    _clean()
    armed = []

    def available():
        if armed:  # another thread's reload, landing while this call builds its plan
            armed.clear()
            os.environ["GRAFT_DISABLE"] = "triton,hip,reprovendor"
            graft.reload_config()
        return None

    _extra_impl("fused.rms_norm", "reprovendor", rms_norm_reference, available)
    os.environ["GRAFT_DISABLE"] = "triton,hip"  # the vendor's impl serves (interpreted Triton would rank first)
    graft.reload_config()
    x, w = torch.randn(2, 8), torch.ones(8)
    armed.append(True)
    graft.run("fused.rms_norm", x, w, 1e-6)  # in flight: may finish on the vendor's impl
    c_entry = [graft.run("fused.rms_norm", x, w, 1e-6)[1].backend for _ in range(3)]
    python_entry = [dispatch._python_run("fused.rms_norm", x, w, 1e-6)[1].backend for _ in range(3)]
    assert set(c_entry) == set(python_entry) == {"torch"}, (c_entry, python_entry)


def case_reload_stress_8_threads_1200_reloads_both_entries():
    """8 threads call fused.rms_norm over 12 shapes through the C and the Python entry
    while the main thread flips GRAFT_DISABLE 1200 times: no call made entirely after one
    reload returned and before the next began is served by an implementation that
    configuration excludes, and after the last reload (which excludes the vendor) every
    shape is served by the reference."""
    import graft
    from graft import config, dispatch
    from graft.ops.fused import rms_norm_reference

    _clean()
    _extra_impl("fused.rms_norm", "reprovendor", rms_norm_reference)
    os.environ["GRAFT_DISABLE"] = "triton,hip"  # the vendor's impl serves (interpreted Triton would rank first)
    graft.reload_config()
    inputs = [(torch.randn(r, h), torch.ones(h)) for r in (1, 2, 3) for h in (8, 16, 24, 32)]
    entries = (graft.run, dispatch._python_run)
    for run in entries:
        for x, w in inputs:
            assert run("fused.rms_norm", x, w, 1e-6)[1].backend == "reprovendor"
    bad, calls, stop = [], [0], threading.Event()
    settled = [config.current()]  # the configuration of the last reload that returned

    def reader(run):
        while not stop.is_set():
            for x, w in inputs:
                start, before = settled[0], config.current()
                _, impl = run("fused.rms_norm", x, w, 1e-6)
                calls[0] += 1
                # No reload began or ended during the call: it must follow `start`.
                if (start is before is config.current() is settled[0] and impl.backend == "reprovendor"
                        and "reprovendor" in before.get("GRAFT_DISABLE", "")):
                    bad.append(before.generation)

    threads = [threading.Thread(target=reader, args=(entries[i % 2],)) for i in range(8)]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    for t in threads:
        t.start()
    try:
        for i in range(1200):
            os.environ["GRAFT_DISABLE"] = "triton,hip,reprovendor" if i % 2 else "triton,hip"
            settled[0] = graft.reload_config()
    finally:
        stop.set()
        for t in threads:
            t.join()
        sys.setswitchinterval(old)
    assert calls[0] > 100, f"only {calls[0]} calls ran during the reloads"
    assert not bad, f"{len(bad)} of {calls[0]} calls served by an excluded implementation"
    after = {run("fused.rms_norm", x, w, 1e-6)[1].backend for run in entries for x, w in inputs for _ in range(2)}
    assert after == {"torch"}, after


# ------------------------------------------------------------------------------ gradients


def _flce_inputs():
    torch.manual_seed(0)
    x = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(7, 8, requires_grad=True)
    return x, w, torch.randint(0, 7, (5,))


def _second_derivative(fn):
    x, w, t = _flce_inputs()
    g, = torch.autograd.grad(fn(x, w, t), x, create_graph=True)
    gg, = torch.autograd.grad(g.square().sum(), w)
    return gg


def case_flce_double_backward_on_triton_is_a_named_error():
    import graft
    from graft.ops import loss

    _clean()
    with graft.override_config(GRAFT_LOSS_FUSED_LINEAR_CROSS_ENTROPY="triton"):
        assert graft.select("loss.fused_linear_cross_entropy", *_flce_inputs()).backend == "triton"
        _raises(lambda: _second_derivative(loss.fused_linear_cross_entropy), RuntimeError,
                "no double backward for loss.fused_linear_cross_entropy on triton",
                "GRAFT_LOSS_FUSED_LINEAR_CROSS_ENTROPY=torch")
        # create_graph=True alone (first-order gradients that are not differentiated) works:
        x, w, t = _flce_inputs()
        g, = torch.autograd.grad(loss.fused_linear_cross_entropy(x, w, t), x, create_graph=True)
        want, = torch.autograd.grad(loss.fused_linear_cross_entropy_reference(x, w, t), x)
        torch.testing.assert_close(g, want, atol=1e-5, rtol=1e-4)


def case_flce_double_backward_on_the_default_cpu_path_equals_the_reference():
    import graft
    from graft.ops import loss

    _clean()
    x, w, t = _flce_inputs()
    with graft.override_config(GRAFT_DISABLE="triton"):  # what serves on a CPU without TRITON_INTERPRET
        assert graft.run("loss.fused_linear_cross_entropy", x, w, t)[1].description.startswith("chunked")
        got = _second_derivative(loss.fused_linear_cross_entropy)
    want = _second_derivative(loss.fused_linear_cross_entropy_reference)
    assert want.abs().max() > 1e-3  # a second derivative that is not zero
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------------ fallback


def case_a_runtime_fallback_replans_only_its_op_with_the_loaded_configuration():
    import graft
    from graft import config, dispatch, selection
    from graft.errors import GraftUnsupportedError
    from graft.ops.fused import silu_and_mul_reference

    _clean()
    broken = []

    def flaky(x):
        broken.append("it cannot run here after all")
        raise GraftUnsupportedError("flaky: lazy build failed")

    _extra_impl("fused.silu_and_mul", "flaky", flaky, available=lambda: broken[0] if broken else None)
    x, g = torch.randn(4, 8), torch.ones(8)
    for _ in range(3):  # remembered, in the C entry's table too
        rms_backend = graft.run("fused.rms_norm", x, g, 1e-6)[1].backend
    rms_state = dispatch._ops["fused.rms_norm"]
    rms_fast = dispatch._fast_hits.get("fused.rms_norm")
    logged = set(selection._logged)
    generation = config.current().generation
    os.environ["GRAFT_DISABLE"] = "fused"  # changed without a reload: must not take effect
    out, impl = graft.run("fused.silu_and_mul", x)
    assert impl.backend != "flaky" and torch.allclose(out, silu_and_mul_reference(x))
    assert config.current().generation == generation, "the fallback re-read the environment"
    assert dispatch._ops.get("fused.rms_norm") is rms_state, "another op's plans were dropped"
    assert dispatch._fast_hits.get("fused.rms_norm") is rms_fast
    assert logged <= selection._logged, "the logged-once set was cleared"
    assert graft.run("fused.rms_norm", x, g, 1e-6)[1].backend == rms_backend  # GRAFT_DISABLE not reloaded
    assert graft.run("fused.silu_and_mul", x)[1].backend == impl.backend


# ------------------------------------------------------------------------------ leak


def case_destroyed_process_groups_are_not_kept_alive():
    import graft
    import torch.distributed as dist

    _clean()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    refs = []
    for i in range(6):
        os.environ["MASTER_PORT"] = str(29000 + (os.getpid() % 20000) + i)
        dist.init_process_group("gloo", rank=0, world_size=1)
        refs.append(weakref.ref(dist.distributed_c10d._world.default_pg))
        for _ in range(3):
            graft.call("collectives.all_reduce", torch.ones(4))
        dist.destroy_process_group()
        gc.collect()
    # graft's remembered signatures hold groups weakly; its collective plans drop destroyed
    # groups when the next plan is made: only the last group may still be referenced.
    alive = [r() is not None for r in refs]
    assert not any(alive[:-1]), f"destroyed groups kept alive: {alive}"


# ------------------------------------------------------------------------------ configuration


def case_override_blocks_exited_out_of_order_restore_the_environment():
    import graft
    from graft import config

    _clean()
    a = graft.override_config(GRAFT_DISABLE="triton", GRAFT_STRICT="1")
    b = graft.override_config(GRAFT_DISABLE="hip")
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)  # the outer block first: the inner one's value stays
    assert os.environ.get("GRAFT_DISABLE") == "hip" and "GRAFT_STRICT" not in os.environ, dict(os.environ)
    assert config.current().get("GRAFT_DISABLE") == "hip"
    b.__exit__(None, None, None)
    assert "GRAFT_DISABLE" not in os.environ and config.current().get("GRAFT_DISABLE") is None
    os.environ["GRAFT_DISABLE"] = "hip"  # a value set before the blocks comes back
    graft.reload_config()
    a, b = graft.override_config(GRAFT_DISABLE="triton"), graft.override_config(GRAFT_DISABLE="fused")
    a.__enter__(), b.__enter__()
    a.__exit__(None, None, None)
    b.__exit__(None, None, None)
    assert os.environ["GRAFT_DISABLE"] == "hip" and config.current()["GRAFT_DISABLE"] == "hip"


def case_reload_config_validates_and_applies_the_log_level():
    import graft
    from graft import config
    from graft.errors import GraftConfigError

    _clean()
    logger = logging.getLogger("graft")
    before = config.current()
    os.environ["GRAFT_LOG_LEVEL"] = "verbose"
    _raises(graft.reload_config, GraftConfigError, "GRAFT_LOG_LEVEL='verbose'", "DEBUG")
    assert config.current() is before, "an invalid reload was half applied"
    os.environ["GRAFT_LOG_LEVEL"] = "DEBUG"
    graft.reload_config()
    assert logger.level == logging.DEBUG
    del os.environ["GRAFT_LOG_LEVEL"]
    graft.reload_config()
    assert logger.level == logging.NOTSET


def case_disable_torch_is_an_error_naming_the_reference():
    import graft
    from graft.errors import GraftConfigError
    from graft.ops import fused

    _clean()
    with graft.override_config(GRAFT_DISABLE="torch"):
        _raises(lambda: fused.silu_and_mul(torch.randn(2, 8)), GraftConfigError,
                "GRAFT_DISABLE: 'torch'", "cannot be disabled")


# ------------------------------------------------------------------------------ users' view


def case_vllm_start_up_reports_every_layer_served_and_left():
    from graft.adapters.vllm import plugin
    from graft.adapters.vllm.integration import INTEGRATION

    _clean()
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    logger = logging.getLogger("graft")
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    plugin.register()  # what vLLM runs at start-up
    infos = [r.getMessage() for r in records if r.levelno == logging.INFO and "served by graft" in r.getMessage()]
    warnings_ = [r.getMessage() for r in records if r.levelno == logging.WARNING and "left to vllm" in r.getMessage()]
    assert len(infos) == 1, [r.getMessage() for r in records]
    for layer in ("rms_norm", "linear", "lm_head", "embedding", "GateLinear", "attention"):
        assert layer in infos[0], (layer, infos[0])
    assert len(warnings_) == 1 and "GRAFT_VLLM_ATTENTION_OVERRIDE=CPU_ATTN" in warnings_[0], warnings_
    os.environ["GRAFT_VLLM_ATTENTION_OVERRIDE"] = "CPU_ATTN"  # attention is then served: no warning
    assert INTEGRATION.layers()["expected_left"] == {} and "attention" in INTEGRATION.layers()["served"]
    del os.environ["GRAFT_VLLM_ATTENTION_OVERRIDE"]


def case_graft_info_says_what_the_vllm_integration_leaves_to_vllm():
    from graft.tools import info

    _clean()
    text = info.render_text(info.collect())
    block = text.split("framework integrations:")[1].split("\n\n")[0]
    assert "serves: rms_norm" in block and "left to vllm: attention" in block and "GateLinear" in block, block


GROUPS = {
    "layouts": ["non_strided_layouts_are_named_before_and_after_a_signature_is_remembered"],
    "reloads": ["a_reload_during_a_call_never_leaves_an_excluded_implementation_served",
                "reload_stress_8_threads_1200_reloads_both_entries"],
    "gradients": ["flce_double_backward_on_triton_is_a_named_error",
                  "flce_double_backward_on_the_default_cpu_path_equals_the_reference"],
    "fallback": ["a_runtime_fallback_replans_only_its_op_with_the_loaded_configuration"],
    "leak": ["destroyed_process_groups_are_not_kept_alive"],
    "configuration": ["override_blocks_exited_out_of_order_restore_the_environment",
                      "reload_config_validates_and_applies_the_log_level",
                      "disable_torch_is_an_error_naming_the_reference"],
    "users_view": ["vllm_start_up_reports_every_layer_served_and_left",
                   "graft_info_says_what_the_vllm_integration_leaves_to_vllm"],
}

if __name__ == "__main__":
    from _reproducers import main

    main(GROUPS, sys.argv[1])
