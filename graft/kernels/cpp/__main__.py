"""``python -m graft.kernels.cpp build``: build graft's CPU C++ kernels now, not on first use.

ci/setup.sh runs it in each environment it creates, so that no engine or test waits for the
compiler; with GRAFT_CPP_BUILD=off graft then uses the prebuilt library and never compiles.
"""
import sys

from graft.errors import GraftUnsupportedError
from graft.kernels.cpp import _build


def main(argv) -> int:
    if argv != ["build"]:
        print("usage: python -m graft.kernels.cpp build", file=sys.stderr)
        return 2
    try:
        _build.load_library(ahead_of_time=True)
    except GraftUnsupportedError as exc:
        print(f"not built: {exc}", file=sys.stderr)
        return 1
    name, build_dir = _build._paths()
    print(f"graft CPU C++ kernels ready: {build_dir / (name + '.so')}")
    return 0


sys.exit(main(sys.argv[1:]))
