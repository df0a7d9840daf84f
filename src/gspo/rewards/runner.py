"""How reward functions are called on a batch (:class:`Runner`): in this process, or in
worker processes; with a deadline."""

from __future__ import annotations

import contextlib
import functools
import inspect
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from multiprocessing.pool import TERMINATE
from pathlib import Path
from typing import Any

from gspo.plugins import (
    missing_arguments,
    one_line,
    raised,
    run_coroutine,
    takes_keyword,
    unexpected_arguments,
)
from gspo.rewards.contract import OFFERED, TRL_ONLY, RewardError, RewardFunction
from gspo.rewards.loading import load_reward_function


def _call_one(
    name: str, function: RewardFunction, prompts: Any, completions: Any, columns: Any
) -> Any:
    given = ["prompts", "completions", *columns]
    try:
        out = function(prompts=prompts, completions=completions, **columns)
        if inspect.iscoroutine(out):  # an async def function (TRL takes those too)
            out = run_coroutine(out)
    except (Exception, SystemExit) as e:  # sys.exit in a reward ended the run as a success
        if isinstance(e, RewardError) and getattr(function, "names_its_errors", False):
            raise  # (by_source's lines name the source and the function it routed to)
        missing = missing_arguments(function, given)
        if isinstance(e, TypeError) and missing:
            have = ", ".join(columns) or "none but the prompt"
            raise RewardError(
                f"reward function {name!r} needs the argument(s) {', '.join(missing)}, which "
                f"no data column gives (the columns: {have})"
            ) from e
        if isinstance(e, KeyError) and e.args and e.args[0] in TRL_ONLY and e.args[0] not in given:
            raise RewardError(
                f"reward function {name!r} read {e.args[0]!r} from its keyword arguments, "
                f"which TRL passes and gspo does not (docs/from_trl.md: {TRL_ONLY[e.args[0]]}); "
                f"read it with kwargs.get({e.args[0]!r}) to run without it"
            ) from e
        passed_on = [k for k in OFFERED if f"unexpected keyword argument '{k}'" in str(e)]
        if isinstance(e, TypeError) and passed_on and passed_on[0] in columns:
            raise RewardError(  # (its **kwargs passed on to a function that takes no such)
                f"reward function {name!r} raised {raised(e)}: gspo offers "
                f"{passed_on[0]!r} to every reward function that takes **kwargs "
                f"(docs/from_trl.md); take it out before passing the kwargs on: "
                f"kwargs.pop({passed_on[0]!r}, None)"
            ) from e
        unexpected = unexpected_arguments(function, given)
        if isinstance(e, TypeError) and unexpected:
            raise RewardError(
                f"reward function {name!r} takes no argument {unexpected[0]!r}, which the "
                "call passes (prompts, completions and every data column, as keywords: "
                "TRL's convention); add **kwargs to its parameters"
            ) from e
        messages = bool(completions) and isinstance(completions[0], list)
        if messages and isinstance(e, AttributeError) and "'list' object" in str(e):
            hint = (  # (the README's own `c.strip()` under data.chat_template=true)
                "; with chat prompts each completion is a list of messages: its text is "
                "c[0]['content'], as in TRL"
            )
            raise RewardError(f"reward function {name!r} raised {raised(e)}{hint}") from e
        raise RewardError(f"reward function {name!r} raised {raised(e)}") from e
    # a numpy array or a 1-D tensor of rewards as the list it stands for
    return out.tolist() if hasattr(out, "tolist") and getattr(out, "ndim", 0) == 1 else out


def _offered_to(
    function: RewardFunction, columns: Mapping[str, Sequence[Any]]
) -> Mapping[str, Sequence[Any]]:
    """``columns`` less what the call offers (:data:`OFFERED`) that ``function`` does not
    take: a function without ``**kwargs`` is called as it was before they were offered."""
    declined = [k for k in OFFERED if k in columns and not takes_keyword(function, k)]
    return {k: v for k, v in columns.items() if k not in declined} if declined else columns


