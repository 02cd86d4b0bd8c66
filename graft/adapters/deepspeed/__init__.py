"""graft inside DeepSpeed: FusedAdam served by ``fused.adam_step`` and ``deepspeed.comm``
collectives served by graft's ``collectives`` ops, on whatever accelerator DeepSpeed picked.

Turn it on with one line before ``deepspeed.initialize()``::

    import graft.adapters.deepspeed
    graft.adapters.deepspeed.activate()

or without touching the script: ``deepspeed --module graft.adapters.deepspeed train.py ...``
(``python -m graft.adapters.deepspeed train.py`` for a single process). ``GRAFT_DEEPSPEED=0``
turns it off. Importing this package does not import DeepSpeed.
"""
from graft.adapters.deepspeed.integration import ENV_VAR, SUPPORTED, activate, deactivate, integration, is_active
from graft.adapters.deepspeed.integration import counter

__all__ = ["ENV_VAR", "SUPPORTED", "activate", "deactivate", "integration", "is_active", "calls", "counter"]

calls = counter.calls  # what graft served here (see integration.counter)
