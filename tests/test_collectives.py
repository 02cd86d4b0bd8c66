"""Collectives on 2 and 4 gloo ranks over loopback: every op and implementation against
the plain library collective and against values each rank recomputes locally, plus
the cross-rank error paths (dtype mismatch, wrong shape: a clear error on every rank,
no hang). Each spawned run has a process-level timeout (tests/_dist_helpers.py) below
the pytest-timeout one."""
from __future__ import annotations

import os

import pytest
import torch

from _dist_helpers import run_ranks

pytestmark = [pytest.mark.multiprocess]

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------- in-rank helpers
def make(rank, shape, dtype=torch.float32, salt=0):
    """Rank r's deterministic input: every rank can rebuild every other rank's."""
    gen = torch.Generator().manual_seed(7919 * salt + rank)
    return torch.randn(shape, generator=gen).to(dtype)


def fixed_order_reduce(tensors, op, dtype):
    from graft.kernels.collectives._common import reduce_rows

    return reduce_rows(torch.stack([t.reshape(-1) for t in tensors]), op, dtype).view(tensors[0].shape)


def close(got, want, dtype, what):
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def reset_graft(**env):
    from graft import plugins

    for key in list(os.environ):
        if key.startswith("GRAFT_") and key not in ("GRAFT_LOG_LEVEL", "GRAFT_DISABLE_PLUGINS"):
            del os.environ[key]
    os.environ.update(env)
    import graft

    graft.reload_config()
    plugins.reset()


# ----------------------------------------------------------------------------- workers
def w_all_reduce(rank, ws):
    from graft import dispatch
    from graft.kernels.collectives import all_reduce
    from graft.ops import collectives as C

    reset_graft()
    checked = 0
    for salt, shape in enumerate([(1,), (1023,), (7, 33), (2, 3, 5)]):
        for dtype in FLOATS:
            for op in ("sum", "max", "min"):
                inputs = [make(r, shape, dtype, salt) for r in range(ws)]
                x = inputs[rank]
                want = fixed_order_reduce(inputs, op, dtype)
                lib = C.all_reduce(x, None, op)  # default on CPU: the library collective
                one = all_reduce.all_reduce(x, None, op, "oneshot")
                two = all_reduce.all_reduce(x, None, op, "twoshot")
                assert one.shape == two.shape == lib.shape == x.shape
                # Fixed rank order: both algorithms give the same bits as the local recomputation.
                assert torch.equal(one, want), (shape, dtype, op)
                assert torch.equal(two, want), (shape, dtype, op)
                if ws == 2 or op != "sum" or dtype == torch.float32:
                    # 2 ranks: a+b == b+a exactly; max/min are exact anyway.
                    exact = ws == 2 or op != "sum"
                    if exact and dtype == torch.float32:
                        assert torch.equal(lib, want), (shape, dtype, op)
                close(lib, want, dtype, f"library {shape} {dtype} {op}")
                assert torch.equal(x, inputs[rank]), "input was modified"
                checked += 1
    # Selection: on the CPU the custom algorithms are opt-in; thresholds route by size.
    small, mid, big = (make(rank, (n,), torch.float32, 9) for n in (64, 512, 4096))
    assert dispatch.select("collectives.all_reduce", small, None, "sum").backend == "torch"
    reset_graft(GRAFT_COLLECTIVES_ALL_REDUCE="oneshot,twoshot,torch",
                GRAFT_CUSTOM_ALLREDUCE_MAX_BYTES="1024", GRAFT_TWOSHOT_ALLREDUCE_MAX_BYTES="4KiB")
    chosen = [dispatch.select("collectives.all_reduce", t, None, "sum").backend for t in (small, mid, big)]
    assert chosen == ["oneshot", "twoshot", "torch"], chosen
    for t in (small, mid, big):  # the dispatched result is right whichever impl served it
        want = fixed_order_reduce([make(r, t.shape, torch.float32, 9) for r in range(ws)], "sum", torch.float32)
        close(C.all_reduce(t), want, torch.float32, "dispatched")
    reset_graft(GRAFT_COLLECTIVES_ALL_REDUCE="twoshot", GRAFT_CUSTOM_ALLREDUCE_MAX_WORLD="1")
    assert dispatch.select("collectives.all_reduce", small, None, "sum").backend == "torch"
    reset_graft()
    return checked


