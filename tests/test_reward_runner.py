"""Reward functions in worker processes and under a deadline (``reward.workers``/``timeout``)."""

from __future__ import annotations

import functools
import os
import time

import pytest

from gspo.rewards import RewardError, RewardFunctions

FUNCTIONS = '''
import os, time

def pid_parity(prompts, completions, **kwargs):
    """Scores that reveal the process and the row: (length of completion) + 0 * pid."""
    return [float(len(c)) for c in completions]

def which_pid(prompts, completions, **kwargs):
    return [float(os.getpid()) for _ in completions]

def uses_column(prompts, completions, answer, **kwargs):
    return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]

def hangs(prompts, completions, **kwargs):
    while True:
        time.sleep(0.05)

def slow(prompts, completions, **kwargs):
    time.sleep(0.2)
    return [0.5] * len(completions)

def raises(prompts, completions, **kwargs):
    raise ValueError("bad row 3")

def as_array(prompts, completions, **kwargs):
    import numpy
    return numpy.array([float(len(c)) for c in completions])

def as_tensor(prompts, completions, **kwargs):
    import torch
    return torch.tensor([float(len(c)) for c in completions])

async def awaited(prompts, completions, **kwargs):
    import asyncio
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]

_JUDGE = []

async def judge(prompts, completions, **kwargs):
    """An async client kept at module level: a worker task and its queues, made at the
    first call, bound to that call's event loop."""
    import asyncio
    if not _JUDGE:
        asks, answers = asyncio.Queue(), asyncio.Queue()
        async def serve():
            while True:
                await answers.put(float(len(await asks.get())))
        _JUDGE.extend([asks, answers, asyncio.get_running_loop().create_task(serve())])
    if completions == ["<close>"]:
        _JUDGE.pop().cancel()
        _JUDGE.clear()
        return [0.0]
    out = []
    for c in completions:
        await _JUDGE[0].put(c)
        out.append(await _JUDGE[1].get())
    return out

def no_kwargs(prompts, completions):
    return [0.0] * len(completions)

def exits(prompts, completions, **kwargs):
    import sys
    sys.exit(0)

def dies(prompts, completions, **kwargs):
    os._exit(3)

def _sandbox_sleeper(bwrap):
    from gspo.rewards import sandbox
    sandbox._host_base = lambda: os.environ["GSPO_TEST_SANDBOX_BASE"]
    if not bwrap:
        sandbox._bwrap_works = lambda: False
    sandbox.run_python("import time; time.sleep(300)", limits=sandbox.Limits(wall_s=300))

def sleeps_in_sandbox(prompts, completions, **kwargs):
    _sandbox_sleeper(bwrap=True)

def sleeps_in_sandbox_unisolated(prompts, completions, **kwargs):
    _sandbox_sleeper(bwrap=False)
'''


