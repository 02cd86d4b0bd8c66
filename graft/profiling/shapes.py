"""The shapes a profile saw, in the file ``graft tune`` reads (``shapes.json`` in the
profile's folder): ``graft profile`` -> ``graft tune`` -> run again.

The file is ``{"format": "graft-shapes/1", "shapes": [...]}``; each entry is one distinct
call of a graft op::

    {"op": "gemm.linear", "backend": "torch", "dtype": "float32",
     "args": [{"shape": [32, 256], "dtype": "float32"}, {"shape": [384, 256], "dtype": "float32"}, null],
     "kwargs": {},                                   # keyword arguments, summarised the same way
     "shapes": [[32, 256], [384, 256]],             # the tensor arguments' shapes, in order (lists item by item)
     "calls": 12}                                    # how many calls had exactly these arguments

``args`` holds one item per positional argument: a tensor as ``{"shape", "dtype"}``, a
scalar (int, float, bool, str, None) as itself, a torch dtype as ``{"torch_dtype": name}``,
a short list item by item, anything else as ``{"type": name}``. ``backend`` is what served the calls, ``calls`` counts them over the
whole profiled run (warm-up included). Entries of several processes are merged by adding
their calls. All reading and writing of the format is in this module.
"""
from __future__ import annotations

import json
from pathlib import Path

FILE = "shapes.json"
FORMAT = "graft-shapes/1"
_KEYS = ("op", "backend", "dtype", "shapes", "args", "kwargs", "calls")


def _key(entry: dict) -> str:
    return json.dumps({k: entry.get(k) for k in _KEYS if k != "calls"}, sort_keys=True)


def merge(*lists: list) -> list:
    """Entries of several processes, one per distinct call, calls added; most called first per op."""
    merged: dict = {}
    for entries in lists:
        for entry in entries:
            key = _key(entry)
            if key in merged:
                merged[key]["calls"] += entry["calls"]
            else:
                merged[key] = {k: entry.get(k) for k in _KEYS}
    return sorted(merged.values(), key=lambda e: (e["op"], -e["calls"]))


def write(path, entries: list) -> None:
    body = ",\n".join("  " + json.dumps(e, sort_keys=True) for e in entries)
    Path(path).write_text(f'{{"format": "{FORMAT}", "shapes": [\n{body}\n]}}\n')


def read(path) -> list:
    """The entries of a shapes file, checked (a clear error naming the file and the bad entry)."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("shapes"), list):
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{path}: not a shapes file (expected {{'format': {FORMAT!r}, 'shapes': [...]}}, got {got!r})")
    for i, entry in enumerate(data["shapes"]):
        missing = [k for k in ("op", "dtype", "args", "calls") if not isinstance(entry, dict) or k not in entry]
        if missing:
            raise ValueError(f"{path}: entry {i} lacks {', '.join(missing)} (got {entry!r:.200})")
    return data["shapes"]