def w_gather_scatter(rank, ws):
    from graft import dispatch
    from graft.kernels.collectives.all_gather_quantized import error_bound
    from graft.ops import collectives as C

    reset_graft(GRAFT_QUANTIZED_GATHER_MIN_BYTES="0")
    for dtype in FLOATS:
        # even all-gather, including a 1-D and a 3-D input
        for salt, shape in enumerate([(5, 17), (3,), (2, 3, 4)]):
            inputs = [make(r, shape, dtype, salt) for r in range(ws)]
            assert torch.equal(C.all_gather(inputs[rank]), torch.cat(inputs))
        # uneven all-gather: rank-dependent row counts, one rank may contribute nothing
        sizes = [(3 * r + 2) % 5 for r in range(ws)]
        inputs = [make(r, (sizes[r], 6), dtype, 11) for r in range(ws)]
        assert torch.equal(C.all_gather(inputs[rank], None, sizes), torch.cat(inputs))
        # even reduce-scatter (sum, max)
        for op in ("sum", "max"):
            inputs = [make(r, (3 * ws, 7), dtype, 12) for r in range(ws)]
            want = fixed_order_reduce(inputs, op, dtype)[3 * rank : 3 * rank + 3]
            close(C.reduce_scatter(inputs[rank], None, op), want, dtype, f"reduce_scatter {op}")
        # uneven reduce-scatter
        sizes = [r + 1 for r in range(ws)]
        inputs = [make(r, (sum(sizes), 4), dtype, 13) for r in range(ws)]
        start = sum(sizes[:rank])
        want = fixed_order_reduce(inputs, "sum", dtype)[start : start + sizes[rank]]
        close(C.reduce_scatter(inputs[rank], None, "sum", sizes), want, dtype, "uneven reduce_scatter")
        # quantized all-gather: within the documented bound of the exact gather, and really lossy
        for block in (64, 128):
            inputs = [make(r, (3, 200), dtype, 14) * (r + 1) for r in range(ws)]
            assert dispatch.select("collectives.all_gather_quantized", inputs[rank], None, block).backend == "int8"
            got = C.all_gather_quantized(inputs[rank], None, block)
            exact = torch.cat(inputs)
            bound = torch.cat([error_bound(t, block) for t in inputs])
            err = (got.float() - exact.float()).abs()
            assert got.dtype == dtype and got.shape == exact.shape
            assert bool((err <= bound).all()), f"{dtype} block {block}: max excess {(err - bound).max()}"
            if dtype == torch.float32:
                assert not torch.equal(got, exact), "int8 path should be lossy on random fp32 data"
            # the reference (GRAFT_DISABLE=collectives) is the exact gather
        reset_graft(GRAFT_DISABLE="int8")
        assert torch.equal(C.all_gather_quantized(inputs[rank], None, 64), torch.cat(inputs))
        reset_graft()  # default threshold: a small input is gathered exactly
        assert dispatch.select("collectives.all_gather_quantized", inputs[rank], None, 64).backend == "torch"
        reset_graft(GRAFT_QUANTIZED_GATHER_MIN_BYTES="0")
    return True


