"""Wheels of what ``make gpu-check`` needs on a GPU machine that cannot download anything.

    make gpu-wheels        # or: .venv-bench/bin/python benchmarks/gpu_wheels.py [--out .whl]

A lent GPU machine whose image already holds CUDA torch, numpy, pandas, pyarrow,
accelerate, tokenizers, safetensors, matplotlib, tensorboard, rich, PyYAML and pytest,
but not gspo's other requirements nor TRL, and that reaches no package index, gets them
as wheels carried beside the working tree. This writes them into ``--out`` (git-ignored
``.whl/``): the packages in :data:`CARRY` (no dependencies pulled), each at the version
installed in the environment that runs this script (the bench venv, where they were
tested together), for CPython 3.12 on manylinux x86-64. On the GPU machine::

    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade \\
        --target /tmp/site .whl/*.whl && \\
    PYTHONPATH=/tmp/site:src python3 benchmarks/gpu_check.py

Another image may lack more (or hold these): ``python3 -m pip check`` there says what is
missing.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path

#: gspo's requirements and TRL's beyond those such an image holds, with the packages
#: whose tested versions matter (transformers, PEFT) pinned to this environment's.
CARRY = (
    "transformers",
    "peft",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "math-verify",
    "latex2sympy2-extended",
    "antlr4-python3-runtime",
    "datasets",
    "dill",
    "multiprocess",
    "trl",
)

PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)


def pins(names: tuple[str, ...] = CARRY) -> list[str]:
    """``name==version`` of each package as installed here; a one-line error if one is not."""
    out = []
    for name in names:
        try:
            out.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit(
                f"gpu-wheels: {name} is not installed in {sys.executable}; run it in the "
                "bench venv (make gpu-wheels)"
            ) from None
    return out


def download_command(out: Path, requirements: list[str], python: str = "3.12") -> list[str]:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--python-version", python, "--implementation", "cp", "-d", str(out)]  # fmt: skip
    for platform in PLATFORMS:
        command += ["--platform", platform]
    return command + requirements


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".whl"))
    parser.add_argument("--python", default="3.12", help="the GPU machine's Python version")
    args = parser.parse_args()
    requirements = pins()
    args.out.mkdir(parents=True, exist_ok=True)
    for stale in args.out.glob("*.whl"):
        stale.unlink()
    command = download_command(args.out, requirements, args.python)
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        tail = (run.stdout + run.stderr).strip().splitlines()[-1:]
        print(f"gpu-wheels: pip download failed: {' '.join(tail)}", file=sys.stderr)
        return 1
    wheels = sorted(args.out.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels, {size / 2**20:.1f} MiB in {args.out}/:")
    for wheel in wheels:
        print(f"  {wheel.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
