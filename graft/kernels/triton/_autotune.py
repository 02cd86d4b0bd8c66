"""Per-architecture tile configurations for Triton kernels.

A kernel module keeps a table keyed by architecture generation (see
``graft.platform.arch_generation``: ``"hopper"``, ``"cdna3"``, ...) with a ``"default"``
entry, and asks :func:`tile_config` for the launch parameters on a device. The CPU
interpreter gets the ``"interpreter"`` entry when present: small tiles keep it fast.

The rows are data, one file per generation: ``tiles/<generation>.json`` maps a table's name
(the kernel module's, e.g. ``"attention_prefill"``) to that generation's entry, and
:func:`tile_table` gathers one table across the files (read once per process). A generation
with no row for a table is absent from it. The reasons for rows stay beside the table in
the kernel module.
"""
from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import torch

from graft.platform import device_info

TILES_DIR = Path(__file__).with_name("tiles")
# The order a table lists its generations in (others after these, by name).
GENERATIONS = ("hopper", "blackwell", "ampere", "cdna3", "default", "interpreter")


@functools.cache
def _tile_files() -> dict[str, dict]:
    """Every ``tiles/<generation>.json``, read once: generation -> {table name: entry}."""
    paths = sorted(TILES_DIR.glob("*.json"), key=lambda p: (p.stem not in GENERATIONS,
                                                            GENERATIONS.index(p.stem) if p.stem in GENERATIONS else 0,
                                                            p.stem))
    return {path.stem: json.loads(path.read_text()) for path in paths}


def tile_table(name: str) -> dict:
    """The tile table ``name``: {generation: its entry} over the generations that list one
    (a copy: a module may change its table, as tests and the tile sweep do)."""
    table = {generation: copy.deepcopy(doc[name]) for generation, doc in _tile_files().items() if name in doc}
    if not table:
        raise KeyError(f"no tile table {name!r} in {TILES_DIR}")
    return table


def bounded_rows(table: dict) -> dict:
    """A table of bounded rows as the launchers read it: JSON's ``[[max or null, row], ...]``
    per key as a tuple of ``(max or None, row)`` pairs, bounds ascending, the last unbounded."""
    return {key: tuple((bound, row) for bound, row in rows) for key, rows in table.items()}


def shape_key(name: str) -> tuple[int, ...]:
    """A shape written as a JSON key (``"256x2048"``) as the tuple the tables are keyed by."""
    return tuple(int(n) for n in name.split("x"))


def table_key(table: dict, device: torch.device | str) -> str:
    """The entry of ``table`` that serves ``device``: its generation's (the CPU: the
    interpreter's), else ``"default"``."""
    if "default" not in table:
        raise KeyError("a tile-config table needs a 'default' entry")
    device = torch.device(device)
    key = "interpreter" if device.type != "cuda" else device_info(device).generation
    return key if key in table else "default"


def tile_config(table: dict, device: torch.device | str) -> dict:
    return dict(table[table_key(table, device)])
