"""Running untrusted Python from completions, and the built-in ``code`` reward.

A completion's code runs in a separate process per completion, never in the trainer's:

* **bubblewrap** (``bwrap``) where it is installed and works: new user, PID, network, IPC
  and UTS namespaces (no network, no view of the trainer's processes or their
  environment), a read-only view of the Python installation and system libraries only (no
  repository, no home directory, no dataset files), an empty size-capped ``tmpfs`` as the
  working directory, and ``--die-with-parent``;
* **resource limits** always: wall clock (the whole process tree is killed), CPU seconds,
  address space, process count (fork bombs), file size (runaway output), and a scrubbed
  environment (``PATH``, ``HOME`` and ``LANG`` only).

Without ``bwrap`` only the resource limits apply, and :func:`isolation` says what is then
not isolated (network, the file system outside the working directory, other processes).
Install bubblewrap (Debian/Ubuntu: ``apt-get install bubblewrap``) on machines that train
on code.

What the sandbox defends is the host and the run. A completion that reads the verifier's
own harness out of its interpreter's memory could print a forged pass line; that takes
deliberate introspection of the harness, which the harness does not expose in files,
arguments or the environment.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Container, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from math import ceil
from pathlib import Path
from typing import Any

from gspo.rewards.code_tests import (
    QUIET,
    CodeTest,
    call_harness,
    calls_passed,
    extract_code,
    parse_tests,
    program_of,
    same_output,
)
from gspo.rewards.contract import RewardError
from gspo.rewards.parsing import completion_text
from gspo.rewards.program_uids import program_uid, uid_block
from gspo.rewards.program_uids import sandbox_ids as _sandbox_ids
from gspo.rewards.thinking import aligned_prompts

__all__ = [
    "CODE_SCORING",
    "CodeTest",
    "Limits",
    "RunResult",
    "code_scores",
    "extract_code",
    "isolation",
    "parse_tests",
    "run_python",
    "score_code",
]

_SANDBOX_DIR = "/sandbox"
_HOST_PREFIX = "gspo-sandbox-"  # + the pid of the process that runs the program
#: How a program's tests become its reward (``reward.code_scoring``): the fraction it
#: passes, or 1 where it passes all of them and 0 otherwise.
CODE_SCORING = ("fraction", "all")


@dataclass(frozen=True)
class Limits:
    """Per-run limits of the sandbox (one run = one completion's program)."""

    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 1024
    max_procs: int = 32
    max_output_bytes: int = 1 << 20
    workdir_mb: int = 16
    test_cpu_s: float = 5.0  # per call-based test (wall: twice), as an input/output test has


@dataclass(frozen=True)
class RunResult:
    """What one sandboxed run gave: exit status (None if killed on the wall clock), output."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool


# --------------------------------------------------------------------------------------------
# Isolation
# --------------------------------------------------------------------------------------------


def _world_executable(path: str) -> bool:
    parts = Path(path).resolve().parts
    return all(os.stat(os.path.join(*parts[: k + 1])).st_mode & 0o001 for k in range(1, len(parts)))


@functools.cache
def _python() -> str:
    """The interpreter programs run with: this one's base interpreter (not a venv's) when the
    sandbox uid can reach it, else the system's ``python3``."""
    own = os.path.realpath(sys.executable)
    if _sandbox_ids()[0] == os.getuid() or _world_executable(own):
        return own
    system = shutil.which("python3", path="/usr/bin:/bin")
    if system is None or not _world_executable(system):
        raise RuntimeError(
            f"code sandbox: {own} is not readable by uid {_sandbox_ids()[0]} and there is no "
            "/usr/bin/python3; install a system python3 or run the trainer as a non-root user"
        )
    return os.path.realpath(system)


