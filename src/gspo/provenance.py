"""Where a figure was measured: the gspo code that ran and the machine, for the first line
of a report (``gspo compare``'s, the benchmarks', the experiments')."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import gspo

#: The paths whose uncommitted changes mark a commit ``+dirty``: the library and the
#: scripts that measure it (reports written under docs/ do not count).
MEASURED = ("src", "benchmarks", "experiments")


def code_commit() -> str:
    """The commit of the repository gspo is imported from (wherever the process runs),
    ``+dirty`` with uncommitted changes to :data:`MEASURED`; ``GSPO_COMMIT`` where the
    tree was copied without its ``.git`` (a GPU machine); else the installed version."""
    if os.environ.get("GSPO_COMMIT"):
        return os.environ["GSPO_COMMIT"]
    package = Path(gspo.__file__).resolve()
    git = ["git", "-C", str(package.parent)]
    try:
        # gspo's own checkout: a venv inside another project's repository is not one
        ours = subprocess.run([*git, "ls-files", "--error-unmatch", package.name],
                              capture_output=True, text=True)  # fmt: skip
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True)  # fmt: skip
        root = subprocess.run([*git, "rev-parse", "--show-toplevel"],
                              capture_output=True, text=True)  # fmt: skip
        dirty = subprocess.run(
            [*git, "-C", root.stdout.strip() or ".", "status", "--porcelain", "--", *MEASURED],
            capture_output=True, text=True,
        )  # fmt: skip
    except OSError:  # no git
        ours = None
    if ours is None or ours.returncode != 0 or not head.stdout.strip():
        return f"gspo {gspo.__version__} (not a git checkout)"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def machine() -> str:
    """The CPU's model name (hosts of one name differ a lot in speed), the cores this
    process may use, the GPU when CUDA has one (else torch's CPU capability), and torch's
    version."""
    name = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                name = f"{line.split(':', 1)[1].strip()} ({platform.machine()})"
                break
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    import torch

    if torch.cuda.is_available():
        return f"{name}, {cores} cores, {torch.cuda.get_device_name()}, torch {torch.__version__}"
    capability = torch.backends.cpu.get_cpu_capability()  # (the CPU kernels torch picks)
    return f"{name}, {cores} cores, torch {torch.__version__} {capability}"


def measured_at() -> str:
    """A benchmark's first line: the code and the machine its figures come from."""
    return f"gspo at {code_commit()}; machine: {machine()}"
