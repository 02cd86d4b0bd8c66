"""Benchmarks anyone can run: ``graft bench overhead`` measures what graft itself costs
(dispatch, collectives routing, optimizer, framework steps) against the same work done
without graft, in the same run."""
