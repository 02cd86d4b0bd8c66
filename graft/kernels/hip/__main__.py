"""``python -m graft.kernels.hip build``: build the HIP/CUDA kernels now, not on first use.

Run it once per machine image (e.g. in a container build) so that serving never waits for
the compiler; with GRAFT_HIP_BUILD=off, graft then uses the prebuilt kernels and never
compiles on its own.
"""
import sys

from graft.errors import GraftUnsupportedError
from graft.kernels.hip import _build


def main(argv) -> int:
    if argv != ["build"]:
        print("usage: python -m graft.kernels.hip build", file=sys.stderr)
        return 2
    try:
        module = _build.load_extension(ahead_of_time=True)
    except GraftUnsupportedError as exc:
        print(f"not built: {exc}", file=sys.stderr)
        return 1
    print(f"graft HIP/CUDA kernels ready: {module.__file__}")
    return 0


sys.exit(main(sys.argv[1:]))