def w_overlap(rank, ws):
    from graft import dispatch
    from graft.kernels.collectives import overlap
    from graft.ops import collectives as C

    reset_graft(GRAFT_COLLECTIVES="overlap,torch", GRAFT_OVERLAP_MIN_BYTES="0")
    results = []
    for dtype in FLOATS:
        for rows, k, n, chunks in [(5, 24, 20, 4), (8, 16, 9, 3), (1, 8, 8, 4)]:
            # row-parallel: a [ws*rows, k_local] with a rank-dependent k_local (uneven shards)
            k_local = k + rank
            a = make(rank, (ws * rows, k_local), dtype, 20)
            b = make(rank, (k_local, n), dtype, 21)
            want = C._gemm_reduce_scatter_ref(a, b)
            got = overlap.gemm_reduce_scatter(a, b, None, chunks)
            # all-gather + GEMM: b's n_local is rank dependent
            a2 = make(rank, (rows, k), dtype, 22)
            b2 = make(rank, (k, n + rank), dtype, 23)
            want2 = C._all_gather_gemm_ref(a2, b2)
            got2 = overlap.all_gather_gemm(a2, b2, None, chunks)
            assert got.shape == want.shape and got2.shape == want2.shape
            if dtype == torch.float32 and ws == 2:
                # Bits must match when the BLAS gives the chunk GEMMs the full GEMM's row bits.
                pieces = overlap._pieces(rows, chunks)
                blocks = a.view(ws, rows, k_local)
                full = a @ b
                rs_rows_ok = all(torch.equal(blocks[:, s:e].reshape(-1, k_local) @ b,
                                             full.view(ws, rows, n)[:, s:e].reshape(-1, n)) for s, e in pieces)
                gathered = torch.cat([make(r, (rows, k), dtype, 22) for r in range(ws)]).view(ws, rows, k)
                full2 = gathered.view(-1, k) @ b2
                ag_rows_ok = all(torch.equal(gathered[:, s:e].reshape(-1, k) @ b2,
                                             full2.view(ws, rows, -1)[:, s:e].reshape(-1, full2.shape[1]))
                                 for s, e in pieces)
                results.append((rs_rows_ok, torch.equal(got, want), ag_rows_ok, torch.equal(got2, want2)))
            close(got, want, dtype, f"gemm_reduce_scatter rows={rows} chunks={chunks}")
            close(got2, want2, dtype, f"all_gather_gemm rows={rows} chunks={chunks}")
            backend = dispatch.select("collectives.gemm_reduce_scatter", a, b, None).backend
            assert backend == ("overlap" if rows >= 2 else "torch"), (rows, backend)
            close(C.gemm_reduce_scatter(a, b), want, dtype, "dispatched gemm_reduce_scatter")
            close(C.all_gather_gemm(a2, b2), want2, dtype, "dispatched all_gather_gemm")
    # Defaults: small problems and (on the CPU) unnamed overlap go to the reference.
    a3, b3 = make(rank, (8, 16)), make(rank, (16, 9))
    reset_graft()
    assert dispatch.select("collectives.all_gather_gemm", a3, b3, None).backend == "torch"
    reset_graft(GRAFT_OVERLAP_MIN_BYTES="0")
    assert dispatch.select("collectives.all_gather_gemm", a3, b3, None).backend == "torch"
    reset_graft(GRAFT_OVERLAP_MIN_BYTES="0", GRAFT_COLLECTIVES_ALL_GATHER_GEMM="overlap")
    assert dispatch.select("collectives.all_gather_gemm", a3, b3, None).backend == "overlap"
    return results


def w_custom_op_checks(rank, ws):
    from torch.fx.experimental.proxy_tensor import make_fx

    from graft.kernels.collectives import all_reduce, overlap, all_gather_quantized
    from graft.kernels.collectives._common import group_name

    reset_graft()
    name = group_name()
    x = make(rank, (4, 6))
    a, b = make(rank, (2 * ws, 5)), make(rank, (5, 3))
    cases = [
        (all_reduce.oneshot_op, (x, "sum", name)),
        (all_reduce.twoshot_op, (x, "max", name)),
        (all_gather_quantized.int8_op, (x, 4, name)),
        (overlap.gemm_reduce_scatter_op, (a, b, 2, name)),
        (overlap.all_gather_gemm_op, (a, b, 2, name)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
        graph = make_fx(lambda *t, _op=op, _rest=args[len([v for v in args if isinstance(v, torch.Tensor)]):]:
                        _op(*t, *_rest), tracing_mode="fake")(*[v for v in args if isinstance(v, torch.Tensor)])
        assert any("graft" in str(node.target) for node in graph.graph.nodes), graph.code

    def layer(t):
        return all_reduce.oneshot_op(t * 2, "sum", name) + 1

    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x))
    return run_op_cases()


def run_op_cases():
    """Every quick OpCase of the family, every registered implementation forced by name,
    against the op's reference (the multi-process half of graft's conformance)."""
    from graft import dispatch
    from graft.kernels.collectives.all_gather_quantized import error_bound
    from graft.ops import collectives as C
    from graft.plugins import get_registry

    ran = 0
    for case in C.CASES:
        if "quick" not in case.tags:
            continue
        backends = [i.backend for i in get_registry().implementations(case.op)]
        for dtype in case.dtypes:
            args, kwargs = case.inputs("cpu", dtype)
            want = get_registry().op(case.op).reference(*args, **kwargs)
            for backend in backends:
                reset_graft(**{"GRAFT_" + case.op.upper().replace(".", "_"): backend, "GRAFT_STRICT": "1",
                               "GRAFT_OVERLAP_MIN_BYTES": "0", "GRAFT_QUANTIZED_GATHER_MIN_BYTES": "0"})
                assert dispatch.select(case.op, *args, **kwargs).backend == backend, (case.id, backend)
                got = dispatch.call(case.op, *args, **kwargs)
                if backend == "int8":
                    # blocks are per rank: bound each rank's slice of the exact gather
                    world = torch.distributed.get_world_size()
                    bound = torch.cat([error_bound(part, args[2]) for part in want.chunk(world)])
                    assert bool(((got.float() - want.float()).abs() <= bound).all()), case.id
                else:
                    close(got, want, dtype, f"{case.id} {backend}")
                ran += 1
    reset_graft()
    return ran


