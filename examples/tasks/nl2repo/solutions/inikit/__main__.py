import json
import sys

from inikit import ParseError, loads

try:
    with open(sys.argv[1]) as f:
        print(json.dumps(loads(f.read()), sort_keys=True))
except ParseError as exc:
    print(f"error: line {exc.lineno}: {exc.message}", file=sys.stderr)
    sys.exit(1)
