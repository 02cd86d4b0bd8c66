"""The reproducers of issue #15 ("Why" list), run in a fresh process per group.

Run by tests/test_reproducers.py as ``python tests/_reproducers.py GROUP``. Each case sets
the environment the reproducer used, reloads graft's configuration, runs the reproducer
and asserts a clear error naming the bad value (and what is valid) or the reference's
result. Prints ``START case`` then ``PASS case`` or ``FAIL case`` with the traceback and
``END case``; a crash leaves a START without its outcome (the test names that case).

Reproducers already run in their own processes elsewhere are not repeated here: bad values
with the checks off on every backend (tests/test_kernel_safety.py: block tables, positions,
expert ids, fp16 MoE overflow, w4a16 inf scale, num_splits=10000), collectives on 2 gloo
ranks (tests/test_collectives.py and the collectives cases of tests/test_fuzz.py).
"""
from __future__ import annotations

import math
import os
import sys
import threading

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _env(**values):
    """Set (None: unset) GRAFT_* variables and rebuild graft's plugin host and configuration."""
    from graft import plugins

    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    plugins.reset()


def _clean():
    for key in [k for k in os.environ if k.startswith("GRAFT_")]:
        del os.environ[key]
    _env()


def _raises(fn, exc_type, *needles):
    """Call ``fn``; it must raise ``exc_type`` whose message contains every needle."""
    try:
        fn()
    except exc_type as exc:
        text = str(exc)
        missing = [n for n in needles if n not in text]
        assert not missing, f"{type(exc).__name__} lacks {missing}: {text}"
        return text
    except Exception as exc:  # noqa: BLE001 - the wrong kind of error is the finding
        raise AssertionError(f"expected {exc_type.__name__}, got {type(exc).__name__}: {exc}") from exc
    raise AssertionError(f"expected {exc_type.__name__} naming {needles}, got a result")


# ------------------------------------------------------------------------------ values (1)


def case_decode_block_table_out_of_range_is_named():
    import graft
    from graft.errors import GraftInputError

    from _safety_cases import _decode_inputs

    _clean()
    for bad in (-1, 6, 1_000_000):  # 6 == num_blocks
        q, k, v, table, lens = _decode_inputs([16, 9])
        table[0, 1] = bad
        _raises(lambda: graft.ops.attention.decode_paged(q, k, v, table, lens), GraftInputError, str(bad))


def case_rotary_positions_out_of_range_are_named_on_every_backend():
    import graft
    from graft.errors import GraftInputError
    from graft.ops import fused

    _clean()
    cache = fused.cos_sin_cache(32, 64)
    for backend in (None, "torch"):  # default selection, and the torch backend (was a bare IndexError)
        _env(GRAFT_FUSED_ROTARY_EMBEDDING=backend)
        for bad in (32, -1, 100_000_000):
            positions = torch.tensor([0, bad, 3])
            q, k = torch.randn(3, 128), torch.randn(3, 64)
            _raises(lambda: graft.ops.fused.rotary_embedding(positions, q, k, 64, cache, True),
                    GraftInputError, str(bad), "32")


