"""HIP/CUDA C++ kernels; each public module defines ``register(registry)``."""
