"""graft's built-in adapter plugins (installed as ``graft.adapters``).

Each module is registered through the ``graft.adapters`` entry-point group in
pyproject.toml, exactly like a third-party adapter.
"""
