"""graft's torch backend: every op's torch reference (its definition and last resort) and,
where torch has a faster kernel for the same math, that kernel (ranked above the reference)."""
