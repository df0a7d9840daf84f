"""The code-execution sandbox and the built-in ``code`` reward.

Hostile programs (infinite loop, fork bomb, 10 GB allocation, writes outside the working
directory, reading the trainer's environment, sockets, killing the parent, runaway output)
must each be contained, score 0, and leave the test process and the machine unharmed.
Cases that need bubblewrap's namespaces are checked only where it works (``make test``
installs it where it can); the resource limits are checked in both modes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest

from gspo.rewards import BUILTIN_REWARDS, RewardError, load_reward_function, sandbox
from gspo.rewards.sandbox import CodeTest, Limits, extract_code, parse_tests, run_python, score_code

FAST = Limits(wall_s=4.0, cpu_s=2, memory_mb=512, max_procs=16)
HAS_BWRAP = sandbox.isolation()[0] == "bwrap"
needs_bwrap = pytest.mark.skipif(not HAS_BWRAP, reason=sandbox.isolation()[1])


def _process_count() -> int:
    """The processes of the uids programs run as where those are not ours (root's tests: a
    count of every process on the host moved with other sessions' shells, 1 run in 3 on a
    shared 2-core machine), else every process."""
    block = sandbox.uid_block()
    pids = [entry for entry in os.listdir("/proc") if entry.isdigit()]
    if os.getuid() in block:
        return len(pids)
    owners = []
    for pid in pids:
        with contextlib.suppress(OSError):
            owners.append(os.stat(f"/proc/{pid}").st_uid)
    return sum(uid in block for uid in owners)


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\nDone."


# ------------------------------------------------------------------------------ extraction


def test_extract_code_takes_last_python_block() -> None:
    text = "```text\nnot code\n```\n```python\nx = 1\n```\nthen\n```py\nx = 2\n```"
    assert extract_code(text) == "x = 2\n"
    assert extract_code("```\nplain = 3\n```") == "plain = 3\n"
    assert extract_code("no fence at all: x = 1") is None


def test_parse_tests_forms() -> None:
    asserts = parse_tests("import math\nassert f(1) == 2\nassert math.isclose(f(0.5), 1.5)")
    assert [c.code for c in asserts] == [
        "import math\nassert f(1) == 2",
        "import math\nassert math.isclose(f(0.5), 1.5)",
    ]
    assert parse_tests(["assert f(1) == 2", "assert f(2) == 3"])[1].code == "assert f(2) == 3"
    pairs = parse_tests('[{"input": "1 2", "output": "3"}]')
    assert pairs == [CodeTest(stdin="1 2", stdout="3")]
    assert parse_tests({"inputs": ["a"], "outputs": ["A"]}) == [CodeTest(stdin="a", stdout="A")]
    with pytest.raises(ValueError, match="row 3: no assert"):
        parse_tests("x = 1", where="row 3")
    with pytest.raises(ValueError, match=r"row 1\[0\]: expected"):
        parse_tests([{"in": 1}], where="row 1")
    # an empty list was "expected ... a list of tests", unequal pairs zip's own message
    for empty in ([], "[]", {"inputs": [], "outputs": []}):
        with pytest.raises(ValueError, match="row 2: no tests"):
            parse_tests(empty, where="row 2")
    with pytest.raises(ValueError, match="row 4: 2 inputs but 1 outputs"):
        parse_tests({"inputs": ["a", "b"], "outputs": ["A"]}, where="row 4")


def test_tests_that_would_score_every_completion_0_are_refused_in_one_line() -> None:
    """A list snippet that does not compile and input/output pairs holding lists were run
    as they were: every completion, a right one too, scored 0 and nothing said so
    (APPS/TACO's call-based tests, refused here too until 2026-11-29, now run:
    tests/test_code_calls.py)."""
    program = "def add(a, b):\n    return a + b"
    with pytest.raises(ValueError, match=r"row 1\[1\]: tests do not parse as Python"):
        parse_tests(["assert add(1, 2) == 3", "assert add(2, 2) == 4 )"], where="row 1")
    with pytest.raises(ValueError, match=r"row 3\[0\]: .* text \(stdin, stdout\), not list"):
        parse_tests([{"input": ["1 2"], "output": "3"}], where="row 3")
    with pytest.raises(ValueError, match=r"row 4: .* not list \[1, 2\]"):
        parse_tests({"inputs": [[1, 2]], "outputs": ["3"]}, where="row 4")
    # what is accepted still scores: a number as the output is its text
    assert parse_tests([{"input": "1 2", "output": 3}]) == [CodeTest(stdin="1 2", stdout="3")]
    assert score_code(program, parse_tests(["assert add(1, 2) == 3"]), FAST) == 1.0


# ----------------------------------------------------------------------------------- scoring


def test_scores_pass_fraction(sandbox_mode: str) -> None:
    program = "def add(a, b):\n    return a + b if a < 10 else 0"
    cases = parse_tests("assert add(1, 2) == 3\nassert add(2, 2) == 4\nassert add(10, 1) == 11")
    assert score_code(program, cases, FAST) == pytest.approx(2 / 3)
    io = parse_tests([{"input": "3\n", "output": "6"}, {"input": "4\n", "output": "9"}])
    assert score_code("print(int(input()) * 2)", io, FAST) == 0.5
    assert score_code(None, cases, FAST) == 0.0


def test_exiting_early_does_not_forge_a_pass(sandbox_mode: str) -> None:
    cases = parse_tests("assert False\nassert 1 == 2")
    for escape in ("import os\nos._exit(0)", "import sys\nsys.exit(0)", "raise SystemExit"):
        assert score_code(escape, cases, FAST) == 0.0
    printed = "print('0 0 1')\nprint('0 1 1')"  # verdict-shaped lines without the nonce
    assert score_code(printed, cases, FAST) == 0.0


def test_without_bubblewrap_the_reward_says_so_in_one_line_once(monkeypatch, capsys) -> None:
    """Python's RuntimeWarning printed the file, the line and the calling line of code."""
    monkeypatch.setattr(sandbox, "isolation", lambda: ("rlimits", "not isolated here"))
    sandbox._say_once.cache_clear()
    reward = load_reward_function("code")
    completions = [fenced("def sq(x):\n    return x * x")]
    for _ in range(2):
        assert reward(prompts=["q"], completions=completions, tests=["assert sq(3) == 9"]) == [1.0]
    assert capsys.readouterr().err == "gspo: warning: not isolated here\n"
    sandbox._say_once.cache_clear()