def _catch(fn):
    from graft.errors import GraftInputError

    try:
        fn()
    except GraftInputError as exc:
        return str(exc)
    return "NO ERROR"


def w_errors(rank, ws):
    from graft.ops import collectives as C

    reset_graft()
    texts = {}
    # dtype mismatch across ranks
    texts["dtype"] = _catch(lambda: C.all_reduce(make(rank, (4,), torch.float32 if rank == 0 else torch.bfloat16)))
    # one rank passes a wrong shape
    texts["shape"] = _catch(lambda: C.all_gather(make(rank, (3, 5 + (rank == ws - 1)))))
    # one rank's input fails its local check (int64): the others must not hang
    texts["local"] = _catch(lambda: C.reduce_scatter(torch.ones(2 * ws, dtype=torch.int64) if rank == 1
                                                     else make(rank, (2 * ws,))))
    # ranks call different collectives
    texts["op"] = _catch(lambda: C.all_reduce(make(rank, (4,))) if rank == 0 else C.all_gather(make(rank, (4,))))
    # gemm: k_local may differ (fine), M may not
    texts["gemm"] = _catch(lambda: C.gemm_reduce_scatter(make(rank, (2 * ws + 2 * rank, 3)), make(rank, (3, 4))))
    # a local error every rank sees the same way (no exchange needed)
    texts["rows"] = _catch(lambda: C.reduce_scatter(make(rank, (2 * ws + 1, 3))))
    # after all that, the group still works
    total = C.all_reduce(torch.ones(3))
    assert torch.equal(total, torch.full((3,), float(ws)))
    return texts


def w_four_ranks(rank, ws):
    from graft.kernels.collectives import all_reduce, overlap
    from graft.ops import collectives as C

    reset_graft()
    for dtype in (torch.float32, torch.bfloat16):
        inputs = [make(r, (1001,), dtype, 30) for r in range(ws)]  # numel not divisible by 4
        want = fixed_order_reduce(inputs, "sum", dtype)
        assert torch.equal(all_reduce.all_reduce(inputs[rank], None, "sum", "oneshot"), want)
        assert torch.equal(all_reduce.all_reduce(inputs[rank], None, "sum", "twoshot"), want)
        close(C.all_reduce(inputs[rank]), want, dtype, "library 4 ranks")
        sizes = [0, 3, 1, 2]
        inputs = [make(r, (6, 5), dtype, 31) for r in range(ws)]
        start = sum(sizes[:rank])
        close(C.reduce_scatter(inputs[rank], None, "sum", sizes),
              fixed_order_reduce(inputs, "sum", dtype)[start : start + sizes[rank]], dtype, "uneven rs")
        gathered = [make(r, (sizes[r], 2), dtype, 32) for r in range(ws)]
        assert torch.equal(C.all_gather(gathered[rank], None, sizes), torch.cat(gathered))
        a, b = make(rank, (4 * 3, 10 + rank), dtype, 33), make(rank, (10 + rank, 6), dtype, 34)
        close(overlap.gemm_reduce_scatter(a, b, None, 2), C._gemm_reduce_scatter_ref(a, b), dtype, "rs overlap")
        a2, b2 = make(rank, (5, 8), dtype, 35), make(rank, (8, 3), dtype, 36)
        close(overlap.all_gather_gemm(a2, b2, None, 3), C._all_gather_gemm_ref(a2, b2), dtype, "ag overlap")
    return _catch(lambda: C.all_reduce(make(rank, (4 + (rank == 2),))))


def _agreements(pg=None):
    import torch.distributed as dist

    from graft.kernels.collectives import agreement

    return agreement._seq.get(pg or dist.group.WORLD, 0)