@functools.cache
def _host_base() -> str:
    """Where the programs' directories are made: the temp directory, or ``/tmp`` (then
    ``/dev/shm``) where the sandbox uid cannot pass through it (a root trainer with
    ``TMPDIR`` in a 0700 directory: every program run from a file failed to start)."""
    base, uid = tempfile.gettempdir(), _sandbox_ids()[0]
    if uid == os.getuid():
        return base
    for place in (base, "/tmp", "/dev/shm"):
        if os.path.isdir(place) and _world_executable(place):
            return place
    raise RuntimeError(
        f"code sandbox: uid {uid}, which runs the programs, cannot pass through {base} "
        "(TMPDIR) or /tmp: set TMPDIR to a directory others may pass through (mode o+x)"
    )


def _bwrap_args(workdir_mb: int) -> list[str]:
    args = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv"]
    for top in ("/usr", "/bin", "/lib", "/lib64", "/sbin", "/lib32", "/libx32"):
        path = Path(top)
        if path.is_symlink():
            args += ["--symlink", os.readlink(top), top]
        elif path.is_dir():
            args += ["--ro-bind", top, top]
    prefix = os.path.dirname(os.path.dirname(_python()))
    if not prefix.startswith("/usr"):
        args += ["--ro-bind", prefix, prefix]
    args += ["--proc", "/proc", "--dev", "/dev"]
    size = ["--size", str(workdir_mb << 20)]  # (every writable place sized: an unsized
    args += [*size, "--tmpfs", "/dev/shm", *size, "--tmpfs", _SANDBOX_DIR]  # /dev/shm filled RAM)
    args += ["--remount-ro", "/", "--chdir", _SANDBOX_DIR]  # (the root's own tmpfs too)
    args += ["--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", _SANDBOX_DIR]
    args += ["--setenv", "TMPDIR", _SANDBOX_DIR, "--setenv", "LANG", "C.UTF-8"]
    return args


@functools.cache
def _bwrap_works() -> bool:
    if shutil.which("bwrap") is None:
        return False
    probe_uid = uid_block()[-1]
    try:
        probe = subprocess.run(
            [*_bwrap_args(1), "--", _python(), "-I", "-c", "print(6 * 7)"],
            capture_output=True,
            timeout=30,
            env={"PATH": "/usr/bin:/bin"},
            preexec_fn=_limit_setter(Limits(), _process_count(probe_uid) + 64, probe_uid),
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0 and probe.stdout.strip() == b"42"


def isolation() -> tuple[str, str]:
    """``(mode, message)``: ``"bwrap"`` or ``"rlimits"``, and what that mode leaves open."""
    if _bwrap_works():
        return "bwrap", "bubblewrap namespaces + resource limits"
    return (
        "rlimits",
        "bubblewrap (bwrap) is not available here: completions' code runs with resource "
        "limits, a scrubbed environment and (under root) as user nobody only, NOT isolated "
        "from the network, world-writable directories or reading world-readable files "
        "(install bubblewrap, e.g. `apt-get install bubblewrap`)",
    )


@functools.cache
def _say_once(message: str) -> None:
    """``message`` as one warning line on stderr, once per process (Python's warnings
    print the calling line too)."""
    print(f"gspo: warning: {message}", file=sys.stderr, flush=True)


def _process_count(uid: int) -> int:
    """How many processes ``uid`` owns now (RLIMIT_NPROC counts them all, not just ours)."""
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += 1
    return count


def _limit_setter(limits: Limits, nproc: int, uid: int) -> Any:
    """What the child does before exec: set the limits, then become ``uid``."""
    gid = _sandbox_ids()[1]

    def apply() -> None:
        memory = limits.memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        out = limits.max_output_bytes
        resource.setrlimit(resource.RLIMIT_FSIZE, (out, out))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if uid != os.getuid():
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)

    return apply


