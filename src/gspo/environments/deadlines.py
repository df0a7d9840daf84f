"""Calls into an environment in time: :class:`deadline` (``rollout.env_timeout``), the
watch that says a call still running without one (:class:`SlowCalls`), and the errors a bad
or overrunning environment raises (:class:`EnvError`, :class:`EnvTimeout`)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

#: Past rollout.env_timeout, how long a call interrupted in the main thread may take to
#: give up (code that never returns to Python, a C loop, cannot be interrupted).
ENV_GRACE_SECONDS = 30.0


class _Overran(BaseException):
    """Raised into a call past its deadline: a BaseException, so that the environment's
    own ``except Exception`` does not take it for one of its errors and go on."""


class deadline:
    """``with deadline(seconds, what):`` around ``what``, a call into an environment, which
    must return within ``seconds`` (None: no limit); past it the run stops with one line,
    checkpoints intact (``--resume`` continues from the last).

    In the main thread a timer thread sends the main thread SIGALRM at the deadline, whose
    handler raises a BaseException into the call (an environment's ``except Exception``
    lets it through; no ``setitimer``, so another timer of the process, math-verify's
    alarm in a tool or pytest-timeout's, neither cancels it nor is cancelled); it leaves
    the call as :class:`EnvTimeout`, which Python code that called ``gspo.train`` can
    catch, also where the call swallowed the interrupt (a bare ``except:``) or returned
    late. Elsewhere (async rollouts' thread), or when the call does not give up within
    :data:`ENV_GRACE_SECONDS`, nothing can interrupt it and the process ends with the
    line, as a kill would."""

    def __init__(self, seconds: float | None, what: str):
        self.seconds = seconds
        self.said = (
            f"{what} did not return within rollout.env_timeout={seconds:g} s; the run stops "
            "here (gspo train --resume continues from its last checkpoint; a run stopped "
            "before its first is not kept: start it again)"
            if seconds is not None
            else ""
        )
        self.fired = self.returned = False
        self.timers: list[threading.Timer] = []
        self.previous: Any = None
        self.installed = False

    def __enter__(self) -> deadline:
        if self.seconds is None:
            return self
        main = threading.current_thread() is threading.main_thread()
        interrupt = main and hasattr(signal, "pthread_kill")
        if interrupt:
            self.previous = signal.signal(signal.SIGALRM, self._alarm)
            self.installed = True
            self._start(self.seconds, self._interrupt)
        self._start(self.seconds + (ENV_GRACE_SECONDS if interrupt else 0.0), self._end)
        return self

    def _start(self, seconds: float, action: Callable[[], None]) -> None:
        timer = threading.Timer(seconds, action)
        timer.daemon = True
        self.timers.append(timer)
        timer.start()

    def _interrupt(self) -> None:
        """At the deadline: SIGALRM to the main thread, again every ``INTERRUPT_EVERY``
        seconds until the call has returned (one that lands in :meth:`__enter__` or
        :meth:`__exit__` is let go: raised there, it would leave the ``with`` unhandled)."""
        self.fired = True
        main = threading.main_thread().ident
        while not self.returned:
            signal.pthread_kill(main, signal.SIGALRM)
            time.sleep(INTERRUPT_EVERY)

    def _alarm(self, signum: int, frame: Any) -> None:
        if self.fired and not self.returned and not _inside(frame, _OWN_CODE):
            raise _Overran
        if not self.fired and callable(self.previous):  # another's alarm, while the call runs
            self.previous(signum, frame)

    def _end(self) -> None:
        from gspo.distributed import rank_said

        print(f"gspo: error{rank_said()}: {self.said}", file=sys.stderr, flush=True)
        os._exit(2)

    def __exit__(self, kind: Any, error: Any, trace: Any) -> bool:
        self.returned = True  # (first: from here an alarm does nothing)
        for timer in self.timers:
            timer.cancel()
        # an interrupt being sent is sent (and met by _alarm, a no-op now) before the
        # handler goes (the default one would kill); a cancelled timer's thread ends at
        # once, joined so that none outlives the call (under load one was still there)
        for timer in self.timers:
            timer.join()
        if self.installed:  # (None: one not set from Python, which is the default's place)
            signal.signal(
                signal.SIGALRM, signal.SIG_DFL if self.previous is None else self.previous
            )
        if self.fired:  # interrupted, or the call swallowed the interrupt and went on
            raise EnvTimeout(self.said) from None
        return False


#: With ``rollout.env_timeout`` null, a call into an environment still running after this
#: many seconds is said once on stderr (:class:`SlowCalls`).
SLOW_CALL_SECONDS = 120.0


class SlowCalls:
    """With no ``rollout.env_timeout``, one stderr line for each call into an environment
    still running after ``after`` seconds (a hung environment otherwise held the run with
    no word), naming the call and the setting that stops it. One watching thread, made at
    the first call and ended with this object; a call costs two dictionary writes."""

    def __init__(self, after: float | None = None):
        self.after = SLOW_CALL_SECONDS if after is None else after
        self.running: dict[int, tuple[str, float]] = {}  # thread -> (call, its start)
        self.thread: threading.Thread | None = None
        self.starting = threading.Lock()  # (calls from several threads: one watcher)

    @contextmanager
    def watch(self, what: str) -> Iterator[None]:
        if self.thread is None:
            with self.starting:
                if self.thread is None:
                    thread = threading.Thread(
                        target=_watch_calls, args=(weakref.ref(self),), daemon=True,
                        name="gspo-slow-env-calls",
                    )  # fmt: skip
                    thread.start()
                    self.thread = thread
        key = threading.get_ident()
        self.running[key] = (what, time.monotonic())
        try:
            yield
        finally:
            self.running.pop(key, None)


def _watch_calls(ref: weakref.ref[SlowCalls]) -> None:
    from gspo.distributed import rank_said

    said: set[tuple[str, float]] = set()
    while (calls := ref()) is not None:
        now, period = time.monotonic(), min(calls.after / 4, 5.0)
        for call in list(calls.running.values()):
            if call not in said and now - call[1] >= calls.after:
                said.add(call)
                print(
                    f"gspo: warning{rank_said()}: {call[0]} has not returned in "
                    f"{now - call[1]:.0f} s; rollout.env_timeout=null waits for it without "
                    "limit (set rollout.env_timeout=SECONDS to stop the run at such a call; "
                    "gspo train --resume continues)",
                    file=sys.stderr, flush=True,
                )  # fmt: skip
        del calls
        time.sleep(period)


#: How often the interrupt is sent again until a call past its deadline returns.
INTERRUPT_EVERY = 0.02
_OWN_CODE = (deadline.__enter__.__code__, deadline.__exit__.__code__)


def _inside(frame: Any, codes: tuple[Any, ...], depth: int = 16) -> bool:
    """Whether ``frame`` or one of the ``depth`` frames that called it runs ``codes``."""
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


class EnvError(ValueError):
    """A bad environment (not found, not constructible, a tool without schema): one line."""


class EnvTimeout(EnvError):
    """A call into an environment past ``rollout.env_timeout`` (:func:`deadline`): the
    run stops, whatever the call would have made of an error of its own."""
