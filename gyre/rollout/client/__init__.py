"""Clients of a rollout engine over SGLang's native HTTP API, and the messages they exchange."""
