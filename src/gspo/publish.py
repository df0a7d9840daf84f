"""Directories written whole or not at all, by one process or by every rank of a run.

:func:`staged` is the one way gspo writes a directory that readers must see complete:
the cold-start cache's entries and progress checkpoints, RL checkpoints, exports and the
built-in base model. Every rank of the run writes into the same temporary directory
beside the target, named ``.<target>.gspo-<token>.tmp`` with a token that rank 0 draws
and sends to the others (never a process id: each rank has its own); once every rank
is done, rank 0 renames it into place, one ``os.replace``. A reader sees the whole
directory or none of it.

Rank 0 holds an advisory lock (``flock``) on the temporary directory while it writes, so a
leftover of a killed run, whose lock the kernel dropped with the process, is told from
the directory of a run still writing: each :func:`staged` first removes the leftovers
beside its target. Two processes publishing the same target at once (two identical runs)
both finish: the later rename replaces the earlier directory, or, where ``keep`` says the
existing one will do (a complete cache entry), leaves it and drops its own.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gspo.distributed import Distributed

#: Marks gspo's temporary names (``.<name>.gspo-<token>.<state>``).
MARK = ".gspo-"
# a directory is made under ``.new``, locked, then renamed to ``.tmp``: a ``.tmp`` is
# locked for as long as its writer lives; ``.old`` is a replaced target being removed
_STATES = (".new", ".tmp", ".old")
_NEW_GRACE_S = 600.0  # an unlocked ``.new`` younger than this may be a writer's, just made


def temp_path(final: Path, token: str, state: str = ".tmp") -> Path:
    """The temporary name of ``final`` for the writer ``token`` (the one naming rule)."""
    return final.with_name(f".{final.name}{MARK}{token}{state}")


def _locked_by_someone(path: Path) -> bool:
    """Whether a live process holds ``path``'s lock (True when that cannot be told)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return True  # gone already, or unreadable: leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True  # held (EWOULDBLOCK), or a filesystem without flock
    finally:
        os.close(fd)  # (releases the lock just taken)
    return False


def leftovers(final: Path) -> list[Path]:
    """Temporary directories beside ``final`` that no live process is writing.

    gspo's own (``.<any name>.gspo-<token>.tmp``, ``.old``, and a ``.new`` left for
    ten minutes) whose lock nobody holds, and the temporary names earlier gspo versions
    gave ``final`` (``.<name>.tmp``, ``.<name>.<pid>.tmp``, ``.<name>.sharded.tmp``).
    """
    parent = final.parent
    if not parent.is_dir():
        return []
    found = []
    for path in parent.iterdir():
        name = path.name
        if not name.startswith(".") or not path.is_dir() or path.is_symlink():
            continue
        if MARK in name and name.endswith(_STATES):
            young = name.endswith(".new") and time.time() - path.stat().st_mtime < _NEW_GRACE_S
            if not young and not _locked_by_someone(path):
                found.append(path)
        elif name.startswith(f".{final.name}.") and name.endswith(".tmp"):
            found.append(path)  # an earlier version's naming: never locked
    return sorted(found)


def remove_leftovers(final: Path) -> None:
    for path in leftovers(final):
        shutil.rmtree(path, ignore_errors=True)


def _make_locked(final: Path) -> tuple[Path, str, int]:
    """A new locked temporary directory for ``final``: ``(path, token, lock fd)``."""
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(final)
    token = secrets.token_hex(6)
    new = temp_path(final, token, ".new")
    new.mkdir()
    fd = os.open(new, os.O_RDONLY)
    with contextlib.suppress(OSError):  # no flock (some network filesystems): no lock
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    tmp = temp_path(final, token)
    os.rename(new, tmp)  # (the lock is the directory's: it follows the rename)
    return tmp, token, fd


def publish(tmp: Path, final: Path, token: str, keep: Callable[[Path], bool] | None) -> bool:
    """Rename the finished ``tmp`` to ``final``; whether it was put in place.

    An existing ``final`` is replaced (moved aside, then removed), unless ``keep(final)``
    says it will do: ``tmp`` is then removed. A ``final`` that another process puts in
    place meanwhile is treated the same way.
    """
    for _ in range(3):
        try:
            os.replace(tmp, final)
            return True
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        if keep is not None and keep(final):
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        old = temp_path(final, token, ".old")
        with contextlib.suppress(FileNotFoundError):  # gone meanwhile: try again
            os.replace(final, old)
        shutil.rmtree(old, ignore_errors=True)
    raise OSError(errno.EEXIST, "another process keeps writing it", str(final))


@contextlib.contextmanager
def staged(
    final: Path,
    dist: Distributed | None = None,
    *,
    keep: Callable[[Path], bool] | None = None,
) -> Iterator[Path]:
    """A temporary directory that every rank writes into; ``final`` once all are done.

    Called by every rank of ``dist`` together (a single process by default). Rank 0 makes
    the directory and sends its name to the others; on leaving the block every rank says
    whether its part succeeded, and rank 0 publishes it (:func:`publish`, ``keep``
    deciding over an existing ``final``) only if all did. A failure on any rank removes
    the directory and raises on every rank: the rank's own exception, or an ``OSError``
    naming the rank that failed.
    """
    final = Path(final)
    main = dist is None or dist.is_main
    made: tuple[Path, str, int] | None = None
    unmade: OSError | None = None
    told: str | tuple[str, str] | None = None
    if main:
        try:
            made = _make_locked(final)
            told = (str(made[0]), made[1])
        except OSError as exc:
            unmade, told = exc, f"{exc.strerror or exc}: {exc.filename or final.parent}"
    if dist is not None and dist.enabled:
        told = dist.gather_objects(told)[0]
    if unmade is not None:
        raise unmade
    if isinstance(told, str):
        raise OSError(errno.EIO, f"rank 0 could not write beside {final} ({told})")
    assert told is not None
    tmp, token = Path(told[0]), told[1]
    try:
        failure: Exception | None = None
        try:
            yield tmp
        except Exception as exc:
            failure = exc
        said = None if failure is None else f"{type(failure).__name__}: {failure}"
        failures = [said] if dist is None or not dist.enabled else dist.gather_objects(said)
        if any(failures):
            if main:
                shutil.rmtree(tmp, ignore_errors=True)
            if failure is not None:
                raise failure
            rank, why = next((r, f) for r, f in enumerate(failures) if f)
            raise OSError(errno.EIO, f"rank {rank} failed writing {final} ({why})")
        if main:
            publish(tmp, final, token, keep)
        if dist is not None:
            dist.barrier()  # nobody reads ``final`` before it is in place
    finally:
        if made is not None:
            os.close(made[2])