def run_python(
    source: str,
    *,
    stdin: str = "",
    limits: Limits | None = None,
    script_on_stdin: bool = False,
) -> RunResult:
    """Run ``source`` with the base interpreter in the sandbox and return what it did.

    ``script_on_stdin=True`` feeds ``source`` itself on standard input (``python -``), so
    the program text is in no file and no argument; otherwise ``source`` is written to
    ``main.py`` in the working directory and ``stdin`` is its standard input.
    """
    limits = limits or Limits()
    mode, _ = isolation()
    # the trainer's files (what the program printed) beside, not in, the program's
    # directory: a program run without bubblewrap removed or replaced them (a link to a
    # file only root reads, scored against it)
    host_dir = tempfile.mkdtemp(prefix=f"{_HOST_PREFIX}{os.getpid()}-", dir=_host_base())
    _sweep_at_exit()
    work = Path(host_dir, "work")
    work.mkdir()
    gid = _sandbox_ids()[1]
    with program_uid() as uid:  # (its own: RLIMIT_NPROC counts a uid's every process)
        try:
            if uid != os.getuid():  # (the program's uid may pass through, not list or write)
                os.chmod(host_dir, 0o711)
                os.chown(work, uid, gid)
            out_path = Path(host_dir, "stdout")
            err_path = Path(host_dir, "stderr")
            if script_on_stdin:
                program_args, feed = ["-"], source
            else:
                Path(work, "main.py").write_text(source)
                program_args, feed = ["main.py"], stdin
            python = [_python(), "-I", *program_args]
            env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "LANG": "C.UTF-8"}
            if mode == "bwrap":
                argv = _bwrap_args(limits.workdir_mb)
                if not script_on_stdin:
                    argv += ["--ro-bind", str(Path(work, "main.py")), f"{_SANDBOX_DIR}/main.py"]
                argv += ["--", *python]
            else:
                argv = python
                env["TMPDIR"] = str(work)
            nproc = _process_count(uid) + limits.max_procs
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                proc = subprocess.Popen(  # (standard input a pipe: a file was read back)
                    argv,
                    stdin=subprocess.PIPE,
                    stdout=out,
                    stderr=err,
                    cwd=work,
                    env=env,
                    start_new_session=True,
                    preexec_fn=_limit_setter(limits, nproc, uid),
                )
                timed_out = False
                try:
                    proc.communicate(feed.encode(), timeout=limits.wall_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                finally:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    if mode != "bwrap":  # (one in a session of its own slept on after the run)
                        _kill(_programs((uid,), work), 2.0)
                    with contextlib.suppress(OSError):
                        proc.stdin.close()
            cap = limits.max_output_bytes
            stdout = out_path.read_bytes()[:cap].decode(errors="replace")
            stderr = err_path.read_bytes()[:cap].decode(errors="replace")
            return RunResult(
                returncode=None if timed_out else proc.returncode,
                stdout=stdout,
                stderr=stderr,
                timed_out=timed_out,
            )
        finally:
            shutil.rmtree(host_dir, ignore_errors=True)


def _state(pid: int | str) -> list[str]:
    """``/proc/PID/stat``'s fields from the state on (state, ppid, pgrp, session, ...)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2 :].split()


def _programs(uids: Container[int], where: Path) -> list[int]:
    """The live processes running as one of ``uids`` that a program run under ``where`` left: in
    a directory under it, or started with their ``HOME`` there (as the program was), one
    that called ``setsid`` (a session of its own, out of the ``killpg``'s reach)
    included; a process of the same uid elsewhere is not the program's."""
    found, real = [], where.resolve()
    home = f"HOME={where}".encode()  # (as the program's environment says it)
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError, ValueError):
                if os.stat(f"/proc/{entry}").st_uid not in uids:
                    continue
                cwd = Path(os.readlink(f"/proc/{entry}/cwd").removesuffix(" (deleted)"))
                if cwd == real or real in cwd.parents:
                    found.append(int(entry))
                    continue
                environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
                if any(v == home or v.startswith(home + b"/") for v in environ):
                    found.append(int(entry))
    return [pid for pid in found if not _gone(pid)]


def _kill(pids: Sequence[int], wait_s: float) -> None:
    """SIGKILL each of ``pids``, then wait up to ``wait_s`` for them to be gone (a kill is
    delivered, not yet acted on)."""
    killed = []
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    deadline = time.monotonic() + wait_s
    while killed and time.monotonic() < deadline:
        killed = [pid for pid in killed if not _gone(pid)]
        time.sleep(0.01)


def _gone(pid: int) -> bool:
    try:
        return _state(pid)[0] in "ZX"  # (a zombie holds nothing: its parent reaps it)
    except (OSError, IndexError):
        return True


def sweep(owners: Sequence[int]) -> None:
    """Kill the programs, and remove the directories, that ``run_python`` calls in the
    processes ``owners`` left behind: a reward worker killed at ``reward.timeout`` (its
    ``finally`` never ran), a call abandoned by a timed-out thread at exit. Without
    bubblewrap such a program slept on after the run (with it, it dies with its parent);
    only the program's processes are killed (:func:`_programs`: in its directory, or
    started with its ``HOME``; one that changed both escapes; under bubblewrap they died
    with their parent)."""
    left: list[int] = []
    for owner in owners:
        for path in Path(_host_base()).glob(f"{_HOST_PREFIX}{owner}-*"):
            left += _programs(uid_block(), path)
            shutil.rmtree(path, ignore_errors=True)
    _kill(left, 2.0)


@functools.cache
def _sweep_at_exit() -> None:
    """At this process's exit: what its calls still running (abandoned) leave (the
    exiting process's own: a child forked since inherits the hook, not the parent's)."""
    atexit.register(lambda: sweep([os.getpid()]))


# --------------------------------------------------------------------------------------------
# Programs and tests
# --------------------------------------------------------------------------------------------


def _harness(program: str, snippets: Sequence[str], marks: Sequence[str]) -> str:
    """A script (fed on stdin, a pipe read to its end before it runs) that runs
    ``program``, then each test, writing ``marks[i]`` (a nonce of test ``i``'s own) where
    test ``i`` passed, nothing where it failed.

    The program can read and rewrite the file its standard output goes to (reopened
    through ``/proc/self/fd``, or by seeking the descriptor): with one nonce and a
    ``0``/``1`` on every verdict it read the nonce in the first verdict and forged a pass
    for each test after (0.9 for a wrong function), or turned every ``0`` into ``1`` at
    exit (1.0). A failed test's nonce is written nowhere. Only the harness's own process
    writes: a function that forked, the child returning True and the parent False, had
    one of them pass each test of a yes/no answer (1.0 for a program that answers nothing).

    Nothing the program reaches by name holds the tests, the nonces or the way verdicts are
    written: they are arguments of ``_run``, the tests compiled before the program runs,
    and verdicts go to a copy of standard output's descriptor through ``os.write`` taken
    before (a program that swapped ``sys.stdout`` or set ``__main__._tests`` passed
    every test). A program that inspects the interpreter itself (its frames, ``gc``) can
    still find them: assert tests share its process (docs/code_reward.md). What the
    program prints goes to ``/dev/null`` (:data:`QUIET`)."""
    return (
        "def _run(program, tests, marks, write, fd, getpid, compile=compile, exec=exec,\n"
        "         enumerate=enumerate, BaseException=BaseException, dict=dict):\n"
        "    compiled, me = [compile(t, '<test>', 'exec') for t in tests], getpid()\n"
        "    ns = {'__name__': '__main__'}\n"
        "    try:\n"
        "        exec(compile(program, '<completion>', 'exec'), ns)\n"
        "    except BaseException:\n"
        "        return\n"
        "    for i, code in enumerate(compiled):\n"
        "        try:\n"
        "            exec(code, dict(ns))\n"
        "        except BaseException:\n"
        "            continue\n"
        "        if getpid() == me:\n"
        "            write(fd, ('\\n%s\\n' % marks[i]).encode())\n"
        f"{QUIET}_os = __import__('os')\n"
        f"_run({program!r}, {tuple(snippets)!r}, {tuple(marks)!r}, _os.write, _quiet(),\n"
        "     _os.getpid)\n"
    )


def score_code(
    program: str | None,
    cases: Sequence[CodeTest],
    limits: Limits | None = None,
    *,
    scoring: str = "fraction",
) -> float:
    """Fraction of ``cases`` that ``program`` passes in the sandbox (0.0 without a program);
    ``scoring="all"`` (``reward.code_scoring``): 1.0 where it passes every one, else 0.0,
    the tests after a failed group (assert, call-based, each input/output test) not run."""
    if program is None or not cases:
        return 0.0
    if scoring not in CODE_SCORING:
        raise ValueError(f"code scoring {scoring!r}: not one of {', '.join(CODE_SCORING)}")
    every = scoring == "all"
    passed = 0
    snippets = [case.code for case in cases if case.code is not None]
    if snippets:
        marks = [secrets.token_hex(16) for _ in snippets]
        run = run_python(_harness(program, snippets, marks), limits=limits, script_on_stdin=True)
        passed += len(set(marks) & {line.strip() for line in run.stdout.splitlines()})
    calls = [case for case in cases if case.fn_name is not None]
    if calls and not (every and passed < len(snippets)):  # (its own limits grow by each call's)
        limits = limits or Limits()
        extra = limits.test_cpu_s * len(calls)
        grown = replace(limits, wall_s=limits.wall_s + 2 * extra, cpu_s=limits.cpu_s + ceil(extra))
        nonce = secrets.token_hex(16)
        harness = call_harness(program, calls, nonce, limits.test_cpu_s)
        run = run_python(harness, limits=grown, script_on_stdin=True)
        passed += calls_passed(run.stdout, calls, nonce)
    io = [case for case in cases if case.stdout is not None]
    for k, case in enumerate(io):
        if every and passed < len(snippets) + len(calls) + k:
            break  # (one failed: the rest cannot make it 1)
        run = run_python(program, stdin=case.stdin or "", limits=limits)
        passed += int(run.returncode == 0 and same_output(run.stdout, case.stdout or ""))
    if every:
        return float(passed == len(cases))
    return passed / len(cases)


def code_scores(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    tests: Sequence[Any] | None,
    scoring: str,
    thinking_opened: Sequence[bool] | None = None,
) -> list[float | None]:
    """The built-in ``code`` reward of a batch (:class:`gspo.rewards.verifiers.CodeReward`
    calls it): each completion's program scored on its row's ``tests`` as ``scoring``
    says (:func:`score_code`: ``fraction`` or ``all``); ``thinking_opened``: where the
    chat template opened each completion's thinking (:func:`.thinking.aligned_prompts`).

    The program is the completion's last fenced Python block (see :func:`extract_code`; of
    a conversation, its assistant messages': :func:`program_of`); a completion without one
    scores 0.0, a row whose ``tests`` is None gets None. Tests take the forms of
    :func:`parse_tests`. Every program runs in the sandbox of this module, one process per
    completion (and per input/output test), in parallel over the CPUs. Call-based tests
    (``fn_name``) run in one process per completion, each call under its own CPU limit,
    and their results are compared here (:mod:`.code_tests`).
    """
    if tests is None:
        raise RewardError("built-in reward 'code' needs a dataset column named 'tests'")
    if isinstance(tests, str) or len(tests) != len(completions):
        raise RewardError(
            f"built-in reward 'code': column 'tests' does not align with "
            f"{len(completions)} completions"
        )
    jobs: list[tuple[str | None, list[CodeTest]] | None] = []
    opened = aligned_prompts(prompts, len(completions), thinking_opened)  # (<think>)
    for k, row_tests in enumerate(tests):
        if row_tests is None:
            jobs.append(None)
            continue
        try:
            prompt = completion_text(prompts[k]) if k < len(prompts) else ""
            where = f"column 'tests' of the data row whose prompt is {prompt!r:.80}"
            cases = parse_tests(row_tests, where=where)
        except ValueError as exc:
            raise RewardError(f"built-in reward 'code': {exc}") from None
        jobs.append((program_of(completions[k], opened[k]), cases))
    mode, message = isolation()
    if mode != "bwrap":
        _say_once(message)
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [
            None if job is None else pool.submit(score_code, *job, scoring=scoring) for job in jobs
        ]
        return [None if f is None else f.result() for f in futures]
