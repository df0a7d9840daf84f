"""Which uid a sandboxed program runs as (:mod:`gspo.rewards.sandbox`).

The kernel's process-count limit (``RLIMIT_NPROC``) counts every process of a uid, and root
is exempt from it. A trainer running as root therefore runs each program under another uid,
and under a uid of its own while it runs (:func:`program_uid`): programs scored at once that
shared one uid (``nobody``) shared one limit, so a fork bomb in one completion failed the
``fork`` of a right answer beside it (scored 0 alone 1). The uids come from a block that no
account holds (a program owns no files) and that this user namespace maps; where there is
none, every program runs as ``nobody`` (the limit shared again), or, in a namespace
that maps its root alone, as the trainer. A trainer that is not root
runs its programs as itself: the limit is then shared with its own processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import pwd
import threading
from collections.abc import Iterator
from pathlib import Path

#: How many uids the block holds: programs run at once by all the trainers on a machine.
BLOCK = 4096
#: Where a block may start, first choice first (2**30: far above any account's uid; the
#: others inside the 65,536 ids a rootless container maps).
STARTS = (1 << 30, 1 << 20, 200_000, 60_000 - BLOCK)

#: Where a uid held is locked (``flock``, one file a uid): every process that runs programs
#: on the machine (trainers, their reward workers) sees the others' (released when it dies).
LOCKS = "/tmp/gspo-program-uids"

_taken: set[int] = set()
_lock = threading.Lock()


def _claim(uid: int) -> int | None:
    """An open file descriptor holding ``uid``'s lock, -1 where no lock can be made (the
    scan of live processes alone), or None: another process holds it."""
    try:
        os.makedirs(LOCKS, mode=0o700, exist_ok=True)
        if os.lstat(LOCKS).st_uid != os.getuid():  # (another user's: not trusted)
            return -1
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = os.open(f"{LOCKS}/{uid}", flags, 0o600)
    except OSError:
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def sandbox_ids() -> tuple[int, int]:
    """The uid/gid the sandbox's identity is checked for (what it may read and pass
    through): ``nobody`` when the trainer is root, else the trainer's."""
    if os.getuid() != 0:
        return os.getuid(), os.getgid()
    try:
        entry = pwd.getpwnam("nobody")
        ids = entry.pw_uid, entry.pw_gid
    except KeyError:
        ids = 65534, 65534
    if not any(ids[0] in span for span in _mapped()):
        # a namespace that maps its root alone (`unshare -r`): as a trainer not root (its
        # root, another uid outside, has the limit too; chown to nobody failed, EINVAL)
        return os.getuid(), os.getgid()
    return ids


def _mapped() -> list[range]:
    """The uids this user namespace maps (all where it cannot be read)."""
    try:
        lines = Path("/proc/self/uid_map").read_text().split("\n")
    except OSError:
        return [range(0, 1 << 32)]
    spans = [line.split() for line in lines if line.strip()]
    return [range(int(s[0]), int(s[0]) + int(s[2])) for s in spans if len(s) == 3]


@functools.cache
def uid_block() -> range:
    """The uids programs run as: under root a block of :data:`BLOCK` that this namespace
    maps and no account holds, else the one uid of :func:`sandbox_ids`."""
    uid = sandbox_ids()[0]
    if os.getuid() != 0:
        return range(uid, uid + 1)
    accounts = {entry.pw_uid for entry in pwd.getpwall()}
    for start in STARTS:
        block = range(start, start + BLOCK)
        mapped = any(block.start in m and block[-1] in m for m in _mapped())
        if mapped and not any(u in block for u in accounts):
            return block
    return range(uid, uid + 1)


def _owners() -> set[int]:
    """The uids that own a live process."""
    owners = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                owners.add(os.stat(f"/proc/{entry}").st_uid)
    return owners


@contextlib.contextmanager
def program_uid() -> Iterator[int]:
    """A uid of :func:`uid_block` for one program while it runs: one no other program of
    this process holds, no live process owns and no other process has locked (:data:`LOCKS`:
    another trainer's or reward worker's program about to start), searched from a place set
    by this process's id; the block's first if every one is held (shared)."""
    block, held = uid_block(), -1  # (held: the lock's file descriptor, -1: none)
    with _lock:
        owners = _owners() if len(block) > 1 else set()
        start = os.getpid() * 64
        free = (block[(start + k) % len(block)] for k in range(len(block)))
        for uid in (u for u in free if u not in _taken and u not in owners):
            # (locked while its program runs: another's scan may not see it start)
            if len(block) > 1 and (held := _claim(uid)) is None:
                continue
            break
        else:
            uid, held = block[0], -1
        shared = uid in _taken
        _taken.add(uid)
    try:
        yield uid
    finally:
        if held >= 0:
            os.close(held)
        if not shared:
            with _lock:
                _taken.discard(uid)
