"""Where a report's figures were measured (gspo.provenance)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

import gspo
from gspo.provenance import code_commit, machine


def test_the_commit_is_gspo_commit_where_set_and_a_git_commit_here(monkeypatch):
    monkeypatch.setenv("GSPO_COMMIT", "abc1234")
    assert code_commit() == "abc1234"  # (a tree copied without its .git: the GPU machine)
    monkeypatch.delenv("GSPO_COMMIT")
    commit = code_commit()
    if shutil.which("git") is None or not (Path(__file__).parent.parent / ".git").exists():
        assert commit == f"gspo {gspo.__version__} (not a git checkout)"
        return
    head = commit.removesuffix("+dirty")
    assert len(head) >= 7 and all(c in "0123456789abcdef" for c in head), commit


def test_the_machine_names_cores_and_torch():
    said = machine()
    assert f"torch {torch.__version__}" in said and " cores, " in said
    if not torch.cuda.is_available():
        assert said.endswith(torch.backends.cpu.get_cpu_capability())
