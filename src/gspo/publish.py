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

Every directory put in place is counted here (:data:`WRITTEN`: bytes and seconds, rank 0's
view of the whole directory), and a write that fills the disk ends in one
:class:`DiskFull` line naming the directory, the space it needs and the space free. One
small file is written whole the same way (:func:`write_atomic`).

A directory whose bytes must still be the ones written when it is read back (every RL
checkpoint) records each file's size and CRC-32 in its :data:`MANIFEST`
(:func:`write_manifest`, before it is put in place); a reader checks the files it reads
(:func:`check_manifest`): a file changed since (a disk fault, a partial copy) is one
:class:`DamagedFile` line naming it, never garbage weights or a raw traceback.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import shutil
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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


@dataclass
class Written:
    """What :func:`staged` has put in place in this process (rank 0 counts for all ranks)."""

    bytes: int = 0
    seconds: float = 0.0  # from entering :func:`staged` to the directory in place
    directories: int = 0


#: This process's running total; a reader takes the difference over what it measures.
WRITTEN = Written()


class DiskFull(OSError):
    """A directory that did not fit on its disk (``errno.ENOSPC``), said in one line."""


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (links not followed)."""
    files = (f for f in Path(path).rglob("*") if f.is_file() and not f.is_symlink())
    return sum(f.lstat().st_size for f in files)


def megabytes(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc``, or what caused it, is a full disk: ``ENOSPC``/``EDQUOT``, or how
    torch (``enforce fail at inline_container``: a failed write) and safetensors say it."""

    def says(text: str) -> bool:
        return any(t in text for t in ("No space left", "os error 28")) or (
            "inline_container" in text and "write" in text
        )

    return _caused_by(exc, (errno.ENOSPC, errno.EDQUOT), says)


def is_file_too_large(exc: BaseException | None) -> bool:
    """Whether ``exc``, or what caused it, is ``EFBIG``: a limit on one file's size (``ulimit
    -f``, or the filesystem's largest file), as Python, torch or safetensors say it."""
    return _caused_by(exc, (errno.EFBIG,), lambda t: "File too large" in t or "os error 27" in t)


def _caused_by(
    exc: BaseException | None, numbers: tuple[int, ...], says: Callable[[str], bool]
) -> bool:
    """Whether ``exc`` or an exception in its chain is an ``OSError`` of one of the
    ``numbers``, or its text ``says`` so (torch and safetensors wrap the error in text)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if (isinstance(exc, OSError) and exc.errno in numbers) or says(str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def disk_full(final: Path, needs: int | None, written: int) -> DiskFull:
    """The one line for ``final`` not fitting: ``needs`` bytes (estimated by the writer),
    else more than the ``written`` bytes it reached."""
    free = shutil.disk_usage(next(p for p in [final, *final.parents] if p.exists())).free

    def size(n: int) -> str:  # (a pointer file of a few bytes is not "0.0 MiB")
        if n < 1024:
            return f"{n} bytes"
        return megabytes(n) if n >= 2**20 else f"{n / 1024:,.1f} KiB"

    what = f"about {size(needs)}" if needs else f"more than {size(written)}"
    if not needs and not written:
        what = "more"
    return DiskFull(
        errno.ENOSPC, f"No space left on device writing {final}: it needs {what}, {size(free)} free"
    )


def write_atomic(path: Path, text: str) -> None:
    """``text`` into the file ``path``, whole or not at all (a full disk: one
    :class:`DiskFull` line naming it, the partial file removed)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if is_disk_full(exc):
            raise disk_full(path, len(text.encode()), 0) from exc
        raise


#: In a directory written with one: ``{"crc32": {relative path: [bytes, "CRC-32 in hex"]}}``
#: (eight digits: the file's length does not depend on the values).
MANIFEST = "manifest.json"
_CHUNK = 16 * 2**20


class DamagedFile(ValueError):
    """A file whose bytes are not the ones its :data:`MANIFEST` records, said in one line."""


