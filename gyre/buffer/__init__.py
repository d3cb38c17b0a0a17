"""Trajectory buffer (by rollout group) and stream packing buffer (micro-steps)."""
