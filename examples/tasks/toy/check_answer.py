"""Toy check: exit 0 when FILE (in the current directory) holds EXPECTED (surrounding
whitespace ignored), 1 otherwise. Usage: check_answer.py FILE EXPECTED"""
import pathlib
import sys

path, expected = pathlib.Path(sys.argv[1]), sys.argv[2]
try:
    sys.exit(0 if path.read_text(errors="replace").strip() == expected else 1)
except OSError:
    sys.exit(1)
