"""Kernel implementations (installed as ``graft.kernels``): ``triton/`` and ``hip/``."""
