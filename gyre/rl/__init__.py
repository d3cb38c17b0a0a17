"""Advantages, the execution-level GSPO-style objective, loss normalisation."""
