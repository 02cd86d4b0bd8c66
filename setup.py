"""Maps the design card's top-level folders into the single ``graft`` namespace.

``adapters/`` installs as ``graft.adapters``, ``kernels/`` as ``graft.kernels`` and so on,
so nothing is ever importable as a bare top-level ``adapters`` or ``kernels`` module.
Everything else lives in pyproject.toml.
"""
import os

from setuptools import setup

PACKAGE_ROOTS = {
    "graft": "graft",
    "graft.adapters": "adapters",
    "graft.kernels": "kernels",
    "graft.patches": "patches",
    "graft.conformance": "conformance",
}


def find_packages():
    for namespace, root in PACKAGE_ROOTS.items():
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            if "__init__.py" in filenames:
                rel = os.path.relpath(dirpath, root)
                yield namespace if rel == "." else namespace + "." + rel.replace(os.sep, ".")


setup(packages=sorted(set(find_packages())), package_dir=PACKAGE_ROOTS)
