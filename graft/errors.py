"""Exception types. Every error graft raises on purpose derives from GraftError."""


class GraftError(Exception):
    """Base class for graft errors."""


class GraftConfigError(GraftError, ValueError):
    """A GRAFT_* environment variable (or equivalent setting) has an invalid value."""


class GraftInputError(GraftError, ValueError):
    """An op was called with bad input: wrong dtype, shape, device or layout."""


class GraftUnsupportedError(GraftError, RuntimeError):
    """No implementation can serve a request (and falling back was not allowed)."""


class GraftDependencyError(GraftError, ImportError):
    """An optional dependency needed for this feature is missing."""


class GraftCollectiveError(GraftError, RuntimeError):
    """A collective failed across ranks: a peer never called it (timeout), called another
    one, or left the group. Raised on every live rank, naming the op, group and ranks."""