def w_plans_async_agreement(rank, ws):
    import time

    import torch.distributed as dist

    from graft.kernels.collectives._common import Work
    from graft.kernels.collectives.all_gather_quantized import error_bound
    from graft.ops import collectives as C

    out = {}
    reset_graft()
    # Once per signature: the second call of a signature exchanges nothing.
    x = make(rank, (64,))
    C.all_reduce(x)
    seen = _agreements()
    for _ in range(3):
        C.all_reduce(x)
        C.all_reduce_(x.clone())
    out["repeat_exchanges"] = _agreements() - seen
    C.all_reduce(make(rank, (65,)))  # a new shape is a new signature
    out["new_shape_exchanges"] = _agreements() - seen
    reset_graft(GRAFT_COLLECTIVES_VALIDATE="always")
    seen = _agreements()
    for _ in range(3):
        C.all_reduce(x)
    out["always_exchanges"] = _agreements() - seen

    # async_op=True: a real handle; the call returns before the peer has even called.
    reset_graft()
    t = torch.full((1000,), float(rank + 1))
    C.all_reduce_(t.clone())  # agree on the signature first (the agreement itself is blocking)
    dist.barrier()
    if rank == 1:
        time.sleep(1.0)
    start = time.perf_counter()
    work = C.all_reduce_(t, async_op=True)
    out["async_return_s"] = time.perf_counter() - start
    assert isinstance(work, Work)
    work.wait()
    out["async_wait_s"] = time.perf_counter() - start
    assert torch.equal(t, torch.full((1000,), float(ws * (ws + 1) / 2)))
    gathered = torch.empty(ws * 4)
    C.all_gather_into(gathered, torch.full((4,), float(rank)), async_op=True).wait()
    assert torch.equal(gathered, torch.arange(ws).repeat_interleave(4).float())
    scattered = torch.empty(3)
    w = C.reduce_scatter_into(scattered, torch.arange(3.0 * ws), async_op=True)
    assert w.wait() and w.is_completed()
    assert torch.equal(scattered, ws * torch.arange(3.0 * rank, 3.0 * rank + 3))
    # graft's own algorithm in place (copied back; the handle is complete)
    reset_graft(GRAFT_COLLECTIVES_ALL_REDUCE="oneshot")
    t = torch.full((8,), float(rank + 1))
    C.all_reduce_(t, async_op=True).wait()
    assert torch.equal(t, torch.full((8,), float(ws * (ws + 1) / 2)))

    # Ranks configured differently: a clear error on every rank, not a hang.
    reset_graft(**({"GRAFT_COLLECTIVES_ALL_REDUCE": "oneshot"} if rank == 0 else {}))
    out["algorithm"] = _catch(lambda: C.all_reduce(make(rank, (16,))))
    reset_graft(**({"GRAFT_CUSTOM_ALLREDUCE_MAX_BYTES": "1KiB"} if rank == 1 else {}))
    out["threshold"] = _catch(lambda: C.all_reduce(make(rank, (16,))))
    # "Validation off" still agrees on a new signature: a shape mismatch is an error, not an abort.
    reset_graft(GRAFT_COLLECTIVES_VALIDATE="0")
    out["shape_off"] = _catch(lambda: C.all_reduce(make(rank, (40 + rank,))))

    # int8 gather: NaN and +-Inf arrive exactly as the exact gather delivers them.
    reset_graft(GRAFT_QUANTIZED_GATHER_MIN_BYTES="0")
    inputs = []
    for r in range(ws):
        v = make(r, (4, 64), salt=40) * 3
        v[r, 5], v[2, 7 + r], v[3, 0] = float("nan"), float("inf"), float("-inf")
        inputs.append(v)
    got = C.all_gather_quantized(inputs[rank], None, 32)
    exact = torch.cat(inputs)
    assert torch.equal(torch.isnan(got), torch.isnan(exact))
    inf = torch.isinf(exact)
    assert torch.equal(torch.isinf(got), inf) and torch.equal(got[inf], exact[inf])
    finite = torch.isfinite(exact)
    bound = torch.cat([error_bound(v, 32) for v in inputs])
    assert bool(((got - exact).abs()[finite] <= bound[finite]).all())
    out["int8_differ"] = int((~finite).sum())
    reset_graft()
    assert torch.equal(C.all_reduce(torch.ones(3)), torch.full((3,), float(ws)))  # the group still works
    return out


def w_peer_skips(rank, ws):
    import time

    from graft.errors import GraftCollectiveError
    from graft.ops import collectives as C

    reset_graft(GRAFT_COLLECTIVES_TIMEOUT="3")
    x = make(rank, (32,))
    C.all_reduce(x)  # both agree on this signature
    start = time.perf_counter()
    try:
        if rank == 0:
            C.all_reduce(x)  # rank 1 never calls this one
        else:
            C.all_gather(make(rank, (5, 3)))  # it skipped ahead to its next collective
        text = "NO ERROR"
    except GraftCollectiveError as exc:
        text = str(exc)
    return text, time.perf_counter() - start


def w_agreed_versus_new_signature(rank, ws):
    """Rank 0 calls a signature both agreed on; rank 1 a new one: no per-call exchange sees
    it, so both time out, and the failure path names both calls through the store."""
    from graft.errors import GraftCollectiveError
    from graft.ops import collectives as C

    reset_graft(GRAFT_COLLECTIVES_TIMEOUT="3")
    C.all_reduce(make(rank, (32,)))  # agreed by both
    try:
        C.all_reduce(make(rank, (32,) if rank == 0 else (40,)))
        return "NO ERROR"
    except GraftCollectiveError as exc:
        return str(exc)


