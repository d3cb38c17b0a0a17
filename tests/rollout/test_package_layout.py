"""The package map in gyre/rollout/__init__.py names every module of gyre/rollout, subpackages'
included, by its path under gyre/rollout/ (the per-package maps are checked by tests/test_docs.py,
the absence of import circles by tests/test_lint.py)."""

from pathlib import Path

import gyre.rollout

ROOT = Path(gyre.rollout.__file__).parent


def test_the_package_map_names_every_module_by_its_path():
    doc = gyre.rollout.__doc__
    modules = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py") if p.name != "__init__.py")
    assert len(modules) > 30
    assert [m for m in modules if f"``{m}``" not in doc] == []


def test_every_subpackage_is_in_the_map():
    doc = gyre.rollout.__doc__
    packages = sorted(".".join(("gyre", "rollout", *p.parent.relative_to(ROOT).parts))
                      for p in ROOT.rglob("*/__init__.py"))
    assert packages == ["gyre.rollout.api", "gyre.rollout.client", "gyre.rollout.embedded",
                        "gyre.rollout.embedded.routes", "gyre.rollout.sglang_driver"]
    assert [p for p in packages if f":mod:`{p}`" not in doc] == []
