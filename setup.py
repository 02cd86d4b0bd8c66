"""Package list for setuptools (everything else lives in pyproject.toml).

Every folder of the ``graft`` package is a real folder under ``graft/`` (the runtime, and
the tools in ``graft/tools/``), so an editable install, mypy, IDEs and import-graph tools
resolve ``graft.kernels.triton._common`` to a real file.
"""
import os

from setuptools import Extension, setup


def find_packages(root="graft"):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        if "__init__.py" in filenames:
            yield dirpath.replace(os.sep, ".")


# dispatch's hot path in C (graft/_fastcall.c); optional: without a compiler the Python
# entries in graft/dispatch.py serve alone.
FASTCALL = Extension("graft._fastcall", ["graft/_fastcall.c"], optional=True)

setup(packages=sorted(find_packages()), ext_modules=[FASTCALL])