# ----------------------------------------------------------------------------- tests
@pytest.mark.timeout(150)
def test_all_reduce_algorithms_and_selection_2_ranks():
    counts = run_ranks(w_all_reduce, 2, timeout=130)
    assert counts[0] == counts[1] == 4 * 3 * 3


@pytest.mark.timeout(120)
def test_all_gather_reduce_scatter_quantized_2_ranks():
    assert run_ranks(w_gather_scatter, 2, timeout=100) == [True, True]


@pytest.mark.timeout(120)
def test_gemm_collective_overlap_matches_non_overlapped_2_ranks():
    results = run_ranks(w_overlap, 2, timeout=100)
    # fp32 on 2 ranks: rows are split, never K, and a+b is order-free: the same bits
    # wherever the BLAS computes a row block's rows like the full GEMM's.
    flat = [r for rank_results in results for r in rank_results]
    assert all(equal for rows_ok, equal, _, _ in flat if rows_ok), flat
    assert all(equal for _, _, rows_ok, equal in flat if rows_ok), flat
    assert any(rows_ok for rows_ok, _, _, _ in flat), "no bitwise case exercised"


@pytest.mark.timeout(150)
def test_custom_ops_opcheck_fake_tracing_compile_and_cases_2_ranks():
    ran = run_ranks(w_custom_op_checks, 2, timeout=130)
    # 8 quick cases x 3 dtypes: 3 all_reduce cases x (torch, oneshot, twoshot), all_gather and
    # reduce_scatter x torch, quantized gather and the two overlap ops x (torch, optimized).
    assert ran == [3 * (3 * 3 + 1 + 1 + 3 * 2)] * 2, ran


@pytest.mark.timeout(120)
def test_mismatched_inputs_raise_clearly_on_every_rank():
    texts = run_ranks(w_errors, 2, timeout=100)
    for rank, t in enumerate(texts):
        assert "NO ERROR" not in t.values(), (rank, t)
        assert "float32" in t["dtype"] and "bfloat16" in t["dtype"] and "rank 1" in t["dtype"], t["dtype"]
        assert "(3, 5)" in t["shape"] and "(3, 6)" in t["shape"], t["shape"]
        assert "rank(s) 1 rejected" in t["local"] and "int64" in t["local"], t["local"]
        assert "collectives.all_reduce" in t["op"] and "collectives.all_gather" in t["op"], t["op"]
        assert "(4, *)" in t["gemm"] and "(6, *)" in t["gemm"], t["gemm"]
        assert "not divisible by the world size 2" in t["rows"], t["rows"]


@pytest.mark.timeout(200)
def test_four_ranks_uneven_sizes_and_wrong_shape():
    texts = run_ranks(w_four_ranks, 4, timeout=180)
    for t in texts:
        assert "rank 2: device cpu, x float32 (5,)" in t, t


@pytest.mark.timeout(120)
def test_plans_async_handles_and_rank_disagreements_2_ranks():
    results = run_ranks(w_plans_async_agreement, 2, timeout=100)
    for rank, r in enumerate(results):
        assert r["repeat_exchanges"] == 0 and r["new_shape_exchanges"] == 1, r
        assert r["always_exchanges"] == 3, r
        assert "selected different algorithms" in r["algorithm"] and "oneshot" in r["algorithm"], r["algorithm"]
        assert "torch" in r["algorithm"], r["algorithm"]
        assert "GRAFT_CUSTOM_ALLREDUCE_MAX_BYTES: rank 0: 524288, rank 1: 1024" in r["threshold"], r["threshold"]
        assert "(40,)" in r["shape_off"] and "(41,)" in r["shape_off"], r["shape_off"]
        assert r["int8_differ"] == 6
    # rank 0's async call returned while rank 1 was still asleep; its wait() then waited
    assert results[0]["async_return_s"] < 0.5 and results[0]["async_wait_s"] > 0.6, results[0]


@pytest.mark.timeout(90)
def test_peer_that_skips_a_call_times_out_clearly_on_both_ranks():
    from datetime import timedelta

    results = run_ranks(w_peer_skips, 2, timeout=70, pg_timeout=timedelta(seconds=8))
    (text0, t0), (text1, t1) = results
    assert "collectives.all_reduce" in text0 and "did not complete within 3 s (GRAFT_COLLECTIVES_TIMEOUT)" in text0
    assert "group '0'" in text0 and "global ranks 0, 1" in text0, text0
    assert "collectives.all_gather" in text1 and "rank(s) 0 did not reach this call (" in text1, text1
    assert "within 3 s (GRAFT_COLLECTIVES_TIMEOUT)" in text1, text1
    assert "rank 1 is waiting to agree on collectives.all_gather: device cpu, x float32 (5, 3)" in text0, text0
    assert 2.5 < t0 < 8 and 2.5 < t1 < 8, (t0, t1)


