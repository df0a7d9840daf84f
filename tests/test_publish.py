"""Directories published whole (gspo.publish.staged): all or nothing, leftovers, races."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from gspo.publish import leftovers, staged, temp_path


def dot_entries(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_a_staged_directory_appears_whole_or_not_at_all(tmp_path):
    final = tmp_path / "cache" / "entry"
    with staged(final) as tmp:
        assert tmp.parent == final.parent and tmp.name.startswith(".entry.gspo-")
        (tmp / "a").write_text("1")
        assert not final.exists()  # nothing is visible while it is written
    assert (final / "a").read_text() == "1"
    assert dot_entries(final.parent) == []

    with pytest.raises(OSError, match="disk full"), staged(tmp_path / "cache" / "other") as tmp:
        (tmp / "a").write_text("half")
        raise OSError("disk full")
    assert not (tmp_path / "cache" / "other").exists()
    assert dot_entries(final.parent) == []  # the half-written directory is gone


def test_an_existing_directory_is_replaced_unless_kept(tmp_path):
    final = tmp_path / "entry"
    for text in ("first", "second"):
        with staged(final) as tmp:
            (tmp / "a").write_text(text)
    assert (final / "a").read_text() == "second"
    # an identical process published first and its entry will do: it stays, ours goes
    with staged(final, keep=lambda existing: (existing / "a").is_file()) as tmp:
        (tmp / "a").write_text("third")
    assert (final / "a").read_text() == "second"
    # a damaged one does not do: it is replaced
    (final / "a").unlink()
    with staged(final, keep=lambda existing: (existing / "a").is_file()) as tmp:
        (tmp / "a").write_text("fourth")
    assert (final / "a").read_text() == "fourth"
    assert dot_entries(tmp_path) == []


def test_leftovers_of_dead_writers_go_and_live_ones_stay(tmp_path):
    final = tmp_path / "entry"
    dead = temp_path(final, "dead")  # a killed run's: nobody holds its lock
    old_style = tmp_path / ".entry.12345.tmp"  # an earlier gspo's pid-named one
    live = temp_path(tmp_path / "other", "live")  # another run writing right now
    mine = tmp_path / ".entry.notes"  # not a temporary name
    for path in (dead, old_style, live, mine):
        path.mkdir()
    held = os.open(live, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        assert leftovers(final) == sorted([dead, old_style])
        with staged(final) as tmp:
            (tmp / "a").write_text("1")
            assert not dead.exists() and not old_style.exists() and live.is_dir()
            # while it is written, another writer takes it for a live one
            assert tmp not in leftovers(final)
    finally:
        os.close(held)
    assert live in leftovers(final)  # its writer is gone now
    assert mine.is_dir() and (final / "a").is_file()


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_published_files_are_as_readable_as_the_umask_allows(tmp_path, umask):
    """safetensors writes 0o600 whatever the umask: an export or checkpoint was unreadable
    to anyone else (a vLLM server running as another user)."""
    import torch
    from safetensors.torch import save_file

    old = os.umask(umask)
    try:
        with staged(tmp_path / "model") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
            (tmp / "run.sh").write_text("#!/bin/sh\n")
            (tmp / "run.sh").chmod(0o755)
            (tmp / "sub").mkdir()
            (tmp / "sub" / "notes.txt").write_text("x")
    finally:
        os.umask(old)
    mode = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "model").rglob("*")}
    assert mode["model.safetensors"] == 0o666 & ~umask
    assert mode["notes.txt"] == 0o666 & ~umask
    assert mode["run.sh"] == 0o755  # more than the umask gives is left as it is


def test_an_unknown_umask_widens_nothing(tmp_path, monkeypatch):
    """Without /proc/self/status's Umask line (Linux before 4.7) the umask was taken to be
    0o022: a user's umask 0o077 gave checkpoints every user could read."""
    from gspo import publish

    real = Path.read_text

    def read_text(self, *args, **kwargs):
        if str(self) == "/proc/self/status":
            return "Name:\tpython\nState:\tR (running)\n"
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    assert publish._umask() is None
    old = os.umask(0o077)
    try:
        with staged(tmp_path / "model") as tmp:
            (tmp / "weights").write_bytes(b"x")
            (tmp / "weights").chmod(0o600)
            (tmp / "notes.txt").write_text("x")
    finally:
        os.umask(old)
    mode = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "model").rglob("*")}
    assert mode == {"weights": 0o600, "notes.txt": 0o600}


def test_a_refused_chmod_still_publishes(tmp_path, monkeypatch):
    """A filesystem that refuses the chmod (EPERM) failed the whole write of a checkpoint
    that was whole (under torchrun rank 0 raised while the others waited at the barrier)."""
    import errno

    def chmod(self, mode, **kwargs):
        raise PermissionError(errno.EPERM, "Operation not permitted", str(self))

    old = os.umask(0o022)
    try:
        with staged(tmp_path / "model") as tmp:
            (tmp / "weights").write_bytes(b"x")
            (tmp / "weights").chmod(0o600)
            monkeypatch.setattr(Path, "chmod", chmod)
    finally:
        os.umask(old)
    assert (tmp_path / "model" / "weights").read_bytes() == b"x"
    assert (tmp_path / "model" / "weights").stat().st_mode & 0o777 == 0o600