def test_code_reward_builtin() -> None:
    reward = load_reward_function("code")
    assert reward is BUILTIN_REWARDS["code"]
    completions = [
        fenced("def sq(x):\n    return x * x"),
        fenced("def sq(x):\n    return x + x"),
        "I cannot solve this.",
        fenced("def sq(x):\n    return x * x"),
    ]
    tests = ["assert sq(3) == 9\nassert sq(2) == 4", "assert sq(3) == 9\nassert sq(2) == 4"]
    tests += ["assert sq(3) == 9", None]
    out = reward(prompts=["q"] * 4, completions=completions, tests=tests)
    assert out == [1.0, 0.5, 0.0, None]
    conversational = [[{"role": "assistant", "content": completions[0]}]]
    assert reward(prompts=[[]], completions=conversational, tests=tests[:1]) == [1.0]
    with pytest.raises(RewardError, match="column named 'tests'"):
        reward(prompts=["q"], completions=["x"])
    bad_row = "column 'tests' of the data row whose prompt is 'q': tests do not parse"
    with pytest.raises(RewardError, match=bad_row):
        reward(prompts=["q"], completions=["x"], tests=["assert ("])


# ---------------------------------------------------------------------------- hostile code

LOOP = "while True:\n    pass"
FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
ALLOCATE = "x = bytearray(10 * 1024 ** 3)\nx[-1] = 1"
FLOOD = "while True:\n    print('x' * 4096)"


@pytest.mark.parametrize("program", [LOOP, FORK_BOMB, ALLOCATE, FLOOD], ids=str.split)
def test_resource_abuse_is_contained(sandbox_mode: str, program: str) -> None:
    before = _process_count()
    start = time.monotonic()
    cases = parse_tests("assert True")  # would pass if the program ever finished
    assert score_code(program, cases, FAST) == 0.0
    assert time.monotonic() - start < FAST.wall_s + 3
    result = run_python(program, limits=FAST)
    assert result.returncode != 0
    assert len(result.stdout) <= FAST.max_output_bytes
    deadline = time.monotonic() + 10
    while _process_count() > before + 8 and time.monotonic() < deadline:
        time.sleep(0.1)  # killed processes are reaped asynchronously
    assert _process_count() <= before + 8


