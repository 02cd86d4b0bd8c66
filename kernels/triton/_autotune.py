"""Per-architecture tile configurations for Triton kernels.

A kernel module keeps a table keyed by architecture generation (see
``graft.platform.arch_generation``: ``"hopper"``, ``"cdna3"``, ...) with a ``"default"``
entry, and asks :func:`tile_config` for the launch parameters on a device. The CPU
interpreter gets the ``"interpreter"`` entry when present: small tiles keep it fast.
"""
from __future__ import annotations

import torch

from graft.platform import device_info


def tile_config(table: dict, device: torch.device | str) -> dict:
    if "default" not in table:
        raise KeyError("a tile-config table needs a 'default' entry")
    device = torch.device(device)
    if device.type != "cuda":
        return dict(table.get("interpreter", table["default"]))
    return dict(table.get(device_info(device).generation, table["default"]))
