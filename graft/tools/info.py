"""``graft info``: plugins, ops, implementations, and what would be selected on this machine and why."""
from __future__ import annotations

import json
import os
import sys

import torch

from graft import __version__, config
from graft.errors import GraftConfigError
from graft.platform import default_device, device_info, dtype_name, triton_interpret


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--device", default=None, help="device to decide for (default: this machine's accelerator, else cpu)")
    parser.add_argument("--arch", default=None,
                        help="decide for this GPU architecture (sm_90, gfx942...) instead of the local device's")
    parser.add_argument("--dtype", default=None, help="dtype to decide for (default: each op's first supported dtype)")
    parser.add_argument("--op", action="append", default=None, help="only these ops (repeatable)")
    parser.add_argument("--shape", default=None, metavar="SHAPES",
                        help="with one --op: what a call of these shapes gets and why (the tuning table entry of its "
                             "shape bucket included). The op's tensor arguments in order, comma-separated, dimensions "
                             "joined by x ('16x256,256'), or by name ('x=16x256,weight=256'); 'none' passes None; "
                             "arguments not given take the op's first test case's values")


def _dtype(name: str | None):
    if name is None:
        return None
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise GraftConfigError(f"--dtype {name!r} is not a torch dtype (e.g. float16, bfloat16, float32)")
    return value


def collect(device=None, dtype=None, ops=None, arch=None) -> dict:
    from graft.plugins import get_host
    from graft.selection import explain

    host = get_host()
    registry = host.registry
    device = torch.device(device) if device else default_device()
    info = device_info(device, arch=arch)
    known = registry.families()
    wanted = ops or sorted(registry.ops)
    for name in wanted:
        registry.op(name)  # unknown op -> clear error
    report: dict = {
        "graft_version": __version__,
        "torch_version": torch.__version__,
        "device": info.as_dict(),
        "triton_interpret": triton_interpret(),
        "dispatch_entry": _dispatch_entry(),
        "tensor_check": _tensor_check(),
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("GRAFT_")},
        "unknown_environment": config.unknown_env_vars(known),
        "plugins": [r.as_dict() for r in host.records.values()],
        "hook_errors": list(host.hook_errors),
        "integrations": _integrations(host),
        "tuning": _tuning(device),
        "ops": [],
    }
    for name in wanted:
        spec = registry.op(name)
        op_dtype = dtype if dtype is not None else spec.dtypes[0] if spec.dtypes else None
        decision = explain(registry, name, device=device, dtype=op_dtype, arch=info.arch)
        entry = decision.as_dict()
        entry.update(family=spec.family, signature=spec.signature, dtype=dtype_name(op_dtype))
        report["ops"].append(entry)
    return report


def _tuning(device) -> dict:
    from graft import tuning
    from graft.selection import entry_reason

    report = tuning.report(device.type)
    for op, rows in report.get("ops", {}).items():
        for row in rows:  # a table made elsewhere may name a backend this machine cannot run
            row["cannot_serve"] = entry_reason(op, row["backend"], row["dtype"], device.type)
    return report


def _render_tuning(report: dict) -> list:
    from graft.tuning import describe

    tuning = report.get("tuning") or {}
    lines = ["tuning tables (graft tune; dispatch reads them when it builds a plan):"]
    if tuning.get("error"):
        lines.append(f"  ! {tuning['error']}")
    for t in tuning.get("tables", []):
        state = "used" if t["used"] else f"ignored: {t['ignored']}"
        lines.append(f"  {t['source']}  ({t['entries']} entries)  {state}")
    if not tuning.get("tables"):
        lines.append(f"  (none: set {tuning.get('variable', 'GRAFT_TUNING_TABLE')}=FILE; without a table the framework's "
                     "own code serves where it can, graft's elsewhere)")
    if tuning.get("batch_invariant"):
        lines.append("  batch-invariant mode: one backend per shape for every token count")
    return lines


def _tensor_check() -> str:
    """Which check the remembered argument signatures use on each call (graft.signature)."""
    from graft import signature, tensor_guard

    kind = signature.guard_kind()
    if kind == "graft" or (kind == "torch" and tensor_guard.module() is None):
        return tensor_guard.status()  # graft's guard, or why it is not there
    if kind == "torch":
        return "torch's TensorGuards (graft's C++ tensor guard is built but does not behave in this torch)"
    return "Python (no compiled tensor check behaves in this torch)"


def _dispatch_entry() -> str:
    from graft import dispatch

    if dispatch.call is not dispatch._python_call:
        return "C (graft._fastcall): a repeated call costs well under a microsecond of graft's own"
    try:
        import graft._fastcall  # noqa: F401
    except ImportError:
        why = "graft._fastcall was not built: no C compiler when graft was installed"
    else:
        why = "GRAFT_DISPATCH_C=0"
    return f"Python ({why}; about twice the per-call cost)"


