"""Reference solution of nl2repo-inikit (hidden from the harness)."""

__all__ = ["ParseError", "loads", "dumps", "get"]


class ParseError(ValueError):
    def __init__(self, message, lineno):
        super().__init__(f"line {lineno}: {message}")
        self.message = message
        self.lineno = lineno


def loads(text):
    data = {"DEFAULT": {}}
    section = "DEFAULT"
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1].strip()
            data.setdefault(section, {})
            continue
        cut = [i for i in (line.find("="), line.find(":")) if i >= 0]
        if not cut:
            raise ParseError(f"not a section header or key line: {line!r}", lineno)
        i = min(cut)
        data[section][line[:i].strip().lower()] = line[i + 1:].strip()
    if not data["DEFAULT"]:
        del data["DEFAULT"]
    return data


def dumps(data):
    out = []
    for section, items in data.items():
        out.append(f"[{section}]\n")
        for k, v in items.items():
            out.append(f"{k} = {v}\n")
        out.append("\n")
    return "".join(out)


def get(data, path, default=None, type=str):
    section, _, key = path.partition(".")
    try:
        value = data[section][key]
    except KeyError:
        return default
    return type(value)
