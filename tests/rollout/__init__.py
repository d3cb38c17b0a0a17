"""Tests of gyre/rollout (engine protocol, embedded engine core, SGLang adapter)."""