def _integrations(host) -> list:
    rows = []
    for integration in host.collect("graft_framework_integrations"):
        ok, why = integration.status()
        layers = integration.layers() if ok else {"served": [], "left": {}, "expected_left": {}}
        rows.append({
            "name": integration.name,
            "framework": integration.distribution,
            "installed": integration.installed_version(),
            "supported": integration.supported,
            "can_activate": ok,
            "reason": why,
            "switch": integration.env_var,
            "description": integration.description,
            "served": layers["served"],
            "left_to_framework": layers["left"],
            "expected_left": layers["expected_left"],
        })
    return rows


def render_text(report: dict) -> str:
    from graft.tuning import describe

    lines = [f"graft {report['graft_version']}  (torch {report['torch_version']})"]
    d = report["device"]
    lines.append(f"device: {d['type']} {d['name']} arch={d['arch']} generation={d['generation']}"
                 + ("  [TRITON_INTERPRET=1]" if report["triton_interpret"] else ""))
    lines.append(f"dispatch entry: {report['dispatch_entry']}")
    lines.append(f"signature check: {report['tensor_check']}")
    env = report["environment"]
    lines.append("environment: " + (", ".join(f"{k}={v}" for k, v in env.items()) or "(no GRAFT_* variables set)"))
    for var in report["unknown_environment"]:
        lines.append(f"  warning: {var} is set but nothing reads it (misspelt?)")
    lines.append("")
    lines.append("plugins:")
    for p in report["plugins"]:
        version = f"{p['distribution']} {p['version']}" if p["distribution"] else "in-process"
        lines.append(f"  {p['name']:<18} {p['status']:<9} {version:<24} {p['module']}")
        if p.get("error"):
            lines.append(f"      ! {p['error']}")
        if p.get("info", {}).get("description"):
            lines.append(f"      {p['info']['description']}")
    lines.append("")
    lines.append("framework integrations:")
    for i in report["integrations"]:
        state = "ready" if i["can_activate"] else "off"
        switch = f"  (off with {i['switch']}=0)" if i["switch"] else ""
        lines.append(f"  {i['name']:<18} {state:<9} {i['reason']}{switch}")
        if i.get("served"):
            lines.append(f"      serves: {', '.join(i['served'])}")
        for layer, why in i.get("left_to_framework", {}).items():
            mark = "! " if layer in i.get("expected_left", {}) else ""
            lines.append(f"      {mark}left to {i['framework']}: {layer}: {why}")
    if not report["integrations"]:
        lines.append("  (none installed)")
    lines.append("")
    lines.extend(_render_tuning(report))
    lines.append("")
    lines.append("ops (selected implementation marked '>'):")
    for op in report["ops"]:
        selected = op["selected"]
        head = f"  {op['op']}  [{op['dtype']}]  order from {op['source']}"
        if op["fell_back"]:
            head += f"  (fell back from requested {','.join(op['requested'])})"
        lines.append(head)
        reasons = {c["reason"] for c in op["candidates"]}
        if selected is None and len(reasons) == 1 and op["candidates"]:
            lines.append(f"    ! {reasons.pop()}")
            continue
        for c in op["candidates"]:
            is_sel = selected is not None and c["backend"] == selected["backend"] and c["provider"] == selected["provider"]
            mark = ">" if is_sel else " "
            status = c["reason"] if not c["usable"] else (
                "ok (checked per call)" if c["checks_each_call"] else "ok")
            lines.append(f"    {mark} {c['backend']:<10} ({c['provider']}) {status}")
        if selected is None:
            lines.append("    ! nothing can serve this op here")
        for row in (report.get("tuning") or {}).get("ops", {}).get(op["op"], []):
            lines.append(f"    tuned [{row['dtype']}] {row['bucket']}: {describe(row)}  (table {row['table']})")
    return "\n".join(lines)


_DEVICE_TYPES = ("cpu", "cuda")


def _check_device(name: str | None) -> None:
    if name is None:
        return
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in _DEVICE_TYPES:
        raise GraftConfigError(f"--device {name!r}: graft decides for {', '.join(_DEVICE_TYPES)} (ROCm GPUs are "
                               "'cuda' in torch); use --arch to ask about a GPU this machine doesn't have")


def _parse_dims(op: str, text: str):
    text = text.strip().lower()
    if text in ("none", "null"):
        return None
    try:
        dims = [int(d) for d in text.split("x")] if text not in ("", "scalar") else []
    except ValueError:
        dims = None
    if dims is None or any(d < 0 for d in dims):
        raise GraftConfigError(f"--shape {text!r} for {op}: give dimensions joined by x (e.g. 16x256), "
                               "'scalar' for a 0-d tensor or 'none' for None")
    return dims


