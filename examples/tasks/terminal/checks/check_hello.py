"""term-hello-file: hello.txt holds exactly the line 'Hello, Gyre!'. Exit 0 on success."""
import pathlib
import sys

p = pathlib.Path("hello.txt")
sys.exit(0 if p.is_file() and p.read_text() in ("Hello, Gyre!\n", "Hello, Gyre!") else 1)
