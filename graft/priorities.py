"""Per-op default backend order: where graft's default (``hip,triton,torch``) would put a
backend first although it is slower than the next one.

Each entry says which backends it reorders, in which order, and where that order came
from. It applies only when no ``GRAFT_*`` variable sets the order for the op (a user's
``GRAFT_BACKENDS``, ``GRAFT_<FAMILY>`` or ``GRAFT_<OP>`` always wins), and it only swaps
the backends it names among the positions they already hold, so a vendor plugin's own
default order (``graft_default_backend_priority``) keeps its other backends where it put
them. ``graft info`` shows the entry's source as the order's origin.

To change an entry, measure both backends on the same inputs in one run (``graft
conformance --device cuda --tags gpu`` gives per-shape ratios) and record the result here.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preference:
    order: tuple  # backends, faster first
    devices: tuple  # device types it applies to
    source: str  # where the order came from


# op -> Preference. Ops not listed follow the global default.
PREFERENCES = {
    "attention.decode_paged": Preference(
        order=("triton", "hip"), devices=("cuda",),
        source="issue 10 review: the HIP kernel is one block per (sequence, head) with no split-K, graft's Triton "
               "kernel is split-K flash-decoding (faster on long contexts); to be confirmed by GPU measurement"),
    "gemm.w4a16": Preference(
        order=("triton", "hip"), devices=("cuda",),
        source="issue 10 review: the HIP kernel dequantizes the whole weight then calls torch.matmul (an extra "
               "full-size write and read of the weight per call), graft's Triton kernel dequantizes in the GEMM's "
               "tiles; to be confirmed by GPU measurement"),
}
# The HIP small-op kernels load one scalar per thread per step (no 128-bit vector loads, no
# several rows per block); the Triton ones load blocked vectors. Until a GPU measurement says
# otherwise, Triton first.
PREFERENCES.update({op: Preference(
    order=("triton", "hip"), devices=("cuda",),
    source=f"issue 24 review: the HIP kernel loads {what} as scalars per thread (no vector loads); graft's Triton "
           f"kernel loads them as blocked vectors; to be confirmed by GPU measurement")
    for op, what in (("fused.rms_norm", "each row"), ("fused.silu_and_mul", "gate and up"),
                     ("moe.topk_routing", "each token's expert scores"))})


def apply(op: str, device_type: str, order: tuple) -> tuple:
    """``(order, source)``: the default ``order`` with ``op``'s preference applied, and the
    preference's source (None when there is none for this op and device)."""
    pref = PREFERENCES.get(op)
    if pref is None or device_type not in pref.devices:
        return tuple(order), None
    slots = [i for i, backend in enumerate(order) if backend in pref.order]
    ranked = [backend for backend in pref.order if backend in order]
    if len(slots) < 2:
        return tuple(order), None
    new = list(order)
    for slot, backend in zip(slots, ranked):
        new[slot] = backend
    return tuple(new), pref.source


def table() -> list:
    """The entries as dicts (``graft info --json`` and docs)."""
    return [{"op": op, "order": list(p.order), "devices": list(p.devices), "source": p.source}
            for op, p in sorted(PREFERENCES.items())]
