"""The installed import root: the wheel lives under `pagestream`, beside Hugging Face's `kernels`.

Before the import root, pagestream installed top-level `engine`, `worker`, `producer` and
`kernels` packages: HF's `kernels` (which transformers integrates) overwrote
`kernels/__init__.py` and uninstalling either deleted the other's file.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import sys, kernels, pagestream
from pagestream import LLM, SamplingParams, Producer
import pagestream.producer.client.producer, pagestream.worker.cli
assert not kernels.__file__.startswith(pagestream.__path__[0]), kernels.__file__
print("torch" in sys.modules, LLM.__module__, SamplingParams.__module__, Producer.__module__)
"""


def run(*cmd: str, cwd: Path) -> str:
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


UV = Path(sys.executable).with_name("uv")  # `make install` puts uv in the venv; pip where it is missing


def pip(py: str, *args: str) -> list[str]:
    return [str(UV), "pip", *args, "--python", py] if UV.exists() else [py, "-m", "pip", *args]


@pytest.mark.slow
def test_the_wheel_installs_beside_hf_kernels_and_a_producer_install_loads_no_torch(tmp_path):
    had_build = (ROOT / "build").exists()
    try:
        if UV.exists():
            run(str(UV), "build", "-q", "--wheel", "--out-dir", str(tmp_path / "dist"), str(ROOT), cwd=tmp_path)
        else:
            run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(ROOT), cwd=tmp_path)
    finally:
        if not had_build:  # setuptools builds in the source tree; leave the checkout as it was
            shutil.rmtree(ROOT / "build", ignore_errors=True)
    wheel = next((tmp_path / "dist").glob("pagestream-*.whl"))
    venv = tmp_path / "venv"
    run(*([str(UV), "venv", "-q", "--python", sys.executable] if UV.exists() else [sys.executable, "-m", "venv"]),
        str(venv), cwd=tmp_path)
    py = str(venv / "bin" / "python")
    # the base install is the producer side: no torch, no engine extra
    run(*pip(py, "install", "-q", str(wheel), "kernels"), cwd=tmp_path)
    torch_loaded, llm_mod, sp_mod, producer_mod = run(py, "-c", PROBE, cwd=tmp_path).split()
    assert torch_loaded == "False"
    assert (llm_mod, sp_mod, producer_mod) == (
        "pagestream.engine.llm", "pagestream.engine.sampling_params", "pagestream.producer.client.producer")
    site = Path(run(py, "-c", "import kernels, os; print(os.path.dirname(kernels.__file__))", cwd=tmp_path).strip())
    hf_init = (site / "__init__.py").read_text()
    assert "pagestream" not in hf_init  # HF's own file, not ours
    # uninstalling pagestream leaves HF's package whole
    run(*(pip(py, "uninstall", "-q", "pagestream") if UV.exists() else [py, "-m", "pip", "uninstall", "-q", "-y", "pagestream"]),
        cwd=tmp_path)
    assert (site / "__init__.py").read_text() == hf_init
    run(py, "-c", "import kernels", cwd=tmp_path)
