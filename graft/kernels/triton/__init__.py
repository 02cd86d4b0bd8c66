"""Triton kernels; each public module defines ``register(registry)``.

Helpers shared by every Triton kernel module live in ``_common``.
"""
