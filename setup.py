"""Package list for setuptools (everything else lives in pyproject.toml).

The design's top-level folders (``adapters/``, ``kernels/``, ``patches/``,
``conformance/``) are linked into the package as ``graft/adapters`` and so on, so the
source tree *is* the ``graft`` package: an editable install, mypy, IDEs and structure
tools all resolve ``graft.kernels.triton._common`` to a real file under ``graft/``.
"""
import os

from setuptools import Extension, setup


def find_packages(root="graft"):
    # followlinks: the top-level folders are reached through graft/<folder> links.
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        if "__init__.py" in filenames:
            yield dirpath.replace(os.sep, ".")


# dispatch's hot path in C (graft/_fastcall.c); optional: without a compiler the Python
# entries in graft/dispatch.py serve alone.
FASTCALL = Extension("graft._fastcall", ["graft/_fastcall.c"], optional=True)

setup(packages=sorted(find_packages()), ext_modules=[FASTCALL])