@pytest.fixture
def module(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(FUNCTIONS)
    return path


def specs(module, *names):
    return [f"{module}:{name}" for name in names]


def test_workers_give_the_same_rewards_in_order(module):
    completions = [f"c{'x' * k}" for k in range(11)]
    answer = [c if k % 3 else "no" for k, c in enumerate(completions)]
    names = ("pid_parity", "uses_column")
    local = RewardFunctions.from_specs(specs(module, *names), [1.0, 2.0])
    pooled = RewardFunctions.from_specs(specs(module, *names), [1.0, 2.0], workers=3)
    try:
        a = local(["p"] * 11, completions, {"answer": answer})
        b = pooled(["p"] * 11, completions, {"answer": answer})
        assert a == b
        assert b.per_function[f"{module}:uses_column"][:4] == [0.0, 1.0, 1.0, 0.0]
        pids = pooled.runner.run(
            ["w"], [None], specs(module, "which_pid"), ["p"] * 11, completions, {}
        )[0]
        assert len(pids) == 11 and os.getpid() not in pids  # scored in worker processes
    finally:
        pooled.close()


def test_worker_errors_name_the_function(module):
    pooled = RewardFunctions.from_specs(specs(module, "raises"), workers=2)
    try:
        with pytest.raises(RewardError, match=r"raises' raised ValueError: bad row 3"):
            pooled(["p"] * 4, ["a"] * 4)
    finally:
        pooled.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_sys_exit_in_a_reward_is_an_error_not_a_finished_run(module, workers):
    """sys.exit(0) in a reward ended `gspo train` with status 0 and no word (in this
    process); in a worker it killed the worker and the run waited forever."""
    functions = RewardFunctions.from_specs(specs(module, "exits"), workers=workers)
    try:
        with pytest.raises(RewardError) as err:
            functions(["p"] * 4, ["a"] * 4)
    finally:
        functions.close()
    assert "exits' raised SystemExit: 0" in str(err.value)


def test_a_worker_that_dies_stops_the_run_with_one_line(module):
    """os._exit (a segfault alike) in a worker: multiprocessing.Pool replaces the process
    and drops its task, and the run waited for it forever (no reward.timeout)."""
    functions = RewardFunctions.from_specs(specs(module, "dies"), workers=2)
    functions.runner.start()  # (spawning the workers: 16 s on a loaded 2-core machine)
    start = time.monotonic()
    try:
        with pytest.raises(RewardError) as err:
            functions(["p"] * 4, ["a"] * 4)
    finally:
        functions.close()
    assert time.monotonic() - start < 30
    assert str(err.value) == (
        f"reward function '{module}:dies': a reward.workers process died while it scored "
        "(exit code 3: a crash, os._exit or sys.exit), so the run stops here"
    )


def test_unpicklable_callable_gets_a_clear_message():
    def local_function(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    # found when the functions are built, before a run starts (not at its first batch)
    with pytest.raises(RewardError, match="cannot be sent to reward.workers.*spec string"):
        RewardFunctions.from_specs([local_function], workers=2)


def test_workers_that_cannot_import_the_main_script_are_found_up_front(monkeypatch):
    """A script read from stdin (its __main__ file '<stdin>') made every spawned worker
    fail and respawn, forever; a function defined in python -c / a notebook could not be
    unpickled by the workers (a raw AttributeError)."""
    import __main__

    monkeypatch.setattr(__main__, "__file__", "<stdin>", raising=False)
    with pytest.raises(RewardError, match="'<stdin>' is no file"):
        RewardFunctions.from_specs(["format"], workers=2)
    RewardFunctions.from_specs(["format"], workers=0)  # no workers: nothing to import
    monkeypatch.delattr(__main__, "__file__")

    def typed(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    typed.__module__ = "__main__"
    with pytest.raises(RewardError, match="'typed' is defined in an interactive session"):
        RewardFunctions.from_specs([typed], workers=2)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_hung_function_stops_with_one_line(module, workers):
    functions = RewardFunctions.from_specs(
        specs(module, "slow", "hangs"), workers=workers, timeout=1.0
    )
    try:
        if workers:  # (start-up is not part of the deadline: 16 s under load on 2 cores)
            functions.runner.start()
        start = time.monotonic()
        with pytest.raises(
            RewardError, match=r"'.*:hangs' did not finish within reward\.timeout=1 s"
        ):
            functions(["p"] * 4, ["a"] * 4)
        assert 0.9 < time.monotonic() - start < 10.0  # stopped, not hung (2-core CI is slow)
    finally:
        functions.close()


@pytest.mark.parametrize(
    ("function", "exits"),
    [("pid_parity", "on their own"), ("raises", "on their own"), ("hangs", "killed")],
)
def test_idle_workers_exit_on_their_own_and_hung_ones_are_killed(module, function, exits):
    """Closing the pool lets idle workers exit (code 0) instead of killing them: a worker
    killed just after sending a result may still hold the result queue's lock, and the
    pool's shutdown then waits on it forever. After a failing task the batch's others are
    waited for first; workers still running past the deadline are killed."""
    functions = RewardFunctions.from_specs(specs(module, function), workers=2, timeout=2.0)
    processes = list(functions.runner.start()._pool)  # the pool's worker processes
    try:
        if function == "pid_parity":
            functions(["p"] * 4, ["a"] * 4)
        else:
            with pytest.raises(RewardError):
                functions(["p"] * 4, ["a"] * 4)
    finally:
        functions.close()
    for process in processes:
        process.join(10)
    codes = [process.exitcode for process in processes]
    assert codes == ([0, 0] if exits == "on their own" else [-15, -15]), codes


@pytest.mark.parametrize("workers", [0, 2])
def test_slow_function_within_the_deadline_passes(module, workers):
    functions = RewardFunctions.from_specs(specs(module, "slow"), workers=workers, timeout=5.0)
    try:
        assert functions(["p"] * 4, ["a"] * 4).rewards == [0.5] * 4
    finally:
        functions.close()


def test_bad_settings_are_one_line():
    with pytest.raises(RewardError, match="reward.workers=-1"):
        RewardFunctions.from_specs(["format"], workers=-1)
    with pytest.raises(RewardError, match="reward.timeout=0"):
        RewardFunctions.from_specs(["format"], timeout=0)


@pytest.mark.parametrize("workers", [0, 2])
def test_trl_style_functions_score_as_lists_do(module, workers):
    """TRL takes a numpy array or a tensor of rewards, and async functions: so does gspo
    (they were 'returned ndarray, expected a list' / 'returned coroutine')."""
    names = ("as_array", "as_tensor", "awaited")
    functions = RewardFunctions.from_specs(specs(module, *names), workers=workers)
    try:
        completions = ["a", "bb", "ccc", "dddd", "eeeee"]
        result = functions(["p"] * 5, completions)
        for name in names:
            assert result.per_function[f"{module}:{name}"] == [1.0, 2.0, 3.0, 4.0, 5.0]
    finally:
        functions.close()


@pytest.mark.parametrize("timeout", [None, 30.0])
def test_an_async_functions_client_serves_every_batch(module, timeout):
    """Each async call ran in a fresh event loop: a client the function kept from its first
    batch (an LLM judge's session; a task and its queues here) was bound to a closed loop
    at the second ("bound to a different event loop"), and the run stopped there. Scored
    in the trainer's thread and, with reward.timeout, in a thread of its own."""
    functions = RewardFunctions.from_specs(specs(module, "judge"), timeout=timeout)
    try:
        for batch in (["a", "bb"], ["ccc"], ["dddd", "e"]):
            assert functions(["p"] * len(batch), batch).rewards == [float(len(c)) for c in batch]
        functions(["p"], ["<close>"])  # (its task cancelled: none left pending at exit)
    finally:
        functions.close()


def test_a_coroutine_awaited_from_one_on_the_loop_does_not_block_it():
    """run_coroutine waits on the process's one loop: called from a coroutine running on
    that loop it would wait for itself; it runs the inner one apart."""
    import threading

    from gspo.plugins import run_coroutine

    async def inner():
        return 7

    async def outer():
        return run_coroutine(inner()) + 1

    got = []
    thread = threading.Thread(target=lambda: got.append(run_coroutine(outer())), daemon=True)
    thread.start()
    thread.join(timeout=20)
    assert got == [8]


def test_a_function_without_kwargs_is_told_to_take_them(module):
    functions = RewardFunctions.from_specs(specs(module, "no_kwargs"))
    with pytest.raises(RewardError, match=r"takes no argument 'answer'.*add \*\*kwargs"):
        functions(["p"], ["a"], {"answer": ["1"]})
    assert functions(["p"], ["a"]).rewards == [0.0]  # no column: nothing it cannot take


def test_a_function_without_kwargs_is_refused_before_the_run_starts(module):
    """Its first call said so, after the run had started (an --overwrite had removed the
    run it replaced); the columns are known before: one line then."""
    functions = RewardFunctions.from_specs(specs(module, "no_kwargs"))
    with pytest.raises(RewardError) as err:
        functions.check_columns(["answer", "level"], "data.train (x.jsonl)")
    assert str(err.value) == (
        f"reward function '{module}:no_kwargs' takes no argument 'answer', which data.train "
        "(x.jsonl) gives (the call passes prompts, completions and every data column, as "
        "keywords: TRL's convention); add **kwargs to its parameters"
    )
    functions.check_columns([], "data.train (x.jsonl)")  # nothing it cannot take

    def named(prompts, completions, answer):  # every column by name: taken as it is
        return [0.0] * len(completions)

    RewardFunctions.from_specs([named], None).check_columns(["answer"], "data.train")

    def filtered(function):  # a decorator passing on only what the function names
        @functools.wraps(function)
        def wrapper(prompts, completions, **kwargs):
            return function(prompts, completions)

        return wrapper

    def two(prompts, completions):
        return [0.0] * len(completions)

    decorated = RewardFunctions.from_specs([filtered(two)], None)
    decorated.check_columns(["level"], "data.train")  # (refused when read as `two`)
    assert decorated(["p"], ["c"], {"level": [1]}).rewards == [0.0]

    def completions_only(completions):  # what it cannot take is the call's, not the data's
        return [0.0] * len(completions)

    with pytest.raises(
        RewardError, match=r"'completions_only' takes no argument 'prompts', which every call gives"
    ):
        RewardFunctions.from_specs([completions_only], None).check_columns([], "data.train")
    with pytest.raises(RewardError, match=r"'named' takes no argument 'level', which data"):
        RewardFunctions.from_specs([named], None).check_columns(["answer", "level"], "data.train")


@pytest.mark.parametrize("function", ["sleeps_in_sandbox", "sleeps_in_sandbox_unisolated"])
def test_a_worker_killed_at_the_timeout_leaves_no_sandboxed_program(
    module, function, tmp_path, monkeypatch
):
    """A code reward's program outlived its worker killed at reward.timeout (without
    bubblewrap it slept on after the run) and its directory stayed in the temp dir."""
    import shutil
    import tempfile
    from pathlib import Path

    from gspo.rewards import sandbox

    temp = Path(tempfile.mkdtemp(dir="/tmp"))  # (the workers' and this process's; one the
    temp.chmod(0o711)  # sandbox uid passes through, as tmp_path is not under root)
    monkeypatch.setenv("GSPO_TEST_SANDBOX_BASE", str(temp))
    monkeypatch.setattr(sandbox, "_host_base", lambda: str(temp))
    functions = RewardFunctions.from_specs(specs(module, function), workers=1, timeout=2.0)
    try:
        with pytest.raises(RewardError, match="did not finish within reward.timeout=2 s"):
            functions(["p"], ["a"])
    finally:
        functions.close()
    left = list(temp.iterdir())
    shutil.rmtree(temp, ignore_errors=True)
    assert left == []
    running = []  # (a sandboxed program's working directory is under the temp dir)
    for entry in Path("/proc").iterdir():
        try:
            where = os.readlink(entry / "cwd")
        except OSError:
            continue
        if where.startswith(str(temp)):
            running.append((entry.name, where))
    assert running == []


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
def test_workers_killed_by_a_signal_to_the_process_group_do_not_hang_the_close(module, busy):
    """SIGTERM to the whole process group (a cluster's time limit) kills the idle workers,
    one of them inside the task queue's read lock: the pool's own shutdown (close and join,
    or terminate) then waited on that lock forever, and the stopped run never ended."""
    import signal
    import threading

    functions = RewardFunctions.from_specs(specs(module, "pid_parity"), workers=3)
    runner = functions.runner
    functions(["p"] * 6, ["a"] * 6)  # started and idle
    workers = list(runner.start()._pool)
    runner._busy = busy
    for process in workers:
        os.kill(process.pid, signal.SIGTERM)
    for process in workers:
        process.join(10)
    closing = threading.Thread(target=functions.close, daemon=True)
    closing.start()
    closing.join(60)
    assert not closing.is_alive(), "close() hung on the task queue's lock"
    assert runner._pool is None
    assert all(process.exitcode == -signal.SIGTERM for process in workers)