@functools.cache
def _worker_function(spec: str) -> RewardFunction:
    return load_reward_function(spec)


def _worker_call(name: str, spec: str | bytes, prompts: Any, completions: Any, columns: Any) -> Any:
    """In a worker process: load the function by its spec (or unpickle it) and call it."""
    function = pickle.loads(spec) if isinstance(spec, bytes) else _worker_function(spec)
    try:
        return _call_one(name, function, prompts, completions, columns)
    except RewardError as e:  # the cause may not pickle; its message is what matters
        raise RewardError(str(e)) from None


def _main_script() -> str | None:
    """The file of the ``__main__`` module, which a worker imports as it starts; None when
    there is none (``python -c``, a notebook, the REPL)."""
    return getattr(sys.modules.get("__main__"), "__file__", None)


def _shippable(name: str, spec: str | RewardFunction) -> str | bytes:
    """What a worker needs to get the function: its spec string, or the pickled callable."""
    if isinstance(spec, str):
        return spec.strip()
    if getattr(spec, "__module__", None) == "__main__" and _main_script() is None:
        raise RewardError(
            f"reward function {name!r} is defined in an interactive session (python -c, a "
            "notebook, the REPL), which reward.workers processes cannot import; define it "
            "in a .py file, or set reward.workers=0"
        )
    try:
        return pickle.dumps(spec)
    except Exception as e:
        raise RewardError(
            f"reward function {name!r} cannot be sent to reward.workers processes "
            f"({type(e).__name__}: {one_line(e, 120)}); name it by a spec string "
            f"(path/to/file.py:function) or set reward.workers=0"
        ) from None


#: In the environment of reward worker processes while they start: a file to create if
#: starting one ran into a run (see :func:`leave_if_starting_a_worker`).
WORKER_STARTING = "GSPO_REWARD_WORKER_STARTING"


def leave_if_starting_a_worker() -> None:
    """Called where a run starts (``gspo.train``, ``Trainer``). A reward worker process
    imports the main script as it starts (``spawn``); a script that calls ``gspo.train``
    outside ``if __name__ == "__main__":`` would start a whole run in every worker, whose
    own workers would do the same. Such a worker marks its flag file and leaves at once;
    the run that started it then stops with one line (:meth:`Runner.start`)."""
    flag = os.environ.get(WORKER_STARTING)
    if flag:
        Path(flag).touch()
        os._exit(1)


@contextlib.contextmanager
def _starting_workers() -> Iterator[Path]:
    """The flag file workers started meanwhile create if they run into a run."""
    with tempfile.TemporaryDirectory(prefix="gspo-reward-workers-") as folder:
        flag = Path(folder) / "script-not-guarded"
        os.environ[WORKER_STARTING] = str(flag)
        try:
            yield flag
        finally:
            os.environ.pop(WORKER_STARTING, None)


