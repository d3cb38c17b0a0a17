"""Harness adapters (claude-code, codex, mini-swe-agent, reference agent) and workspaces."""