# ----------------------------------------------------------------------------- no ranks needed
def test_settings_parse_once_and_reject_bad_values(monkeypatch):
    import graft
    from graft import plugins
    from graft.errors import GraftConfigError
    from graft.kernels.collectives import _common

    monkeypatch.setenv("GRAFT_CUSTOM_ALLREDUCE_MAX_BYTES", "256KiB")
    plugins.reset()
    assert _common.oneshot_max_bytes() == 256 * 1024
    # Read once per configuration generation: a change shows after a reload only (this
    # suite's monkeypatch reloads by itself, so change os.environ behind its back).
    os.environ["GRAFT_CUSTOM_ALLREDUCE_MAX_BYTES"] = "1KiB"
    assert _common.oneshot_max_bytes() == 256 * 1024
    graft.reload_config()
    assert _common.oneshot_max_bytes() == 1024
    for bad in ("lots", "-5", "1.5MiB"):
        monkeypatch.setenv("GRAFT_CUSTOM_ALLREDUCE_MAX_BYTES", bad)
        with pytest.raises(GraftConfigError, match="GRAFT_CUSTOM_ALLREDUCE_MAX_BYTES"):
            _common.read_settings()
    monkeypatch.delenv("GRAFT_CUSTOM_ALLREDUCE_MAX_BYTES")
    for value, match in (("0", ">= 1"), (str(2**70), "<= 1024")):
        monkeypatch.setenv("GRAFT_OVERLAP_CHUNKS", value)
        with pytest.raises(GraftConfigError, match=match):
            _common.read_settings()
    monkeypatch.delenv("GRAFT_OVERLAP_CHUNKS")
    for value, mode in (("", "signature"), ("1", "signature"), ("0", "signature"), ("always", "always")):
        monkeypatch.setenv("GRAFT_COLLECTIVES_VALIDATE", value)
        assert _common.read_settings().validate == mode, value
    monkeypatch.setenv("GRAFT_COLLECTIVES_VALIDATE", "sometimes")
    with pytest.raises(GraftConfigError, match="'signature'.*'always'"):
        _common.read_settings()
    monkeypatch.delenv("GRAFT_COLLECTIVES_VALIDATE")
    for bad in ("-1", "soon", "nan", "inf"):
        monkeypatch.setenv("GRAFT_COLLECTIVES_TIMEOUT", bad)
        with pytest.raises(GraftConfigError, match="GRAFT_COLLECTIVES_TIMEOUT"):
            _common.read_settings()
    monkeypatch.setenv("GRAFT_COLLECTIVES_TIMEOUT", "2.5")
    assert _common.read_settings().timeout_s == 2.5
    monkeypatch.delenv("GRAFT_COLLECTIVES_TIMEOUT")
    plugins.reset()


def test_symmetric_memory_declared_limits():
    from graft.kernels.collectives.all_reduce import symm_mem_reason

    ok = dict(device_type="cuda", dtype=torch.float32, numel=1024, element_size=4, storage_offset=0,
              world_size=4, reduce_op="sum")
    assert symm_mem_reason("oneshot", **ok) is None and symm_mem_reason("twoshot", **ok) is None
    assert "float32 and bfloat16" in symm_mem_reason("oneshot", **dict(ok, dtype=torch.float16, element_size=2))
    assert "only sum" in symm_mem_reason("oneshot", **dict(ok, reduce_op="max"))
    assert "CUDA" in symm_mem_reason("oneshot", **dict(ok, device_type="cpu"))
    assert "two-shot kernel is built for 2, 4, 8" in symm_mem_reason("twoshot", **dict(ok, world_size=3))
    assert symm_mem_reason("oneshot", **dict(ok, world_size=3)) is None  # one-shot has a generic kernel
    bf16_odd = dict(ok, dtype=torch.bfloat16, element_size=2, numel=1023)
    assert "multiple of 4" in symm_mem_reason("oneshot", **bf16_odd)
    assert "aligned like its staging buffer" in symm_mem_reason("oneshot", **dict(ok, storage_offset=1))
    assert symm_mem_reason("oneshot", **dict(ok, storage_offset=4)) is None  # 16-byte offset


