"""An optional kernel package that is installed but cannot load its CUDA library (an SGLang
environment on a machine without libcuda) counts as absent for Megatron, which catches only
ImportError when it probes for it."""

import sys

from gyre.training import megatron_model


def test_a_kernel_package_failing_with_oserror_is_hidden(tmp_path, monkeypatch):
    pkg = tmp_path / "gyre_fake_kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise OSError('libcuda.so.1: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(megatron_model, "OPTIONAL_KERNEL_PACKAGES", ("gyre_fake_kernels", "gyre_not_installed"))
    monkeypatch.delitem(sys.modules, "gyre_fake_kernels", raising=False)
    assert megatron_model.hide_unloadable_kernel_packages() == ["gyre_fake_kernels"]
    try:
        import gyre_fake_kernels  # noqa: F401
    except ImportError:
        pass
    else:
        raise AssertionError("the unloadable package still imports")
    assert "gyre_not_installed" not in sys.modules
    monkeypatch.delitem(sys.modules, "gyre_fake_kernels")
