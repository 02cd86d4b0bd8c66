"""graft's ``cpp`` backend: C++ kernels for the CPU, built lazily with
``torch.utils.cpp_extension`` against the running torch (``_build``), registered as
``torch.ops.graft_cpp.*`` and exposed as graft custom ops by one module per op family."""