def file_crc32(path: Path) -> int:
    """The CRC-32 of the file ``path`` (zlib's, read in 16 MiB chunks, the GIL released
    while it runs): 0.2 s a GiB read back from the page cache on a 2-core EPYC."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(directory: Path) -> None:
    """Record the size and CRC-32 of every file under ``directory`` in its
    :data:`MANIFEST` (written last: call it once every file is there). The files are read
    by up to 8 threads at once (zlib releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    directory = Path(directory)
    paths = [
        f
        for f in sorted(directory.rglob("*"))
        if f.is_file() and not f.is_symlink() and f != directory / MANIFEST
    ]
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        crcs = list(pool.map(file_crc32, paths))
    files = {
        f.relative_to(directory).as_posix(): [f.stat().st_size, f"{crc:08x}"]
        for f, crc in zip(paths, crcs, strict=True)
    }
    (directory / MANIFEST).write_text(json.dumps({"crc32": files}, indent=0) + "\n")


def manifest_changes(
    directory: Path,
    include: Callable[[str], bool] | None = None,
    *,
    contents: bool = True,
    required: bool = False,
) -> Iterator[tuple[str, str]]:
    """``(relative path, what is wrong)`` for each file of ``directory``'s :data:`MANIFEST`
    (those ``include`` takes) that is missing, of another size, or, with ``contents``,
    holds other bytes (read whole: the only costly part). Without a manifest: nothing (a
    directory gspo did not write), or, ``required`` (one it writes with one), that."""
    manifest = Path(directory) / MANIFEST
    if not manifest.is_file():
        if required:
            yield MANIFEST, "is missing"
        return
    try:
        recorded = json.loads(manifest.read_text())["crc32"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        yield MANIFEST, f"is unreadable ({type(exc).__name__})"
        return
    for name, (size, crc) in recorded.items():
        if include is not None and not include(name):
            continue
        file = Path(directory) / name
        if not file.is_file():
            yield name, "is missing"
            continue
        got = file.stat().st_size
        if got != size:
            cut = "is cut short" if got < size else "has grown"
            yield name, f"{cut} ({got:,} bytes, written as {size:,})"
        elif contents and (now := f"{file_crc32(file):08x}") != crc:
            yield name, f"holds other bytes (CRC-32 {now}, written as {crc})"


def check_manifest(directory: Path, include: Callable[[str], bool] | None = None) -> None:
    """A :class:`DamagedFile` naming the first file of ``directory`` (of those ``include``
    takes) whose bytes are not the ones its :data:`MANIFEST` records; an RL checkpoint
    (``checkpoints/step-*`` holding its trainer state) without its manifest too (nothing
    to check it against)."""
    directory = Path(directory)
    checkpoint = directory.parent.name == "checkpoints" and directory.name.startswith("step-")
    # (gspo's own: its trainer state beside; another trainer's checkpoints/step-N, a user's
    # model, has no manifest to miss)
    required = checkpoint and (directory / "trainer_state.pt").is_file()
    for name, wrong in manifest_changes(directory, include, required=required):
        if checkpoint:
            raise DamagedFile(
                f"{directory / name} {wrong}: {directory} was damaged after it was written "
                f"(a disk fault or a partial copy); delete {directory} to go back to the "
                "checkpoint before it"
            )
        raise DamagedFile(  # a model directory copied out of a run (a LoRA base, model.path)
            f"{directory / name} {wrong}: {directory} changed after gspo wrote it (a disk "
            "fault, a partial copy, or other weights saved over it); put its files back"
        )


def temp_path(final: Path, token: str, state: str = ".tmp") -> Path:
    """The temporary name of ``final`` for the writer ``token`` (the one naming rule)."""
    return final.with_name(f".{final.name}{MARK}{token}{state}")


def locked_by_someone(path: Path) -> bool:
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


def stranded_asides(final: Path) -> list[Path]:
    """Runs an earlier ``--overwrite`` of ``final`` set aside (``.<name>.gspo-<token>.aside``)
    and never put back or removed, no live process holding them: that process was killed
    before its new run started. Never swept as leftovers are."""
    if not final.parent.is_dir():
        return []
    return sorted(
        p for p in final.parent.glob(temp_path(final, "*", ".aside").name)
        if p.is_dir() and not locked_by_someone(p)
    )  # fmt: skip


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
            if not young and not locked_by_someone(path):
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


def _umask() -> int | None:
    """The process's umask, read without setting it (``os.umask`` sets it: for a moment
    another thread's files would be made with the stand-in value); None where it cannot be
    read so (no ``Umask:`` line before Linux 4.7, no /proc)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return None


def readable_as_umask_allows(directory: Path) -> None:
    """Give every file under ``directory`` the permissions a file made by ``open`` gets
    (0o666 less the umask) where its writer gave fewer: safetensors writes its files
    0o600, so an export or checkpoint was unreadable to the group (a server running as
    another user, a colleague on a shared cluster) whatever the umask said. An umask that
    cannot be read leaves the files as they are (a guessed 0o022 gave a user's umask 0o077
    files everyone could read), and so does a filesystem that refuses the chmod (the
    checkpoint is whole: it is published all the same)."""
    umask = _umask()
    if umask is None:
        return
    wanted = 0o666 & ~umask
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink():
            mode = path.stat().st_mode & 0o777
            if mode | wanted != mode:
                with contextlib.suppress(OSError):  # (EPERM: not ours, or no chmod there)
                    path.chmod(mode | wanted)


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
    needs: int | None = None,
) -> Iterator[Path]:
    """A temporary directory that every rank writes into; ``final`` once all are done.

    Called by every rank of ``dist`` together (a single process by default). Rank 0 makes
    the directory and sends its name to the others; on leaving the block every rank says
    whether its part succeeded, and rank 0 publishes it (:func:`publish`, ``keep``
    deciding over an existing ``final``) only if all did. A failure on any rank removes
    the directory and raises on every rank: the rank's own exception, or an ``OSError``
    naming the rank that failed. A full disk (:func:`is_disk_full`) is a :class:`DiskFull`
    naming ``final``, the ``needs`` bytes the writer expects it to take, and the space free.
    """
    start = time.perf_counter()
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
            reached = tree_bytes(tmp) if main else 0
            if main:
                shutil.rmtree(tmp, ignore_errors=True)

            def anywhere(test: Callable[[BaseException | None], bool]) -> bool:
                return test(failure) or any(test(OSError(f)) for f in failures if f)

            if anywhere(is_disk_full):  # (every rank raises the same line)
                raise disk_full(final, needs, reached) from failure
            if anywhere(is_file_too_large):
                raise OSError(
                    errno.EFBIG,
                    f"File too large writing {final}: a limit on one file's size stopped it "
                    "(ulimit -f, or the filesystem's largest file)",
                ) from failure
            if failure is not None:
                raise failure
            rank, why = next((r, f) for r, f in enumerate(failures) if f)
            raise OSError(errno.EIO, f"rank {rank} failed writing {final} ({why})")
        if main:
            size = tree_bytes(tmp)
            readable_as_umask_allows(tmp)
            if publish(tmp, final, token, keep):
                WRITTEN.bytes += size
                WRITTEN.directories += 1
            WRITTEN.seconds += time.perf_counter() - start
        if dist is not None:
            dist.barrier()  # nobody reads ``final`` before it is in place
    finally:
        if made is not None:
            os.close(made[2])


@contextlib.contextmanager
def machine_errors_in_threads_said_in_one_line() -> Iterator[None]:
    """A full disk met by another thread (TensorBoard's writer) is one warning line, not its
    traceback: the main thread's next write meets it too and ends the run with its own
    line (other errors in threads keep Python's report)."""
    before = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if not is_disk_full(args.exc_value):
            before(args)
            return
        said = getattr(args.exc_value, "strerror", None) or args.exc_value
        thread = f"the thread {args.thread.name if args.thread is not None else '?'}"
        if type(args.thread).__module__.startswith("tensorboard."):
            thread = "TensorBoard's writer (log.tensorboard)"
        print(f"gspo: warning: {said}: {thread} stopped", file=sys.stderr)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = before