def test_int8_roundtrip_keeps_nan_and_inf_exactly():
    from graft.kernels.collectives.all_gather_quantized import dequantize, error_bound, quantize

    for dtype in FLOATS:
        x = (torch.randn(4, 64, generator=torch.Generator().manual_seed(1)) * 5).to(dtype)
        x[0, 3], x[1, 0], x[1, 1], x[2, 63] = float("nan"), float("inf"), float("-inf"), float("nan")
        x[3] = float("inf")  # a block with nothing finite
        q, s = quantize(x, 32)
        y = dequantize(q, s, x.numel(), x.shape, x.dtype)
        assert torch.equal(torch.isnan(y), torch.isnan(x)) and torch.equal(torch.isinf(y), torch.isinf(x))
        inf = torch.isinf(x)
        assert torch.equal(y[inf], x[inf])
        finite = torch.isfinite(x)
        err = (y.float() - x.float()).abs()
        assert bool((err[finite] <= error_bound(x, 32)[finite]).all())
        # the rest of a block holding a NaN keeps its precision (the scale ignores non-finite values)
        assert bool(torch.isfinite(error_bound(x, 32)).all()) and float(err[0, :32][finite[0, :32]].max()) < 0.1


@pytest.mark.parametrize("dtype", FLOATS)
def test_int8_roundtrip_within_bound(dtype):
    from graft.kernels.collectives.all_gather_quantized import dequantize, error_bound, quantize

    x = (torch.randn(7, 131, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    x[0] = 0  # an all-zero block must survive exactly
    for block in (1, 32, 128, 1000):
        q, s = quantize(x, block)
        y = dequantize(q, s, x.numel(), x.shape, x.dtype)
        assert bool(((y.float() - x.float()).abs() <= error_bound(x, block)).all())
        assert torch.equal(y[0], x[0])


def test_pieces_cover_rows_once():
    from graft.kernels.collectives.overlap import _pieces

    for rows in (1, 2, 5, 17):
        for chunks in (1, 3, 4, 40):
            pieces = _pieces(rows, chunks)
            assert [i for s, e in pieces for i in range(s, e)] == list(range(rows))
            assert all(e > s for s, e in pieces) and len(pieces) == min(rows, chunks)


def test_ops_without_process_group_say_so():
    from graft.errors import GraftInputError
    from graft.ops import collectives as C

    with pytest.raises(GraftInputError, match="not initialized"):
        C.all_reduce(torch.ones(3))


@pytest.mark.timeout(90)
def test_agreed_signature_against_a_new_one_names_both_calls():
    from datetime import timedelta

    text0, text1 = run_ranks(w_agreed_versus_new_signature, 2, timeout=70, pg_timeout=timedelta(seconds=8))
    assert "did not complete within 3 s" in text0, text0
    assert "rank 1 is waiting to agree on collectives.all_reduce: device cpu, x float32 (40,)" in text0, text0
    assert "rank(s) 0 did not reach this call (collectives.all_reduce: device cpu, x float32 (40,)" in text1, text1


def test_fused_collectives_name_a_failed_communication(fresh_graft):
    """The fused collectives go through dispatch's C entry; a communication failure inside
    their implementation still surfaces as graft's collective error (other errors as they
    are), as through the plans of graft.kernels.collectives.fastpath."""
    import graft
    from graft.tools.bench.ops import one_rank_group, stubbed
    from graft.errors import GraftError
    from graft.ops import collectives as C

    a, b = torch.randn(4, 8), torch.randn(8, 6)
    with one_rank_group() as grouped:
        if not grouped:
            pytest.skip("a process group exists in this process")
        torch.testing.assert_close(C.gemm_reduce_scatter(a, b), a @ b)
        impl = graft.select("collectives.gemm_reduce_scatter", a, b, None)
        for message, raised in (("Connection closed by peer", GraftError), ("an unrelated bug", RuntimeError)):
            def fail(*args, message=message):
                raise RuntimeError(message)

            with stubbed(impl, None):  # (restores the implementation, and what dispatch remembered, after)
                object.__setattr__(impl, "fn", fail)
                for _ in range(2):  # the Python entry (first call), then the C entry
                    with pytest.raises(raised) as info:
                        C.gemm_reduce_scatter(a, b)
                    assert isinstance(info.value, GraftError) == (raised is GraftError)
                    assert message in str(info.value)
                    if raised is GraftError:
                        assert "collectives.gemm_reduce_scatter" in str(info.value)
        torch.testing.assert_close(C.gemm_reduce_scatter(a, b), a @ b)
