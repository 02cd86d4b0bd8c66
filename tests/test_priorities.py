"""Per-op default backend order (graft.priorities): applied only where no variable chose the
order, only among the backends it names, and reported as the order's source."""
import pytest
import torch

import graft
from graft import priorities


def test_entries_name_known_ops_and_backends(fresh_graft):
    registry = graft.get_registry()
    for entry in priorities.table():
        assert entry["op"] in registry.ops, entry
        backends = {i.backend for i in registry.implementations(entry["op"])}
        assert set(entry["order"]) <= backends, entry
        assert len(entry["source"]) > 20, entry


def test_apply_swaps_only_the_named_backends():
    assert priorities.apply("gemm.w4a16", "cuda", ("hip", "triton", "torch"))[0] == ("triton", "hip", "torch")
    order, why = priorities.apply("gemm.w4a16", "cuda", ("myvendor", "hip", "ck", "triton", "torch"))
    assert order == ("myvendor", "triton", "ck", "hip", "torch") and "dequantizes" in why
    assert priorities.apply("gemm.w4a16", "cpu", ("hip", "triton", "torch")) == (("hip", "triton", "torch"), None)
    assert priorities.apply("gemm.linear", "cuda", ("hip", "triton", "torch")) == (("hip", "triton", "torch"), None)
    assert priorities.apply("fused.rms_norm", "cuda", ("hip", "triton", "torch"))[0] == ("triton", "hip", "torch")
    assert priorities.apply("gemm.w4a16", "cuda", ("hip", "torch")) == (("hip", "torch"), None)


@pytest.mark.parametrize("op", sorted(priorities.PREFERENCES))
def test_default_order_and_its_source_in_explain(fresh_graft, op):
    decision = graft.explain(op, device="cuda", arch="sm_90", dtype=torch.float16)
    order = [c.impl.backend for c in decision.candidates]
    assert order.index("triton") < order.index("hip"), order
    assert decision.source.startswith("default (graft.priorities: "), decision.source


def test_a_variable_still_wins(fresh_graft, monkeypatch):
    monkeypatch.setenv("GRAFT_BACKENDS", "hip,triton,torch")
    decision = graft.explain("gemm.w4a16", device="cuda", arch="sm_90", dtype=torch.float16)
    order = [c.impl.backend for c in decision.candidates]
    assert order.index("hip") < order.index("triton") and decision.source == "GRAFT_BACKENDS", (order, decision.source)
