"""Evaluator interface, executable checks, agentic judge, partial scoring, reward validity."""