def case_expert_id_out_of_range_with_checks_empty_or_off():
    import graft
    from graft.errors import GraftInputError
    from graft.ops import moe

    args, _ = moe.make_moe_inputs(6, 4, 2, 32, 16, "cpu", torch.float32, torch.Generator().manual_seed(0))
    hidden, w13, w2, weights, ids = args
    bad = ids.clone()
    bad[2, 0] = 1 << 30
    _clean()
    _env(GRAFT_CHECK_VALUES="")  # empty = unset = on for CPU tensors
    _raises(lambda: graft.ops.moe.fused_experts(hidden, w13, w2, weights, bad), GraftInputError, str(1 << 30))
    _env(GRAFT_CHECK_VALUES="0")  # unchecked: the slot is skipped, as the reference defines
    out = graft.ops.moe.fused_experts(hidden, w13, w2, weights, bad)
    torch.testing.assert_close(out, moe.fused_experts_reference(hidden, w13, w2, weights, bad), atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------ numerics (6)


def case_nan_eps_and_lr_are_rejected():
    import graft
    from graft.errors import GraftInputError

    _clean()
    x, w = torch.randn(4, 8), torch.ones(8)
    _raises(lambda: graft.ops.fused.rms_norm(x, w, math.nan), GraftInputError, "eps", "nan")
    p = torch.zeros(16)
    _raises(lambda: graft.ops.fused.adam_step(p, torch.ones(16), torch.zeros(16), torch.zeros(16),
                                              math.nan, 0.9, 0.999, 1e-8, 1), GraftInputError, "lr", "nan")


def case_decode_num_splits_10000_equals_reference():
    import graft
    from graft.ops import attention

    from _safety_cases import _decode_inputs

    _clean()
    q, k, v, table, lens = _decode_inputs([16, 9, 5])
    out = graft.ops.attention.decode_paged(q, k, v, table, lens, num_splits=10000)
    torch.testing.assert_close(out, attention.decode_paged_reference(q, k, v, table, lens), atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------ settings (3)


def case_strict_with_a_backend_that_has_no_impl_raises():
    import graft
    from graft.config import op_env_var
    from graft.errors import GraftError
    from graft.plugins import get_registry

    _clean()
    registry = get_registry()
    op = next(o for o in ("fused.adam_step", "loss.fused_linear_cross_entropy", "fused.layer_norm")
              if o in registry.ops and not any(i.backend == "hip" for i in registry.impls[o]))
    assert op == "fused.adam_step", op  # the op the reproducer used has no hip impl
    _env(GRAFT_STRICT="1", **{op_env_var(op): "hip"})
    p = torch.zeros(16)
    _raises(lambda: graft.ops.fused.adam_step(p, torch.ones(16), torch.zeros(16), torch.zeros(16),
                                              1e-3, 0.9, 0.999, 1e-8, 1), GraftError, "hip", op)


def case_empty_booleans_mean_their_default():
    import graft
    from graft.errors import GraftInputError
    from graft.integration import integrations
    from graft.kernels.collectives import _common

    _clean()
    _env(GRAFT_CHECK_VALUES="", GRAFT_COLLECTIVES_VALIDATE="", GRAFT_VLLM="", GRAFT_DEEPSPEED="",
         GRAFT_MEGATRON="", GRAFT_BACKENDS="")
    positions = torch.tensor([0, 99])  # value checks still on: an error, not garbage
    _raises(lambda: graft.ops.fused.rotary_embedding(positions, torch.randn(2, 64), torch.randn(2, 64), 64,
                                                     graft.ops.fused.cos_sin_cache(32, 64), True),
            GraftInputError, "99")
    assert _common.read_settings().validate == "signature"
    for integration in integrations():
        ok, why = integration.status()
        assert not integration.env_var or integration.env_var not in why, (integration.name, why)
    assert graft.ops.gemm.linear(torch.ones(2, 3), torch.ones(4, 3)).shape == (2, 4)  # GRAFT_BACKENDS="" = default


def case_disable_plugins_torch_and_unknown_names_are_clear_errors():
    from graft.errors import GraftConfigError
    from graft.plugins import get_host

    _clean()
    _env(GRAFT_DISABLE_PLUGINS="torch")
    _raises(get_host, GraftConfigError, "torch", "cannot be disabled")
    _env(GRAFT_DISABLE_PLUGINS="tritn")
    _raises(get_host, GraftConfigError, "'tritn'", "triton")  # names the installed plugins


def case_disable_unknown_name_raises_and_integrations_are_off():
    import graft
    from graft.errors import GraftConfigError
    from graft.integration import integrations

    _clean()
    _env(GRAFT_DISABLE="nosuch")
    _raises(lambda: graft.ops.fused.rms_norm(torch.ones(2, 4), torch.ones(4)), GraftConfigError, "'nosuch'")
    for integration in integrations():
        ok, why = integration.status()
        assert not ok and "nosuch" in why, (integration.name, why)


def case_overlap_chunks_huge_is_a_clear_error():
    from graft.errors import GraftConfigError
    from graft.kernels.collectives import _common

    _clean()
    _env(GRAFT_OVERLAP_CHUNKS=str(2**70))
    _raises(_common.read_settings, GraftConfigError, "GRAFT_OVERLAP_CHUNKS", "1024")


# ------------------------------------------------------------------------------ threads (4)


def case_env_snapshot_while_other_threads_change_the_environment():
    from graft import config

    _clean()
    stop = threading.Event()
    errors = []

    def churn():
        i = 0
        while not stop.is_set():
            os.environ[f"REPRO_CHURN_{i % 50}"] = "x"
            os.environ.pop(f"REPRO_CHURN_{(i + 25) % 50}", None)
            i += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    workers = [threading.Thread(target=churn) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        for _ in range(5000):
            try:
                config.env_snapshot()
            except Exception as exc:  # noqa: BLE001 - the finding was a KeyError
                errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        stop.set()
        for w in workers:
            w.join()
        sys.setswitchinterval(old)
    assert not errors, f"{len(errors)} of 5000 snapshots raised, e.g. {errors[0]}"


GROUPS = {
    "values": ["decode_block_table_out_of_range_is_named", "rotary_positions_out_of_range_are_named_on_every_backend",
               "expert_id_out_of_range_with_checks_empty_or_off"],
    "numerics": ["nan_eps_and_lr_are_rejected", "decode_num_splits_10000_equals_reference"],
    "settings": ["strict_with_a_backend_that_has_no_impl_raises", "empty_booleans_mean_their_default",
                 "disable_plugins_torch_and_unknown_names_are_clear_errors",
                 "disable_unknown_name_raises_and_integrations_are_off", "overlap_chunks_huge_is_a_clear_error"],
    "threads": ["env_snapshot_while_other_threads_change_the_environment"],
}


def main(groups: dict, group: str) -> None:
    """Run one group's cases, printing START/PASS/FAIL/END (tests/test_reproducers.py reads them)."""
    import traceback

    failed = False
    for case in groups[group]:
        print(f"START {case}", flush=True)
        try:
            sys.modules["__main__"].__dict__[f"case_{case}"]()
        except Exception:  # noqa: BLE001 - reported per case
            failed = True
            print(f"FAIL {case}\n{traceback.format_exc()}\nEND {case}", flush=True)
        else:
            print(f"PASS {case}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main(GROUPS, sys.argv[1])
