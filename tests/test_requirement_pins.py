"""The megatron-core pins of the environments: megatron-core 0.17 and newer require Python 3.12, so
the SGLang and GPU environments pin it by Python version -- 0.16.1 on 3.11 (the CPU machine's
SGLang environment, like the CPU ``.venv``), the newest release on 3.12 (the GPU environment, and
the wheels the GPU check installs).  Read with ``packaging``, markers evaluated for each Python;
also the check ``tools/setup_sglang.sh`` uses to reuse an environment (``tools/requirements_check.py``)."""

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tools.requirements_check import applicable, parse, unmet

ROOT = Path(__file__).resolve().parents[1]
PINNED = ("requirements-sglang-env.txt", "requirements-gpu.txt")


def megatron_pin(path: Path, python: str) -> str:
    """The one ``==`` version of megatron-core that ``path`` asks for on ``python``."""
    reqs = [r for r in applicable(parse(path.read_text()), python) if r.name == "megatron-core"]
    assert len(reqs) == 1, (path.name, python, [str(r) for r in reqs])
    (spec,) = reqs[0].specifier
    assert spec.operator == "==", str(reqs[0])
    return spec.version


@pytest.mark.parametrize("name", PINNED)
def test_megatron_core_is_pinned_by_python_version(name):
    on_311, on_312 = megatron_pin(ROOT / name, "3.11"), megatron_pin(ROOT / name, "3.12")
    assert on_311 == "0.16.1"  # the newest release that installs on Python 3.11
    assert Version(on_312) >= Version("0.17")  # 0.17 and newer: Python 3.12 only
    assert megatron_pin(ROOT / name, "3.13") == on_312


def test_the_environments_and_the_gpu_check_agree():
    cpu = [r for r in parse((ROOT / "requirements.txt").read_text()) if r.name == "megatron-core"]
    assert [str(r.specifier) for r in cpu] == ["==" + megatron_pin(ROOT / PINNED[0], "3.11")]  # CPU .venv: 3.11
    for python in ("3.11", "3.12"):
        assert megatron_pin(ROOT / PINNED[0], python) == megatron_pin(ROOT / PINNED[1], python)
    wheels = re.findall(r"^MEGATRON_CORE=megatron-core==(\S+)$", (ROOT / "tests/gpu/prepare_wheels.sh").read_text(), re.M)
    assert wheels == [megatron_pin(ROOT / PINNED[1], "3.12")]  # the GPU machine runs Python 3.12


def test_setup_sglang_prefers_python_3_12():
    text = (ROOT / "tools/setup_sglang.sh").read_text()
    assert 'BASE="$(command -v python3.12 || command -v python3.11 || command -v python3)"' in text


def test_an_environment_is_ready_only_with_the_pin_of_its_python():
    reqs = parse((ROOT / "requirements-sglang-env.txt").read_text()) + [Requirement("sglang==0.5.23")]
    names = {re.sub(r"[-_.]+", "-", r.name.lower()) for r in reqs}
    installed = dict.fromkeys(names, "1.0") | {"sglang": "0.5.23"}
    assert unmet(applicable(reqs, "3.11"), installed | {"megatron-core": "0.16.1"}) == []
    assert unmet(applicable(reqs, "3.12"), installed | {"megatron-core": "0.16.1"}) == [
        f'megatron-core=={megatron_pin(ROOT / PINNED[0], "3.12")}; python_version >= "3.12": 0.16.1 installed']
    on_312 = megatron_pin(ROOT / PINNED[0], "3.12")
    assert unmet(applicable(reqs, "3.11"), installed | {"megatron-core": on_312}) == [
        f'megatron-core==0.16.1; python_version < "3.12": {on_312} installed']
    assert unmet(applicable(reqs, "3.12"), installed | {"megatron-core": on_312}) == []
    without = {k: v for k, v in installed.items() if k != "fastapi"} | {"megatron-core": "0.16.1"}
    assert unmet(applicable(reqs, "3.11"), without) == ["fastapi: not installed"]


def test_pip_options_are_refused():
    with pytest.raises(ValueError, match="pip options"):
        parse("-r other.txt\n")
    assert [str(r) for r in parse("# c\n\nnumpy  # why\n")] == ["numpy"]
