"""'key=value; key=value' strings."""


def parse_kv(text):
    """Parse 'a=1; b = two' into {'a': '1', 'b': 'two'}. Whitespace around keys and values
    is stripped, empty items are ignored, a later key overrides an earlier one.
    Raises ValueError for an item without '='."""
    out = {}
    for item in text.split(";"):
        if not item.strip():
            continue
        if "=" not in item:
            raise ValueError(f"item without '=': {item.strip()!r}")
        key, value = item.split("=", 1)
        out[key.strip()] = value.strip()
    return out


def format_kv(mapping):
    """Inverse of parse_kv: 'a=1; b=two' with keys in sorted order."""
    return "; ".join(f"{k}={mapping[k]}" for k in sorted(mapping))