def _worker_started() -> None:
    """A worker is up: processes it starts itself are not starting workers. Ctrl-C is the
    run's to answer (it stops the workers): a worker ignores it, which printed its
    KeyboardInterrupt traceback beside the run's one line."""
    os.environ.pop(WORKER_STARTING, None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _chunks(n: int, parts: int) -> list[tuple[int, int]]:
    size, extra = divmod(n, parts)
    bounds, start = [], 0
    for k in range(parts):
        stop = start + size + (k < extra)
        if stop > start:
            bounds.append((start, stop))
        start = stop
    return bounds


#: Longest wait for a batch's other tasks after one of them failed (see ``Runner._settle``).
SETTLE_SECONDS = 10.0

#: How often a wait for a worker's result looks whether a worker process died.
WATCH_SECONDS = 0.5


#: Longest wait for idle workers to exit once the pool is closed.
CLOSE_SECONDS = 10.0


def _killed(workers: Sequence[Any]) -> bool:
    """Whether one of ``workers`` was ended by a signal (a worker's own crash or
    ``os._exit`` ends it with a code, and its task; a signal may have caught it idle)."""
    return any(p.exitcode is not None and p.exitcode < 0 for p in workers)


def _exited(workers: Sequence[Any], within: float) -> bool:
    """Whether ``workers``, told to exit, did so with code 0 within ``within`` seconds."""
    end = time.monotonic() + within
    while any(p.exitcode is None for p in workers):
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return not any(p.exitcode for p in workers)


class _WorkerDied(RewardError):
    """A worker process ended while the batch was scored: its task will never finish
    (``multiprocessing.Pool`` replaces the process and drops the task)."""


class Runner:
    """How reward functions are called on a batch.

    ``workers=0`` calls them in this process; ``workers=N`` splits each batch into N
    contiguous chunks scored in parallel by N worker processes (started once, with
    ``spawn``; each loads the functions from their specs). ``timeout`` (seconds for the
    whole batch) turns a function that hangs into a :class:`RewardError` naming it; with
    workers the hung processes are killed, without them the call is abandoned in a daemon
    thread (the run stops anyway).

    A function marked ``main_thread_spec`` (``math``: math-verify's own time limits need a
    process's main thread) is called, wherever it would run in a thread other than the
    main one (a daemon thread for ``timeout``, the rollout thread of async rollouts), in
    one worker process of its own, loaded by that spec: there its time limits hold (an
    expression such as ``9^{9^{9^9}}`` took forever without them).
    """

    def __init__(self, workers: int = 0, timeout: float | None = None):
        if workers < 0:
            raise RewardError(f"reward.workers={workers}: must be >= 0")
        if timeout is not None and not timeout > 0:
            raise RewardError(f"reward.timeout={timeout}: must be > 0 seconds")
        self.workers = workers
        self.timeout = timeout
        self._pool: Any = None
        self._processes: list[Any] = []
        self._finalizer: Any = None
        self._busy = False  # some task sent to the workers may not have finished
        self._aside: Runner | None = None  # (see main_thread_spec)
        self._no_aside: str | None = None  # why the aside process cannot start, once it could not

    def check(self, names: Sequence[str], specs: Sequence[str | RewardFunction]) -> None:
        """With workers: that they can start (the main script they import is a file) and
        that each function can be sent to them; one-line :class:`RewardError` if not."""
        if self.workers == 0:
            return
        script = _main_script()
        if script is not None and not os.path.isfile(script):
            raise RewardError(
                f"reward.workers={self.workers}: the worker processes import the main "
                f"script as they start, and {script!r} is no file (a script read from "
                "stdin?); run it from a file, or set reward.workers=0"
            )
        for name, spec in zip(names, specs, strict=True):
            _shippable(name, spec)

    def start(self) -> Any:
        """Start the worker processes (once) and wait until each is up; the pool."""
        if self._pool is None:
            context = multiprocessing.get_context("spawn")
            with _starting_workers() as flag:
                self._pool = context.Pool(self.workers, initializer=_worker_started)
                self._processes = list(self._pool._pool)  # to see one die (Pool hides it)
                self._finalizer = weakref.finalize(self, self._pool.terminate)
                started = self._pool.map_async(_worker_function, ["format"] * self.workers)
                while not started.ready():
                    started.wait(0.2)
                    if flag.exists():
                        self._busy = True  # killed, not waited for
                        self.close()
                        raise RewardError(
                            f"reward.workers={self.workers}: the worker processes import "
                            "the main script as they start, and it started a run again; "
                            'put the script\'s gspo.train call under if __name__ == "__main__":'
                        )
                started.get()
        return self._pool

    def close(self) -> None:
        """Stop the worker processes. Idle workers are told to exit and waited for, not
        killed: a worker killed just after sending a result, before it releases the result
        queue's lock, would leave the pool's shutdown waiting on that lock forever. Workers
        that may still be busy (a function past ``timeout``) are killed. Where a worker
        was killed from outside (SIGTERM to the whole process group: a cluster's time
        limit, ``kill -- -PGID``), an idle one may have died holding the task queue's lock:
        the pool's shutdown would wait on it forever, so the workers left are killed and
        that shutdown is not run."""
        if self._pool is not None:
            workers = [*self._processes, *self._pool._pool]
            if _killed(workers):
                self._abandon(workers)
            elif self._busy:
                self._finalizer()  # Pool.terminate
            else:
                self._pool.close()
                if _exited(workers, within=CLOSE_SECONDS):
                    self._finalizer.detach()
                    self._pool.join()
                else:  # (one was killed meanwhile, or one hangs at exit)
                    self._abandon(workers)
            if self._busy or _killed(workers):
                from gspo.rewards.sandbox import sweep  # (the code reward's, lazily)

                sweep(sorted({p.pid for p in workers}))  # (what their sandboxed programs left)
        self._pool = self._finalizer = None
        self._processes = []
        self._busy = False
        if self._aside is not None:
            self._aside.close()

    def _abandon(self, workers: Sequence[Any]) -> None:
        """Kill ``workers`` and leave the pool's own shutdown (and its at-exit one) undone:
        it takes the task queue's lock, which a worker killed from outside may hold."""
        pool = self._pool
        pool._state = pool._worker_handler._state = TERMINATE  # (none replaced from now on)
        pool._change_notifier.put(None)
        pool._worker_handler.join(CLOSE_SECONDS)
        workers = [*workers, *(p for p in pool._pool if p not in workers)]
        for process in workers:
            if process.exitcode is None:
                process.kill()
        for process in workers:
            process.join(CLOSE_SECONDS)
        self._finalizer.detach()
        pool._terminate.cancel()  # (multiprocessing's at-exit Pool.terminate)

    def _late(self, name: str) -> RewardError:
        return RewardError(
            f"reward function {name!r} did not finish within reward.timeout={self.timeout:g} s "
            "for one rollout batch, so the run stops here (a longer reward.timeout gives it "
            "more time)"
        )

    def run(
        self,
        names: Sequence[str],
        functions: Sequence[RewardFunction],
        specs: Sequence[str | RewardFunction],
        prompts: Sequence[Any],
        completions: Sequence[Any],
        columns: Mapping[str, Sequence[Any]],
        deadline: float | None = None,
    ) -> list[Any]:
        """Each function's raw output on the whole batch, in order (``deadline``: a
        ``time.monotonic()`` to finish by, where not ``timeout`` from now)."""
        if self.workers > 0:
            shipped = [_shippable(n, s) for n, s in zip(names, specs, strict=True)]
            pool = self.start()  # start-up is not part of the deadline
        if deadline is None and self.timeout is not None:
            deadline = time.monotonic() + self.timeout
        # (what the call offers beside the data, e.g. completion_ids: to the functions taking it)
        own = [_offered_to(f, columns) for f in functions]
        if self.workers == 0:
            return [
                self._in_this_process(name, f, prompts, completions, its, deadline)
                for name, f, its in zip(names, functions, own, strict=True)
            ]
        bounds = _chunks(len(completions), self.workers)
        pending = [
            [
                pool.apply_async(
                    _worker_call,
                    (
                        name,
                        spec,
                        prompts[a:b],
                        completions[a:b],
                        {k: v[a:b] for k, v in its.items()},
                    ),
                )
                for a, b in bounds
            ]
            for name, spec, its in zip(names, shipped, own, strict=True)
        ]
        tasks = [part for parts in pending for part in parts]
        self._busy = True
        outputs = []
        for name, parts in zip(names, pending, strict=True):
            merged: list[Any] = []
            for part in parts:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    raw = self._result(part, left, name)
                except multiprocessing.TimeoutError:
                    self.close()  # kills the hung workers; a new pool is made if needed
                    raise self._late(name) from None
                except _WorkerDied:
                    raise
                except BaseException:
                    self._settle(tasks, deadline)
                    raise
                if not isinstance(raw, (list, tuple)):
                    merged = raw  # reported by the caller, like an in-process result
                    break
                merged.extend(raw)
            outputs.append(merged)
        self._settle(tasks, deadline)
        return outputs

    def _result(self, part: Any, left: float | None, name: str) -> Any:
        """``part``'s result within ``left`` seconds (None: no limit), looking every
        :data:`WATCH_SECONDS` whether a worker process died (a segfault, ``os._exit``, a
        ``sys.exit`` outside the function): the wait would never end otherwise."""
        end = None if left is None else time.monotonic() + left
        while True:
            wait = WATCH_SECONDS
            if end is not None:
                wait = max(0.0, min(wait, end - time.monotonic()))
            try:
                return part.get(timeout=wait)
            except multiprocessing.TimeoutError:
                dead = next((p for p in self._processes if p.exitcode is not None), None)
                if dead is not None:
                    code = dead.exitcode
                    self.close()  # the others may be busy: killed
                    how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                    raise _WorkerDied(
                        f"reward function {name!r}: a reward.workers process died while it "
                        f"scored ({how}: a crash, os._exit or sys.exit), so the run stops here"
                    ) from None
                if end is not None and time.monotonic() >= end:
                    raise

    def _settle(self, parts: list[Any], deadline: float | None) -> None:
        """Wait for the batch's tasks (after one failed, the others may still run; until
        ``deadline``, and at most ``SETTLE_SECONDS``), so that the workers are idle when
        the pool is closed; a task still running leaves the pool marked busy."""
        limit = time.monotonic() + SETTLE_SECONDS
        if deadline is not None:
            limit = min(limit, deadline)
        for part in parts:
            part.wait(max(0.0, limit - time.monotonic()))
        self._busy = not all(part.ready() for part in parts)

    def _in_this_process(
        self,
        name: str,
        function: RewardFunction,
        prompts: Any,
        completions: Any,
        columns: Any,
        deadline: float | None,
    ) -> Any:
        spec = getattr(function, "main_thread_spec", None)
        in_thread = (
            deadline is not None or threading.current_thread() is not threading.main_thread()
        )
        aside = self._aside_runner(name, spec) if spec is not None and in_thread else None
        if aside is None:
            return self._in_thread(name, function, prompts, completions, columns, deadline)
        # (its own columns only: an environment's objects do not pickle; None: every one;
        # what the call offers, thinking_opened, too: the built-ins read it)
        reads = getattr(function, "reads_columns", getattr(function, "required_columns", ()))
        needed = {
            k: v
            for k, v in columns.items()
            if (k != "environments" if reads is None else k in reads or k in OFFERED)
        }
        return aside.run([name], [function], [spec], prompts, completions, needed, deadline)[0]

    def _aside_runner(self, name: str, spec: str) -> Runner | None:
        """The one worker process ``main_thread_spec`` functions run in, started on first
        use; None (said once) where it cannot start: a main script read from stdin, or one
        that starts a run again as the worker imports it. There the function runs in this
        process, without its own time limits, as before."""
        if self._aside is None and self._no_aside is None:
            aside = Runner(workers=1, timeout=self.timeout)
            try:
                aside.check([name], [spec])
                aside.start()
                self._aside = aside
            except RewardError as e:
                aside.close()
                self._no_aside = str(e).split(": ", 1)[-1]
                print(
                    f"gspo: warning: reward function {name!r} runs without math-verify's "
                    "time limits, which need a main thread (scored in another here), since "
                    f"the process it would run in cannot start: {self._no_aside}",
                    file=sys.stderr,
                    flush=True,
                )
        return self._aside

    def _in_thread(
        self,
        name: str,
        function: RewardFunction,
        prompts: Any,
        completions: Any,
        columns: Any,
        deadline: float | None,
    ) -> Any:
        if deadline is None:
            return _call_one(name, function, prompts, completions, columns)
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["out"] = _call_one(name, function, prompts, completions, columns)
            except BaseException as e:  # re-raised in the caller's thread
                box["err"] = e

        thread = threading.Thread(target=target, name=f"reward {name}", daemon=True)
        thread.start()
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            raise self._late(name)
        if "err" in box:
            raise box["err"]
        return box["out"]
