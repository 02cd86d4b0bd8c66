"""graft's torch backend: every op's torch reference (its definition and last resort, in
``graft/ops/<family>/reference.py``) and, where torch has a faster kernel for the same math, that
kernel (ranked above the reference): one module per family here, each listing its fast paths in
``torch_implementations()``, which ``plugin.py`` registers."""