def test_environment_is_scrubbed(sandbox_mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GSPO_TEST_SECRET", "hunter2")
    result = run_python("import os\nprint(sorted(os.environ))", limits=FAST)
    assert result.returncode == 0
    assert "GSPO_TEST_SECRET" not in result.stdout
    assert set(eval(result.stdout)) <= {"PATH", "HOME", "LANG", "TMPDIR", "PWD"}


@needs_bwrap
def test_cannot_read_parent_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GSPO_TEST_SECRET", "hunter2")
    program = (
        "import os\n"
        "for pid in [os.getppid(), 1] + [int(p) for p in os.listdir('/proc') if p.isdigit()]:\n"
        "    try:\n"
        "        print(open(f'/proc/{pid}/environ').read())\n"
        "    except OSError:\n"
        "        pass\n"
        f"print(open('/proc/{os.getpid()}/environ').read())\n"
    )
    result = run_python(program, limits=FAST)
    assert "hunter2" not in result.stdout


@needs_bwrap
def test_cannot_write_outside_working_directory(tmp_path: Path) -> None:
    target = tmp_path / "escaped.txt"
    program = (
        "import os\n"
        f"for path in [{str(target)!r}, '/tmp/gspo-escaped', '/usr/gspo-escaped',\n"
        "             '/root/gspo-escaped']:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('wrote', path)\n"
        "    except OSError:\n"
        "        pass\n"
        "open('inside.txt', 'w').write('ok')\n"
        "print(open('inside.txt').read())\n"
    )
    result = run_python(program, limits=FAST)
    assert result.returncode == 0
    assert "wrote" not in result.stdout and result.stdout.strip() == "ok"
    assert not target.exists() and not Path("/tmp/gspo-escaped").exists()


@needs_bwrap
def test_cannot_read_repository_or_open_socket() -> None:
    readme = Path(__file__).resolve().parents[1] / "README.md"
    program = (
        "import socket\n"
        "try:\n"
        f"    print(open({str(readme)!r}).read()[:10])\n"
        "except OSError:\n"
        "    print('no file')\n"
        "try:\n"
        "    socket.create_connection(('127.0.0.1', 22), timeout=1)\n"
        "    print('connected')\n"
        "except OSError:\n"
        "    print('no network')\n"
    )
    result = run_python(program, limits=FAST)
    assert result.stdout.split("\n")[:2] == ["no file", "no network"]


#: Leaves a process of its own session behind (a daemon: setsid, then a second fork),
#: which prints its pid; ``{move}`` may leave the program's directory first.
DAEMON = """import os, time
pid = os.fork()
if pid == 0:
    os.setsid()
    if os.fork():
        os._exit(0)
    {move}
    print(os.getpid(), flush=True)
    time.sleep(60)
    os._exit(0)
os.waitpid(pid, 0)
time.sleep(0.3)
"""


@pytest.mark.parametrize("move", ["pass", "os.chdir('/')"])
def test_a_program_leaves_no_process_behind(sandbox_mode: str, move: str) -> None:
    """Without bubblewrap a program's daemon (a session of its own, out of the process
    group's kill) slept on after the run, one more for each such completion."""
    result = run_python(DAEMON.format(move=move), limits=FAST)
    assert result.returncode == 0 and result.stdout.strip(), result
    if sandbox_mode == "bwrap":
        return  # (its pid is the sandbox's own namespace's: it died with it)
    pid = int(result.stdout)
    deadline = time.monotonic() + 5
    while not sandbox._gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox._gone(pid)


def test_killing_the_parent_leaves_the_run_unharmed(sandbox_mode: str) -> None:
    program = (
        "import os, signal\n"
        "for pid in (os.getppid(), -1):\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n"
        "    except OSError:\n"
        "        pass\n"
    )
    assert score_code(program, parse_tests("assert False"), FAST) == 0.0
    assert os.getppid() > 1  # pytest's parent (and pytest itself) survived
    assert score_code("x = 1", parse_tests("assert x == 1"), FAST) == 1.0


# ------------------------------------------------------------------------------ forged passes

FORGERS = {
    # reads the harness back from standard input (a seekable file) and prints its verdicts
    "stdin read back": (
        "import os, re, sys\n"
        "os.lseek(0, 0, 0)\n"
        "text = os.read(0, 1 << 20).decode()\n"
        "mark = re.findall(r'[0-9a-f]{32}', text)[0]\n"
        "sys.stdout.write(''.join('\\n%s %d 1\\n' % (mark, i) for i in range(9)))\n"
        "sys.stdout.flush()\n"
        "os._exit(0)\n"
    ),
    # replaces the tests the harness reads after the program ran
    "__main__._tests": "import __main__\n__main__._tests = ['pass'] * 100\n",
    # turns every failing verdict into a passing one on its way out
    "sys.stdout wrapped": (
        "import sys\n"
        "class W:\n"
        "    def __init__(self, s): self.s = s\n"
        "    def write(self, t): return self.s.write(t.replace(' 0\\n', ' 1\\n'))\n"
        "    def flush(self): self.s.flush()\n"
        "sys.stdout = W(sys.stdout)\n"
    ),
}


@pytest.mark.parametrize("forger", list(FORGERS))
def test_a_program_that_forges_its_verdicts_scores_zero(sandbox_mode: str, forger: str) -> None:
    """Each scored 1.0 on tests of a function it never defines (the code reward audit)."""
    cases = parse_tests("assert f(2) == 4\nassert f(3) == 6")
    assert score_code(FORGERS[forger], cases, FAST) == 0.0
    assert score_code("def f(x):\n    return 2 * x", cases, FAST) == 1.0  # (and honest: 1)


VERDICT_FORGERS = {
    # reads the verdicts written so far back (its output's file reopened) and writes a
    # pass for every test after, with the nonce it found
    "reads them back": """
import os, re
def f(x):
    for fd in range(3, 32):
        try:
            text = open("/proc/self/fd/%d" % fd, "rb").read().decode(errors="replace")
        except OSError:
            continue
        for mark in set(re.findall(r"[0-9a-f]{32}", text)):
            lines = ["\\n%s %d 1\\n%s 1\\n%s\\n" % (mark, i, mark, mark) for i in range(20)]
            os.write(fd, "".join(lines).encode())
    return -1
""",
    # at exit, after the last verdict, rewrites every failing verdict in the file to a pass
    "rewrites them at exit": """
import atexit, os
def flip():
    for fd in range(3, 32):
        try:
            text = open("/proc/self/fd/%d" % fd, "rb").read()
        except OSError:
            continue
        if text.replace(b" 0\\n", b" 1\\n") != text:
            os.pwrite(fd, text.replace(b" 0\\n", b" 1\\n"), 0)
atexit.register(flip)
def f(x):
    return -1
""",
}


@pytest.mark.parametrize("forger", list(VERDICT_FORGERS))
def test_a_program_that_edits_its_verdicts_file_forges_no_pass(
    sandbox_mode: str, forger: str
) -> None:
    """A wrong function can read and rewrite the file its standard output goes to
    (``/proc/self/fd``, its descriptor): with one nonce and a 0/1 in every verdict it
    forged a pass for each test after the first it read (0.9 of 10), or turned every 0
    into 1 at exit (1.0). Now a test's own nonce is written only where it passed."""
    cases = parse_tests("\n".join(f"assert f({k}) == {k}" for k in range(10)))
    assert score_code(VERDICT_FORGERS[forger], cases, FAST) == 0.0
    honest = VERDICT_FORGERS[forger].replace("return -1", "return x")
    assert score_code(honest, cases, FAST) == 1.0
    half = VERDICT_FORGERS[forger].replace("return -1", "return x if x % 2 else -1")
    assert score_code(half, cases, FAST) == 0.5


def test_a_program_that_forks_passes_only_what_its_own_answers_pass(sandbox_mode: str) -> None:
    """A function that forks, the child answering True and the parent False, had one of
    the two pass every yes/no test (both went on through the tests, writing verdicts):
    1.0 for a program that answers nothing. Only the harness's own process writes now:
    the parent's answer (False) passes the odd numbers' tests.

    Every process forks again at each later test: 2**4 of them, beside bubblewrap's own, all
    alive at once where the machine is slow to run the children out (FAST's 16 failed the
    parent's last fork 1 run in 3 under load: 0.25), so the limit holds the whole tree, and
    beside it another run's 16 (RLIMIT_NPROC counts the uid's every process: a fork bomb in
    another pytest-xdist worker)."""
    forks = "import os\ndef is_even(x):\n    return os.fork() == 0\n"
    cases = parse_tests("\n".join(f"assert is_even({k}) is {k % 2 == 0}" for k in range(4)))
    tree = replace(FAST, max_procs=2 * (2**4 + 16))
    assert score_code(forks, cases, tree) == 0.5
    assert score_code("def is_even(x):\n    return x % 2 == 0", cases, tree) == 1.0


@pytest.mark.skipif(os.getuid() != 0, reason="a trainer not root runs programs as itself")
def test_a_fork_bomb_beside_a_program_leaves_it_its_own_processes(sandbox_mode: str) -> None:
    """Programs scored at once ran as one uid (nobody) and RLIMIT_NPROC counts a uid's
    every process: a fork bomb started beside a right answer that forks failed its fork
    (scored 0 there, 1 alone). Each runs as a uid of its own now."""
    import threading

    fair = "import os, time\ntime.sleep(1.5)\ndef f():\n    pid = os.fork()\n"
    fair += "    if pid == 0:\n        os._exit(0)\n    os.waitpid(pid, 0)\n    return 1\n"
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    cases, limits = parse_tests("assert f() == 1"), replace(FAST, wall_s=5.0, cpu_s=3)
    scores: dict[str, float] = {}
    fair_run = threading.Thread(target=lambda: scores.update(fair=score_code(fair, cases, limits)))
    fair_run.start()
    time.sleep(0.5)  # (the fair program asleep, holding its uid, when the bomb starts)
    scores["bomb"] = score_code(bomb, cases, limits)
    fair_run.join()
    assert scores == {"fair": 1.0, "bomb": 0.0}
    with sandbox.program_uid() as one, sandbox.program_uid() as other:
        assert one != other and {one, other} <= set(sandbox.uid_block())


@pytest.mark.skipif(len(sandbox.uid_block()) < 2, reason="a uid of its own per program: root")
def test_two_processes_never_take_one_uid_before_their_programs_start(monkeypatch) -> None:
    """Two processes (trainers, reward workers) whose search starts at the same uid (pids
    64 apart mod 4,096, or 64+ programs at once) each take one no live process owns: a
    uid taken by another whose program had not started yet was taken again (the fork
    bomb's RLIMIT_NPROC shared)."""
    import subprocess
    import sys

    holder = (
        "import os, sys\nos.getpid = lambda: 1\n"
        "from gspo.rewards.program_uids import program_uid\n"
        "with program_uid() as uid:\n    print(uid, flush=True)\n    sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", holder], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        theirs = int(child.stdout.readline())
        with monkeypatch.context() as patched:
            patched.setattr(os, "getpid", lambda: 1)
            with sandbox.program_uid() as ours:
                pass
        assert ours != theirs and {ours, theirs} <= set(sandbox.uid_block())
    finally:
        child.communicate("")
    assert child.returncode == 0
    from gspo.rewards import program_uids

    monkeypatch.setattr(program_uids, "_claim", lambda uid: None)  # (every uid locked)
    with sandbox.program_uid() as shared:
        assert shared == sandbox.uid_block()[0]


@pytest.mark.skipif(os.getuid() != 0, reason="root's sandbox uids")
def test_a_namespace_mapping_root_alone_runs_programs_as_its_root(monkeypatch) -> None:
    """Root in a user namespace that maps uid 0 alone (`unshare -r`, uid_map '0 1000 1')
    has neither a block nor nobody to run programs as: it runs them as itself, as a
    trainer that is not root does (chown to nobody raised OSError: Invalid argument, a
    traceback at the first scored program)."""
    import shutil
    import subprocess
    import sys

    from gspo.rewards import program_uids

    monkeypatch.setattr(program_uids, "_mapped", lambda: [range(0, 1)])
    program_uids.uid_block.cache_clear()
    try:
        assert program_uids.sandbox_ids() == (os.getuid(), os.getgid())
        assert program_uids.uid_block() == range(0, 1)
    finally:
        program_uids.uid_block.cache_clear()
    if shutil.which("unshare") is None:
        return
    run = "from gspo.rewards import sandbox as s\nprint(s.score_code('def f():\\n    return 1\\n', "
    run += "s.parse_tests('assert f() == 1')))"
    inside = subprocess.run(
        ["unshare", "--user", "--map-root-user", sys.executable, "-c", run],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if "unshare failed" in inside.stderr or "unshare:" in inside.stderr:
        return  # (no user namespaces here)
    assert inside.stdout.strip() == "1.0", inside.stderr[-500:]


def test_a_program_cannot_touch_the_trainers_files_or_fill_memory(sandbox_mode: str) -> None:
    """Without bubblewrap the program's directory held the files its output was read
    from: removing one stopped the run (FileNotFoundError), a link made the trainer read
    a file for it. With bubblewrap /dev/shm and / were unsized tmpfs: 1.5 GB of RAM."""
    remove = (
        "import os\nfor n in ('stdout', 'stderr', '../stdout'):\n"
        "    try: os.remove(n)\n    except OSError: pass\nprint(6)"
    )
    io = parse_tests([{"input": "3\n", "output": "6"}])
    assert score_code(remove, io, FAST) == 1.0  # (its own output, read whole)
    if sandbox_mode == "bwrap":
        fill = (
            "import os\nwritten = 0\n"
            "for place in ('/dev/shm', '/', '/sandbox'):\n"
            "    for k in range(40):\n"  # (1 MB a file: the output limit is per file)
            "        try:\n"
            "            with open(os.path.join(place, f'x{k}'), 'wb') as f:\n"
            "                f.write(b'0' * ((1 << 20) - 1)); written += 1\n"
            "        except OSError: break\n"
            "print(written)\n"
        )
        run = run_python(fill, limits=FAST)
        assert int(run.stdout) <= 2 * FAST.workdir_mb, run  # (at most the two sized tmpfs)


@pytest.mark.skipif(os.getuid() != 0, reason="the programs run as the trainer's own uid")
def test_a_root_trainer_with_a_private_temp_dir_still_runs_programs(
    sandbox_mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A root trainer's TMPDIR in a 0700 directory: the program (user nobody) could not
    reach its main.py, so every stdin/stdout test scored 0 without a word."""
    import tempfile

    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    monkeypatch.setattr(sandbox, "_host_base", functools.cache(sandbox._host_base.__wrapped__))
    io = parse_tests([{"input": "3\n", "output": "6"}])
    assert score_code("print(2 * int(input()))", io, FAST) == 1.0
    assert list(private.iterdir()) == []  # (made elsewhere, and removed)


def test_a_stale_directorys_session_reused_by_another_process_is_not_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory left by a run killed outright named a session id that another process
    may hold by now: only processes in the directory (or started with their HOME there)
    are the program's (the reviewer's case: a shell of the same uid in a reused session
    was killed)."""
    import subprocess

    monkeypatch.setattr(sandbox, "_host_base", lambda: str(tmp_path))
    monkeypatch.setattr(sandbox, "uid_block", lambda: range(os.getuid(), os.getuid() + 1))
    other = subprocess.Popen(["sleep", "30"], start_new_session=True, cwd=tmp_path)
    try:
        stale = tmp_path / "gspo-sandbox-999999-x"
        (stale / "work").mkdir(parents=True)
        sandbox.sweep([999999])
        assert not stale.exists() and other.poll() is None  # removed; the other lives on
        (stale / "work").mkdir(parents=True)  # a program in its directory: killed
        placed = subprocess.Popen(["sleep", "30"], start_new_session=True, cwd=stale / "work")
        sandbox.sweep([999999])
        assert placed.wait(5) == -9 and not stale.exists()
    finally:
        other.kill()


def test_a_test_that_cannot_fail_is_refused() -> None:
    """A list snippet without an assert (``add(1, 2) == 3``) ran, threw its comparison
    away and passed: a program returning 0 scored 1.0. So did such a line among assert
    statements (read as set-up). Now refused at the start in one line naming the test."""
    with pytest.raises(ValueError, match=r"^row 1\[0\]: 'add\(1, 2\) == 3' \(line 1\) compares"):
        parse_tests(["add(1, 2) == 3", "assert add(2, 2) == 4"], where="row 1")
    with pytest.raises(ValueError, match=r"write assert add\(1, 2\) == 3$"):
        parse_tests("add(1, 2) == 3\nassert add(2, 2) == 4", where="row 2")
    with pytest.raises(ValueError, match=r"^row 3\[0\]: the test 'print\(add\(1, 2\)\)' runs no"):
        parse_tests(["print(add(1, 2))"], where="row 3")
    check = "def check(candidate):\n    assert candidate(1, 2) == 3\n"  # (HumanEval's form)
    with pytest.raises(ValueError, match=r"^row 4\[0\]: .* runs no assert \(none at its top"):
        parse_tests([check], where="row 4")  # (never called: it passed anything)
    with pytest.raises(ValueError, match=r"^row 5: its asserts are inside functions it never"):
        parse_tests(check, where="row 5")  # (was: "no assert statement among the tests")
    assert parse_tests(check + "check(add)\n") == [CodeTest(code=check + "check(add)\n")]
    kept = ["np.testing.assert_allclose(add(1, 2), 3)", "if add(1, 2) != 3:\n    raise ValueError"]
    kept.append(check + "check(add)")
    assert len(parse_tests(kept)) == 3
    assert score_code("def add(a, b):\n    return a + b", parse_tests(kept[2:]), FAST) == 1.0
    assert score_code("def add(a, b):\n    return 0", parse_tests(kept[1:]), FAST) == 0.0


def test_a_check_function_beside_another_call_is_still_never_called() -> None:
    """Any call at the top level (``print('checking')``) counted as calling the checking
    function: an uncalled ``def check`` beside it passed anything (a program returning 0
    scored 1.0). The call must reach a function (or class) that checks."""
    uncalled = "def check(candidate):\n    assert candidate(1, 2) == 3\nprint('checking')\n"
    with pytest.raises(ValueError, match=r"^row 1\[0\]: .* runs no assert"):
        parse_tests([uncalled], where="row 1")
    with pytest.raises(ValueError, match=r"^row 2: its asserts are inside functions it never"):
        parse_tests(uncalled, where="row 2")
    method = "class T:\n    def t(self):\n        assert add(1, 2) == 3\nT().t()\n"
    assert score_code("def add(a, b):\n    return 0", parse_tests([method]), FAST) == 0.0
    checks = uncalled.replace("print('checking')", "list(map(check, [add]))")
    aliased = uncalled.replace("print('checking')", "c = check\nc(add)")
    assert len(parse_tests([checks, aliased])) == 2  # (still read as calling it)


def test_a_multi_turn_episode_is_scored_on_its_last_program_of_any_assistant_turn() -> None:
    """The reward read the last assistant message alone: an episode whose program was in
    an earlier turn and whose final turn said "done" scored 0, where the docs say the
    completion's last fenced Python block (verl scores the whole response's)."""
    reward = load_reward_function("code")
    tests = ["assert add(1, 2) == 3"]
    right = fenced("def add(a, b):\n    return a + b")
    wrong = fenced("def add(a, b):\n    return 0")
    episode = [
        {"role": "assistant", "content": wrong},
        {"role": "tool", "content": "AssertionError"},
        {"role": "assistant", "content": right},
        {"role": "user", "content": "the tests pass"},
        {"role": "assistant", "content": "Done: the function above."},
    ]
    assert reward(prompts=["q"], completions=[episode], tests=tests) == [1.0]
    assert reward(prompts=["q"], completions=[episode[:2]], tests=tests) == [0.0]
    echoed = [{"role": "assistant", "content": "no code"}, {"role": "tool", "content": right}]
    assert reward(prompts=["q"], completions=[echoed], tests=tests) == [0.0]  # (not the model's)


def test_a_program_drafted_in_the_thinking_is_not_the_answer() -> None:
    """Only what follows a reasoning model's ``</think>`` is its program, as the math
    rewards read their answers: a right draft inside the thinking scored 1 where the
    answer had no fenced block, and a wrong draft was not overridden by nothing."""
    reward = load_reward_function("code")
    tests = ["assert add(1, 2) == 3"]
    right = fenced("def add(a, b):\n    return a + b")
    wrong = fenced("def add(a, b):\n    return 0")
    drafted = f"<think>{right}</think>The function adds its arguments."
    assert reward(prompts=["q"], completions=[drafted], tests=tests) == [0.0]
    answered = f"<think>{wrong}</think>{right}"
    assert reward(prompts=["q"], completions=[answered], tests=tests) == [1.0]
    cut_off = f"<think>{right}"  # (cut off while thinking: no answer)
    assert reward(prompts=["q"], completions=[cut_off], tests=tests) == [0.0]
    episode = [{"role": "assistant", "content": f"<think>{right}</think>done"}]
    assert reward(prompts=["q"], completions=[episode], tests=tests) == [0.0]
    assert reward(prompts=["q"], completions=[right], tests=tests) == [1.0]  # (no thinking)
    opened = "Write add.<|Assistant|><think>\n"  # (R1's template opens the thinking)
    assert reward(prompts=[opened], completions=[right], tests=tests) == [0.0]  # (cut off)
    closed = f"{right}</think>{right}"
    assert reward(prompts=[opened], completions=[closed], tests=tests) == [1.0]


def test_codecontests_input_output_lists_and_text_in_place_of_lists() -> None:
    """CodeContests' ``{"input": [...], "output": [...]}`` was refused ("expected assert
    statements ..."); ``{"inputs": "12", "outputs": "34"}`` (text, not lists) was read
    one character a test: stdin "1" -> "3", "2" -> "4", and a program adding 2 scored 1."""
    contests = {"input": ["1 2\n", "2 2\n"], "output": ["3\n", "5\n"]}
    assert parse_tests(contests) == [CodeTest(stdin="1 2\n", stdout="3\n"),
                                     CodeTest(stdin="2 2\n", stdout="5\n")]  # fmt: skip
    assert score_code("print(sum(map(int, input().split())))", parse_tests(contests), FAST) == 0.5
    with pytest.raises(ValueError, match=r"^row 1: 'inputs' and 'outputs' are lists .* not str"):
        parse_tests({"inputs": "12", "outputs": "34"}, where="row 1")
    with pytest.raises(ValueError, match=r"^row 2: expected assert statements"):
        parse_tests({"input": "1 2", "output": "3"}, where="row 2")  # (one pair: the list form)


def test_a_parquet_column_of_mixed_test_forms(tmp_path: Path) -> None:
    """A Parquet column of mappings holds every row's keys, None under the others': the
    row with CodeContests' input/output lists had inputs/outputs None (a TypeError
    traceback), a stdin/stdout pair had input/output None (the text "None" on stdin)."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    from gspo.data import load_rows

    tables = {
        "lists": [{"tests": {"input": ["1 2\n"], "output": ["3\n"]}},
                  {"tests": {"inputs": ["4 5\n"], "outputs": ["9\n"]}}],
        "pairs": [{"tests": [{"stdin": "6 7\n", "stdout": "13\n"},
                             {"input": "1 1\n", "output": "2\n"}]}],
    }  # fmt: skip
    read = []
    for name, rows in tables.items():
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"{name}.parquet")
        read += [row["tests"] for row in load_rows(tmp_path / f"{name}.parquet", what="data")]
    assert read[0]["inputs"] is None and read[2][0]["input"] is None  # (as Parquet holds them)
    program = "print(sum(map(int, input().split())))"
    assert [score_code(program, parse_tests(tests), FAST) for tests in read] == [1.0] * 3


def test_standard_output_is_compared_as_checkers_compare_it(sandbox_mode: str) -> None:
    """Lines were compared as text: ``print(1 / 3)`` against ``0.333333`` scored 0, and so
    did two spaces or a line break where the expected output has one space; checkers
    (testlib's, APPS's and verl's) compare tokens, decimals within a tolerance."""

    def scored(program: str, output: str) -> float:
        return score_code(program, parse_tests([{"input": "", "output": output}]), FAST)

    assert scored("print(1 / 3)", "0.333333") == 1.0
    assert scored("print(1, 2, sep='  ')", "1 2") == 1.0
    assert scored("print(1)\nprint(2)", "1 2\n") == 1.0
    assert scored("print(0.3334)", "0.333333") == 0.0
    assert scored("print(1000000001)", "1000000000") == 0.0  # (an integer is exact)
    from gspo.rewards.code_tests import same_output

    assert same_output("YES\n 2.5000001e3 ", "YES 2500.0") and not same_output("1 2", "1 2 3")
    assert same_output("nan\n", "nan")  # (equal as text; not as numbers)
    assert not same_output("inf", "1e999") and not same_output("3", "3.5")
