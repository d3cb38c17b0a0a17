"""megatron-core imported with its import-time ``torch.compile`` deferred to each function's first call,
and without importing ``wandb``, which stays importable afterwards."""

import subprocess
import sys
from pathlib import Path


from gyre.training.megatron_import import compile_on_first_call

ROOT = Path(__file__).resolve().parents[2]


def test_the_deferred_compile_runs_once_on_the_first_call_with_the_same_options():
    calls = []

    def fake_compile(model, **options):
        calls.append((model.__name__, options))
        return lambda x: model(x) + 100  # the "compiled" function, told apart from the original

    deferred = compile_on_first_call(fake_compile)

    def square(x):
        return x * x

    wrapped = deferred(square, dynamic=True)
    decorated = deferred(mode="max-autotune")(square)  # the decorator form
    assert calls == [] and wrapped.__name__ == "square"
    assert wrapped(3) == 109 and wrapped(4) == 116
    assert calls == [("square", {"dynamic": True})]
    assert decorated(2) == 104 and decorated(5) == 125
    assert calls == [("square", {"dynamic": True}), ("square", {"mode": "max-autotune"})]


def test_megatron_core_imports_without_inductor_and_torch_compile_is_restored():
    probe = ("import sys, torch\n"
             "real = torch.compile\n"
             "from gyre.training.megatron_import import import_megatron_core\n"
             "core = import_megatron_core()\n"
             "import megatron.core.jit as jit\n"
             "from megatron.core.fusions.fused_bias_geglu import geglu\n"
             "print(core is sys.modules['megatron.core'], torch.compile is real, jit.jit_fuser is real,\n"
             "      'torch._inductor.compile_fx' in sys.modules, geglu.__name__, 'wandb' in sys.modules)\n"
             "import wandb\n"
             "print(wandb.__name__)\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT,
                       env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
                            "PATH": "/usr/bin:/bin"}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["True", "True", "False", "False", "geglu", "False", "wandb"]
