"""Compare an implementation's output with the reference's, element by element.

Outputs may be a tensor, a tuple/list of tensors (compared pairwise, each with the
tolerance of its own dtype), or plain Python values (compared exactly). The result
records the max abs/rel error and the worst element, the one that exceeds its bound
by the largest factor (or, when everything passes, the one with the largest error),
with its index and both values, so a failure message pins the problem down.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from graft.tools.conformance.tolerances import Tolerance
from graft.platform import dtype_name

# Relative errors are reported only where |expected| is at least this fraction of the output's
# RMS: next to zero, relative error says nothing (the RMS-relative atol governs there).
_REL_FLOOR = 1e-2


@dataclass
class TensorComparison:
    output: str  # "out", "out[1]" ...
    ok: bool
    shape: tuple
    dtype: str
    tolerance: Tolerance | None
    max_abs: float = 0.0
    max_rel: float = 0.0
    n_bad: int = 0
    numel: int = 0
    worst_index: tuple | None = None
    worst_got: float | None = None
    worst_expected: float | None = None
    problem: str | None = None  # structural problem: shape/dtype mismatch, NaN where a number was expected...

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["tolerance"] = None if self.tolerance is None else self.tolerance.as_dict()
        d["shape"] = list(self.shape)
        d["worst_index"] = None if self.worst_index is None else list(self.worst_index)
        return d


@dataclass
class Comparison:
    ok: bool
    outputs: list = field(default_factory=list)  # TensorComparison per output tensor

    @property
    def max_abs(self) -> float:
        return max((o.max_abs for o in self.outputs), default=0.0)

    @property
    def max_rel(self) -> float:
        return max((o.max_rel for o in self.outputs), default=0.0)

    @property
    def worst(self) -> TensorComparison | None:
        bad = [o for o in self.outputs if not o.ok]
        pool = bad or self.outputs
        return max(pool, key=lambda o: (o.problem is not None, o.max_abs), default=None)

    def describe(self) -> str:
        """One line per failing output: what is wrong and where."""
        lines = []
        for o in self.outputs:
            if o.ok:
                continue
            if o.problem:
                lines.append(f"{o.output}: {o.problem}")
                continue
            tol = o.tolerance
            lines.append(
                f"{o.output}: {o.n_bad}/{o.numel} elements out of tolerance; max abs err {o.max_abs:.4g}, "
                f"max rel err {o.max_rel:.4g}; worst element {o.output}{list(o.worst_index)}: "
                f"got {o.worst_got!r}, expected {o.worst_expected!r} "
                f"(atol {tol.atol:.3g}{'' if tol.atol_is_absolute else ' x RMS'}, rtol {tol.rtol:.3g}; {tol.rule})"
            )
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"ok": self.ok, "max_abs": self.max_abs, "max_rel": self.max_rel,
                "outputs": [o.as_dict() for o in self.outputs]}


def flatten(value, name: str = "out") -> list:
    """[(name, leaf)] for a tensor, nested tuples/lists of them, or plain values."""
    if isinstance(value, (tuple, list)):
        items = []
        for i, v in enumerate(value):
            items.extend(flatten(v, f"{name}[{i}]"))
        return items
    return [(name, value)]



def _index(flat_index: int, shape: tuple) -> tuple:
    idx = []
    for size in reversed(shape):
        idx.append(flat_index % size if size else 0)
        flat_index //= size if size else 1
    return tuple(reversed(idx))


def _item(t: torch.Tensor):
    value = t.item()
    return float(value) if isinstance(value, float) else value


def compare_tensors(name: str, got, expected: torch.Tensor, tolerance: Tolerance) -> TensorComparison:
    shape = tuple(expected.shape)
    result = TensorComparison(name, True, shape, dtype_name(expected.dtype), tolerance, numel=expected.numel())
    if not isinstance(got, torch.Tensor):
        result.ok, result.problem = False, f"expected a tensor, got {type(got).__name__}"
        return result
    if tuple(got.shape) != shape:
        result.ok, result.problem = False, f"shape {tuple(got.shape)}, expected {shape}"
        return result
    if got.dtype != expected.dtype:
        result.ok, result.problem = False, f"dtype {dtype_name(got.dtype)}, expected {dtype_name(expected.dtype)}"
        return result
    if expected.numel() == 0:
        return result
    g = got.detach().to("cpu", torch.float64).reshape(-1)
    e = expected.detach().to("cpu", torch.float64).reshape(-1)
    # Non-finite values must match exactly (NaN where the reference has NaN, same-signed inf).
    e_nan, g_nan = torch.isnan(e), torch.isnan(g)
    e_inf, g_inf = torch.isinf(e), torch.isinf(g)
    mismatch = (e_nan != g_nan) | (e_inf != g_inf) | (e_inf & g_inf & (torch.sign(e) != torch.sign(g)))
    finite = ~(e_nan | e_inf) & ~(g_nan | g_inf)
    diff = torch.where(finite, (g - e).abs(), torch.zeros_like(e))
    ef = torch.where(finite, e, torch.zeros_like(e))
    if tolerance.atol_is_absolute:
        scale = 1.0
    else:
        n_finite = int(finite.sum())
        scale = float(ef.pow(2).sum().div(max(n_finite, 1)).sqrt()) if n_finite else 0.0
        scale = max(scale, torch.finfo(expected.dtype).tiny if expected.dtype.is_floating_point else 1.0)
    bound = tolerance.atol * scale + tolerance.rtol * ef.abs()
    bad = (finite & (diff > bound)) | mismatch
    result.n_bad = int(bad.sum())
    result.ok = result.n_bad == 0
    result.max_abs = float(diff.max())
    rel_mask = finite & (ef.abs() >= _REL_FLOOR * scale) & (ef != 0)
    if bool(rel_mask.any()):
        result.max_rel = float((diff[rel_mask] / ef[rel_mask].abs()).max())
    if result.ok:
        worst = int(diff.argmax())
    else:
        # the element exceeding its bound by the largest factor; non-finite mismatches first
        excess = torch.where(finite, diff / bound.clamp_min(1e-300), torch.zeros_like(diff))
        excess = torch.where(mismatch, torch.full_like(excess, float("inf")), excess)
        worst = int(excess.argmax())
    result.worst_index = _index(worst, shape)
    result.worst_got = _item(got.detach().reshape(-1)[worst].cpu())
    result.worst_expected = _item(expected.detach().reshape(-1)[worst].cpu())
    return result


def compare(got, expected, tolerance_for: Callable[[torch.dtype], Tolerance]) -> Comparison:
    """Compare two op outputs; ``tolerance_for(dtype)`` gives each output tensor's bound."""
    got_items, exp_items = flatten(got), flatten(expected)
    if len(got_items) != len(exp_items):
        problem = f"returned {len(got_items)} outputs, expected {len(exp_items)}"
        return Comparison(False, [TensorComparison("out", False, (), "", None, problem=problem)])
    outputs = []
    for (name, g), (_, e) in zip(got_items, exp_items):
        if isinstance(e, torch.Tensor):
            outputs.append(compare_tensors(name, g, e, tolerance_for(e.dtype)))
        else:
            same = g == e
            outputs.append(TensorComparison(name, bool(same), (), type(e).__name__, None,
                                            problem=None if same else f"got {g!r}, expected {e!r}"))
    return Comparison(all(o.ok for o in outputs), outputs)
