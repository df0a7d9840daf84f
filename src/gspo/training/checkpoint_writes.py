"""A run's checkpoints as it writes them: one at a time, in a background thread while
training goes on (a single process), their lines logged in step order, ``latest`` moved
once each is whole (:mod:`gspo.training.checkpoint` takes and writes them)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Mapping
from copy import deepcopy
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gspo.distributed import Distributed
from gspo.training import checkpoint as ckpt
from gspo.training.checkpoint import CheckpointState, finish_checkpoint

if TYPE_CHECKING:
    from gspo.telemetry import MetricsLogger


class _Write:
    """One checkpoint being written: its state, its thread, and what came of it."""

    def __init__(self, state: CheckpointState, snapshot_s: float):
        self.state = state
        self.snapshot_s = snapshot_s  # the run's seconds taking it
        self.bytes = 0
        self.write_s = 0.0
        self.parts: dict[str, float] = {}  # seconds by part (write_checkpoint)
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        # Set once the write ended. Waited on rather than ``thread.join()``: a join that a
        # signal interrupts (a second SIGTERM while a stopped run waits for its checkpoint)
        # marks a thread still running as ended in Python 3.11, so that the next join
        # returned at once: ``latest`` named a step not yet on disk, logged as 0 bytes.
        self.done = threading.Event()

    def run(self, dist: Distributed) -> None:
        try:
            self.bytes, self.write_s, self.parts = ckpt.write_checkpoint(self.state, dist)
        except BaseException as exc:  # raised in the main thread, at its next wait
            self.error = exc
        finally:
            self.done.set()


class Checkpoints:
    """A run's checkpoints, written one at a time, in a background thread when ``background``.

    :meth:`save` takes the checkpoint at the caller's step (copied to CPU memory) and
    returns while a thread writes it through :func:`write_checkpoint`; once it is whole,
    the main thread logs its line (``io/checkpoint_bytes``, ``time/checkpoint``: the seconds
    the run waited for it, ``time/checkpoint_write``: the write's own, and its parts'
    ``time/checkpoint_model``, ``_sharded``, ``_manifest``), ``latest`` names
    it and the old ones are pruned (:func:`finish_checkpoint`), in that order; without
    ``background`` all of it at once. That happens at the first of: the next
    :meth:`log` after the write is done, the next :meth:`save`, :meth:`wait` (the end of
    the run, an exception, :meth:`close`). Metrics logged through :meth:`log` while a write
    is in flight are held and logged after the checkpoint's line, so ``metrics.jsonl``
    (and every tracker: W&B takes steps in order only) reads as a synchronous run's, and
    everything logged is on disk before ``latest`` moves. A run killed meanwhile resumes
    from the checkpoint before, whose steps it redoes.

    A write's error (a full disk: one :class:`gspo.publish.DiskFull` line) is raised in the
    main thread at the next :meth:`log`, :meth:`save` or :meth:`wait`.

    Without ``background`` (several ranks: the sharded save is a collective, which must
    not run beside the training's own) every checkpoint is written in :meth:`save`.
    """

    def __init__(
        self,
        output_dir: Path,
        logger: MetricsLogger,
        *,
        keep: int,
        dist: Distributed,
        background: bool,
        tokenizer: Any = None,
    ):
        if background and dist.enabled:
            raise ValueError("background checkpoints are for a single process (one rank)")
        self.output_dir = Path(output_dir)
        self.logger = logger
        self.keep = keep
        self.dist = dist
        self.background = background
        self.pending: _Write | None = None
        self.held: list[tuple[int, Mapping[str, Any]]] = []
        self.longest_s = 0.0  # the longest a checkpoint took (its snapshot and write)
        self.tokenizer = tokenizer  # the run's, saved in each checkpoint
        self._writer_tokenizer: Any = None  # the writer thread's copy of it

    def save(self, take: Callable[[bool, Any], CheckpointState], *, last: bool = False) -> Path:
        """Wait for the previous write, then ``take(copy, tokenizer)`` this step's
        checkpoint and write it (in the background, or now). ``last``: nothing trains after
        it, so it is written now from the live tensors (a copy would only add its own time
        to the wait). A background write saves a copy of the tokenizer: a fast tokenizer is
        not for two threads at once. Its directory."""
        self.wait()
        background = self.background and not last
        start = time.perf_counter()  # (the tokenizer's copy too: the run waits for it)
        tokenizer = self.tokenizer
        if background and tokenizer is not None:
            if self._writer_tokenizer is None:
                self._writer_tokenizer = deepcopy(tokenizer)
            tokenizer = self._writer_tokenizer
        state = take(background, tokenizer)
        write = _Write(state, time.perf_counter() - start)
        if not background:
            write.run(self.dist)
            self._finish(write, waited=write.write_s)
            return state.final
        write.thread = threading.Thread(
            target=write.run, args=(self.dist,), name="gspo checkpoint writer"
        )
        self.pending = write
        write.thread.start()
        return state.final

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """``logger.log(step, metrics)``, after the checkpoint being written, if one is."""
        if self.pending is not None and self.pending.done.is_set():
            self.wait()
        if self.pending is not None:
            self.held.append((step, dict(metrics)))
        else:
            self.logger.log(step, metrics)

    def wait(self, *, quiet: bool = False) -> None:
        """Wait for the write in flight, if any, and finish it; its error is raised (with
        ``quiet``, on the way out of another exception: said in one line on stderr)."""
        write = self.pending
        if write is None:
            return
        start = time.perf_counter()
        write.done.wait()  # (interrupted, it stays pending: the exception path waits again)
        self.pending = None
        try:
            self._finish(write, waited=time.perf_counter() - start)
        except BaseException as exc:
            if not quiet:
                raise
            print(f"gspo: checkpoint {write.state.final} not written: {exc}", file=sys.stderr)

    def _finish(self, write: _Write, waited: float) -> None:
        held, self.held = self.held, []
        self.longest_s = max(self.longest_s, write.snapshot_s + write.write_s)
        if write.error is not None:
            for step, metrics in held:  # what the run did meanwhile: logged, then the error
                self.logger.log(step, metrics)
            raise write.error
        self.logger.log(
            write.state.step,
            {
                "io/checkpoint_bytes": write.bytes,
                "time/checkpoint": write.snapshot_s + waited,
                "time/checkpoint_write": write.write_s,
                **{f"time/checkpoint_{name}": s for name, s in write.parts.items()},
            },
        )
        for step, metrics in held:
            self.logger.log(step, metrics)
        finish_checkpoint(self.output_dir, write.state.final, keep=self.keep, dist=self.dist)
