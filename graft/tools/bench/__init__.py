"""Benchmarks anyone can run: ``graft bench overhead`` measures what graft itself costs
(dispatch, collectives routing, optimizer, framework steps) against the same work done
without graft, in the same run."""


def choose(text, valid, option: str, what: str) -> list:
    """A comma-separated subset of ``valid`` given to ``option`` (all of them when None); an
    unknown or empty choice is a ``GraftConfigError`` naming it and what is valid."""
    from graft.errors import GraftConfigError

    if text is None:
        return list(valid)
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in valid]
    if unknown or not chosen:
        raise GraftConfigError(f"{option}: unknown {what} {', '.join(map(repr, unknown)) or '(none given)'}; "
                               f"valid: {', '.join(valid)}")
    return chosen
