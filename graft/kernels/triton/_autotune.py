"""Per-architecture tile configurations for Triton kernels.

A kernel module keeps a table keyed by architecture generation (see
``graft.platform.arch_generation``: ``"hopper"``, ``"cdna3"``, ...) with a ``"default"``
entry, and asks :func:`tile_config` for the launch parameters on a device. The CPU
interpreter gets the ``"interpreter"`` entry when present: small tiles keep it fast.
"""
from __future__ import annotations

import torch

from graft.platform import device_info


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
