"""Task spec loading (JSONL/YAML) and workspace materialisation."""
