"""Gradient conformance: an implementation's registered backward against torch autograd
through the op's reference (``graft conformance --grad``).

For each (case, dtype) the differentiable inputs (the OpSpec's ``grad_inputs``) of fresh inputs are
marked ``requires_grad``; the reference and the implementation each run forward, get the same
seeded cotangent for every floating-point output, and ``torch.autograd.grad`` gives each input's
gradient; every input's gradient is compared with the tolerance of
:func:`graft.tools.conformance.tolerances.grad_tolerance_for`. An implementation whose custom op has
no backward registered (graft.custom_ops.register_backward) is reported as skipped: training
through it recomputes the torch reference. graft's torch-backend implementations (torch
ops such as ``F.scaled_dot_product_attention``) are checked through their autograd.
"""
from __future__ import annotations

import inspect

import torch

from graft.tools.conformance.compare import compare_tensors, flatten
from graft.tools.conformance.tolerances import grad_tolerance_for
from graft.custom_ops import has_backward
from graft.platform import dtype_name

PASS, FAIL, ERROR, SKIPPED = "pass", "fail", "error", "skipped"

def grad_inputs(op: str) -> tuple:
    """Positions of ``op``'s arguments that take gradients (its OpSpec's ``grad_inputs``)."""
    from graft.plugins import get_registry

    return get_registry().op(op).grad_inputs


def differentiable(op: str) -> bool:
    return bool(grad_inputs(op))


def no_backward_reason(impl) -> str | None:
    if impl.backend == "torch":  # graft's torch backend is torch ops: autograd differentiates them
        return None
    if not has_backward(impl.custom_op):
        return "no backward registered for this implementation (training recomputes the torch reference)"
    return None


def _mark(op: str, args: tuple) -> tuple[list, list]:
    """Mark the op's differentiable inputs; returns (args with them, [(name, tensor)])."""
    marked_args = list(args)
    marked = []
    for i in grad_inputs(op):
        if i < len(marked_args) and isinstance(marked_args[i], torch.Tensor) and marked_args[i].is_floating_point():
            marked_args[i] = marked_args[i].detach().requires_grad_(True)
            marked.append((i, marked_args[i]))
    return marked_args, marked


def _cotangents(outputs: list, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed + 1)
    return [torch.randn(o.shape, generator=gen).to(device=o.device, dtype=o.dtype) for o in outputs]


def _grads(fn, op, args, kwargs, normalize, seed):
    args, marked = _mark(op, args)
    with torch.enable_grad():
        out = fn(*args, **kwargs)
    out = normalize(out) if normalize is not None else out
    outputs = [v for _, v in flatten(out) if isinstance(v, torch.Tensor) and v.is_floating_point()
               and v.requires_grad]
    if not outputs or not marked:
        return marked, [None] * len(marked)
    grads = torch.autograd.grad(outputs, [t for _, t in marked], _cotangents(outputs, seed), allow_unused=True)
    return marked, list(grads)


def run_grad(impl, spec, case, make, dtype: torch.dtype, device_type: str, seed: int) -> dict:
    """The ``grad`` entry of one implementation on one (case, dtype)."""
    dtype_str = dtype_name(dtype)
    result: dict = {"status": PASS, "reason": None, "message": None, "inputs": {}}
    reason = no_backward_reason(impl)
    if reason:
        result["status"], result["reason"] = SKIPPED, reason
        return result
    names = list(inspect.signature(spec.reference).parameters)
    try:
        ref_args, ref_kwargs = make()
        marked, expected = _grads(spec.reference, case.op, ref_args, ref_kwargs, case.normalize, seed)
        args, kwargs = make()
        _, got = _grads(impl.fn, case.op, args, kwargs, case.normalize, seed)
    except Exception as exc:  # noqa: BLE001 - reported per case, the run goes on
        result["status"], result["reason"] = ERROR, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        result["message"] = f"{case.op} [{case.name}] dtype={dtype_str} impl={impl.backend}: backward raised {result['reason']}"
        return result
    bad = []
    for (pos, tensor), g, e in zip(marked, got, expected):
        name = names[pos] if pos < len(names) else f"arg{pos}"
        if e is None and g is None:
            continue
        if e is None:
            e = torch.zeros_like(tensor)
        rows = tensor.numel() // tensor.shape[-1] if tensor.dim() and tensor.shape[-1] else 0
        reduction = max(rows, int(case.reduction(args, kwargs)) if case.reduction is not None else 0)
        tol = grad_tolerance_for(e.dtype, reduction_len=reduction, device_type=device_type, compute_dtype=dtype,
                                 op=case.op)
        cmp = compare_tensors(f"d{name}", g if g is not None else torch.zeros_like(e), e, tol)
        result["inputs"][name] = {"ok": cmp.ok, "max_abs": cmp.max_abs, "max_rel": cmp.max_rel,
                                  "tolerance": tol.as_dict(), "problem": cmp.problem,
                                  "worst_index": None if cmp.worst_index is None else list(cmp.worst_index),
                                  "worst_got": cmp.worst_got, "worst_expected": cmp.worst_expected}
        if not cmp.ok:
            bad.append(f"  d{name}: max abs {cmp.max_abs:.3g}, max rel {cmp.max_rel:.3g} ({cmp.n_bad} of "
                       f"{cmp.numel} outside atol {tol.atol:.3g} x RMS + rtol {tol.rtol:.3g}; {tol.rule})"
                       + (f"; {cmp.problem}" if cmp.problem else "")
                       + (f"; worst at {cmp.worst_index}: got {cmp.worst_got}, expected {cmp.worst_expected}"
                          if cmp.worst_index is not None else ""))
    if bad:
        result["status"] = FAIL
        result["message"] = (f"{case.op} [{case.name}] dtype={dtype_str} impl={impl.backend}: gradient mismatch\n"
                             + "\n".join(bad))
    return result
