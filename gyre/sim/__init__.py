"""Discrete-event cluster simulator driving the real scheduler policy."""
