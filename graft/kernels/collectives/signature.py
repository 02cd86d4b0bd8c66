"""How dispatch remembers a collective's argument signatures (``OpSpec.signature_hooks``).

A collective's validation includes the cross-rank agreement, made for one process group:
the default group is part of the signature (a group passed as an object is not remembered:
those calls validate through :func:`graft.kernels.collectives.fastpath.plan`, which caches
its own plan per group). ``GRAFT_COLLECTIVES_VALIDATE=always`` agrees on every call, so
nothing is remembered then.
"""
from __future__ import annotations

import functools
import operator
from typing import Callable

import torch

from graft.registry import SignatureHooks

NOTHING = object()  # a context no remembered signature shares


def default_group():
    """The default process group (torch's ``_world.default_pg``), or :data:`NOTHING`."""
    try:
        return torch.distributed.distributed_c10d._world.default_pg
    except AttributeError:  # private API moved, or no torch.distributed: nothing remembered then
        return NOTHING


def default_group_reader() -> Callable:
    """What a remembered signature calls on every call to compare the default group: the
    attribute behind torch's ``_world.default_pg`` property read by C callables (a partial of
    an attrgetter), where it is there. The property is a Python frame, and on the real call,
    after the communication, a cold one: about half a microsecond of the one a collective's
    dispatch costs on this CPU. Where the attribute is not there, the property through
    :func:`default_group`."""
    try:
        world = torch.distributed.distributed_c10d._world
        if world._default_pg is not world.default_pg:
            return default_group
    except AttributeError:
        return default_group
    return functools.partial(operator.attrgetter("_default_pg"), world)


def _identity():
    group = default_group()
    return None if group is NOTHING else group


def _validate(op: str, *args) -> None:
    from graft.kernels.collectives.fastpath import plan

    plan(op, *args)  # validates, and agrees across ranks, once per signature


def _may_remember() -> bool:
    from graft.kernels.collectives._common import settings

    return settings().validate != "always"


HOOKS = SignatureHooks(validate=_validate, context=default_group_reader, identity=_identity,
                       may_remember=_may_remember)