def call_arguments(op: str, shapes: str, device, dtype) -> tuple:
    """Arguments of one call of ``op`` with the tensor shapes ``shapes`` (see --shape): the
    op's first conformance case on ``device`` and ``dtype``, its tensors redrawn at those
    shapes (floating: random normal; integer: random below the case's largest value + 1)."""
    import inspect

    from graft.plugins import get_host
    from graft.tools.conformance.cases import all_cases

    host = get_host()
    registry = host.registry
    spec = registry.op(op)
    dtype = dtype if dtype is not None else spec.dtypes[0] if spec.dtypes else torch.float32
    cases = [c for c in all_cases(host, registry) if c.op == op and dtype in c.dtypes]
    if not cases:
        raise GraftConfigError(f"--shape: {op} has no test case for {dtype_name(dtype)} to take its other "
                               "arguments from; call graft.explain(op, *args) in Python instead")
    args, kwargs = cases[0].inputs(device, dtype)
    args = list(args)
    names = list(inspect.signature(spec.reference).parameters)
    tensor_slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)
                    or (a is None and i < len(names))]
    items = [item for item in shapes.split(",") if item.strip()]
    gen = torch.Generator(device="cpu").manual_seed(0)
    for n, item in enumerate(items):
        if "=" in item:
            name, dims_text = item.split("=", 1)
            name = name.strip()
            if name not in names or names.index(name) >= len(args):
                raise GraftConfigError(f"--shape: {op} has no positional argument {name!r}; its arguments are "
                                       + ", ".join(names[: len(args)]))
            slot = names.index(name)
        else:
            if n >= len(tensor_slots):
                raise GraftConfigError(f"--shape: {op} takes {len(tensor_slots)} tensor argument(s) "
                                       f"({', '.join(names[i] for i in tensor_slots)}), {len(items)} shapes given")
            slot, dims_text = tensor_slots[n], item
        dims = _parse_dims(op, dims_text)
        old = args[slot]
        if dims is None:
            args[slot] = None
            continue
        like = old if isinstance(old, torch.Tensor) else torch.empty(0, dtype=dtype)
        if like.dtype.is_floating_point:
            new = torch.randn(dims, generator=gen).to(like.dtype)
        elif like.dtype == torch.bool:
            new = torch.randint(0, 2, dims, generator=gen).bool()
        else:
            high = int(like.max()) + 1 if like.numel() else 2
            new = torch.randint(0, max(high, 1), dims, generator=gen).to(like.dtype)
        args[slot] = new.to(device)
    return tuple(args), kwargs


def explain_shape(op: str, shapes: str, device=None, dtype=None) -> dict:
    """What a call of ``op`` with ``shapes`` gets on ``device``, and why (graft.selection.explain_call)."""
    from graft.plugins import get_registry
    from graft.selection import explain_call

    device = torch.device(device) if device else default_device()
    args, kwargs = call_arguments(op, shapes, device, dtype)
    decision = explain_call(get_registry(), op, args, kwargs)
    entry = decision.as_dict()
    entry["arguments"] = [f"{tuple(a.shape)} {dtype_name(a.dtype)}" if isinstance(a, torch.Tensor) else repr(a)
                          for a in args]
    entry["device"] = str(device)
    return entry


def render_shape(entry: dict) -> str:
    selected = entry["selected"]
    lines = [f"{entry['op']} on {entry['device']}: arguments {', '.join(entry['arguments'])}",
             f"  shape bucket: {entry['bucket']}"]
    if selected is None:
        lines.append("  ! nothing can serve this call here")
    else:
        lines.append(f"  served by: {selected['backend']} ({selected['provider']})")
    lines.append(f"  why: {entry['why']}")
    for c in entry["candidates"]:
        mark = ">" if selected is not None and (c["backend"], c["provider"]) == (selected["backend"], selected["provider"]) else " "
        lines.append(f"    {mark} {c['backend']:<10} ({c['provider']}) {c['reason'] or 'ok'}")
    return "\n".join(lines)


def run(args) -> int:
    _check_device(args.device)
    if args.shape is not None:
        if not args.op or len(args.op) != 1:
            raise GraftConfigError("--shape asks about one call: give exactly one --op with it")
        entry = explain_shape(args.op[0], args.shape, device=args.device, dtype=_dtype(args.dtype))
        if args.json:
            json.dump(entry, sys.stdout, indent=2, default=str)
            sys.stdout.write("\n")
        else:
            print(render_shape(entry))
        return 0
    report = collect(device=args.device, dtype=_dtype(args.dtype), ops=args.op, arch=args.arch)
    if args.json:
        json.dump(report, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        print(render_text(report))
    return 0
