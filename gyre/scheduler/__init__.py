"""Boundary dispatch, counters, waterlevel policy; placements elastic / async / colocate."""
