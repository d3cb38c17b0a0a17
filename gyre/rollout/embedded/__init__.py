"""The embedded CPU engine: a torch causal LM behind SGLang's native HTTP API."""
