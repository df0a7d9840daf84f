"""A run in its directory: :func:`train` (the Python entry point: ``gspo.train``), what
may change when a run is resumed (:func:`resume_config`, :func:`check_same_model`), and
making or replacing the directory around a trainer (:class:`RunDirectory`, which
``gspo train`` uses too)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import sys
from pathlib import Path
from typing import Any, Literal

import torch

from gspo.config import RESUME_MAY_CHANGE, Config, checked_config, flat_settings, load_config
from gspo.distributed import (
    Distributed,
    not_rank_zero,
    setup_distributed,
    signals_held,
    sigterm_raises,
    teardown_distributed,
)
from gspo.environments import EnvError
from gspo.models.loading import (
    MODEL_FINGERPRINT,
    WEIGHT_SUFFIXES,
    fingerprint_change,
    model_files,
)
from gspo.moved import moved_path
from gspo.publish import MARK, stranded_asides, temp_path
from gspo.rewards.contract import RewardError
from gspo.rewards.runner import leave_if_starting_a_worker
from gspo.telemetry import METRICS_FILE, StepProfiler, print_summary, read_metrics
from gspo.trainer import Trainer, took_its_steps
from gspo.training.checkpoint import (
    CHECKPOINTS,
    CONFIG,
    TRAINER_STATE,
    latest_checkpoint,
    new_run_from,
    resume_problem,
    trainer_state,
)
from gspo.training.cold_start import DataError, progress_checkpoints
from gspo.training.setup import with_absolute_paths


def train(
    config: Config,
    output_dir: str | Path,
    *,
    resume: bool | Literal["auto"] = False,
    overwrite: bool = False,
) -> list[dict[str, Any]]:
    """Run (or, with ``resume``, continue) a training run in ``output_dir``; returns the
    metric records. A directory that already holds a run is refused unless resumed or
    ``overwrite`` (which removes the old run once the new one has trained its first
    rollout batch: :class:`RunDirectory`), as ``gspo train`` does. ``resume="auto"``
    continues the run there if it has a checkpoint and starts it otherwise, with
    ``config`` (``--auto-resume``: a script a scheduler requeues). Under ``torchrun`` every
    rank calls it and it joins (and leaves) the process group, as ``gspo train`` does."""
    leave_if_starting_a_worker()  # a reward worker importing an unguarded script
    checked_config(config, "train")  # (and keys assigned from Python, checked alone)
    if not isinstance(output_dir, str | os.PathLike) or not str(output_dir):
        raise ValueError(f"train: output_dir {output_dir!r} is no directory path")
    out = Path(output_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"train: output_dir {out} is a file, not a directory")
    if resume not in (True, False, "auto"):
        raise ValueError(f"train: resume={resume!r}: True, False or 'auto'")
    if resume and overwrite:
        raise ValueError(
            f"train: overwrite=True starts a run over, resume={resume!r} continues one"
        )
    how = f"resume={resume!r}"  # (the words of its errors)
    if resume == "auto":  # (a run stopped before its first checkpoint: started over)
        resume = auto_resumes(out)
        overwrite = not resume and (out / CHECKPOINTS).exists()
    if not resume and not overwrite and (out / CHECKPOINTS).exists():
        raise ValueError(
            f"train: {out} already holds a run; resume=True continues it, overwrite=True "
            "replaces it, or choose another output_dir"
        )
    if resume:
        if (problem := not_a_run(out, how)) is not None:
            raise ValueError(f"train: {how}, but {out} {problem}")
        check_same_model(out, config, how, "another output_dir")
        if (done := finished_model_only(out, config)) is not None:
            return done
    # under torchrun: each rank runs the script, and joins the process group here
    joined = not torch.distributed.is_initialized()
    dist = setup_distributed(config.model.device, out)
    try:
        with RunDirectory(out, replace=overwrite, dist=dist, name="train: output_dir") as run:
            with StepProfiler.of_run(config, out, dist).startup():
                trainer = Trainer(config, out, resume=resume, dist=dist)
            run.built()
            with trainer:
                records = trainer.fit(started=run.started)
                dist.barrier()
    finally:
        if joined:  # a group the caller made is the caller's to leave
            teardown_distributed(dist)
    return records


#: A run's inputs failing on their first use (a reward function's first call, an
#: environment's first episode): the run could not have run. Before its first rollout batch
#: is trained such a failure leaves nothing behind (:class:`RunDirectory`).
INPUT_ERRORS = (RewardError, EnvError, DataError)
#: Left in the run directory by a rank other than 0 that stopped on its own input before
#: the run started: rank 0, stopped by the broken process group, then undoes the start too.
#: It holds the torchrun job's id (:func:`job_id`): one left by another job is removed.
UNDONE_MARK = ".gspo-undone"


def job_id() -> str:
    """This torchrun job as the ranks of one machine all see it: their launcher's pid and
    its restart count (``TORCHELASTIC_RUN_ID`` is "none" for every job by default); the
    ranks of several nodes take rank 0's (:class:`RunDirectory`)."""
    return f"{os.getppid()}:{os.environ.get('TORCHELASTIC_RESTART_COUNT', '')}"


class RunDirectory:
    """``with RunDirectory(out, replace=, dist=, name=) as run:`` around building and
    running a trainer in ``out``: made if needed; with ``replace``, a run already there is
    set aside. ``run.built()`` once the trainer is built (it has checked the model, the
    data and the reward functions' signatures); ``run.started()`` once the new run has
    trained its first rollout batch (its reward functions and environment ran on its data:
    ``Trainer.fit(started=run.started)``), which removes the old run.

    A run that stops before it is built, or on :data:`INPUT_ERRORS` before it started (on
    any rank: :data:`UNDONE_MARK`), leaves nothing: the old run is put back as it was
    (said in a note on the exception), a new directory goes; the same command runs once
    the input is fixed (a cold start from its cache). Stopped otherwise (interrupted, out
    of memory, ...) the new run stays to be resumed, the old one goes (interrupted before
    the new run wrote a checkpoint, the old one is put back), and a new directory whose
    run wrote nothing to resume from goes. Rank 0 does it with SIGINT and SIGTERM
    held back (:func:`signals_held`)."""

    def __init__(self, output_dir: Path, *, replace: bool, dist: Distributed, name: str):
        self.output_dir, self.replace, self.dist, self.name = output_dir, replace, dist, name
        self.new = not output_dir.exists()
        self.job = job_id()  # (rank 0's once made: every rank's, on whatever node)
        self.aside: Path | None = None  # the old run, until the new one starts
        self.lock: int | None = None  # the run directory's lock (rank 0), held to the end
        # the old run's lock, kept on it aside: another gspo process sweeping unlocked
        # ``.old`` leftovers beside it (a staged write in the same parent) leaves it be
        self.aside_lock: int | None = None
        self.kept: set[str] = set()  # what the directory held before the run (rank 0)
        self.is_built = self.has_started = False
        # under torchrun, until the run starts: SIGTERM (the launcher's, once another rank
        # failed) raises, so that rank 0 undoes the start; its default action killed it
        # first at times, the old run left hidden where the next staged write swept it
        self.until_started = contextlib.ExitStack()

    def __enter__(self) -> RunDirectory:
        out, dist = self.output_dir, self.dist
        if dist.enabled:
            self.until_started.enter_context(sigterm_raises())
        if dist.is_main and out.is_dir():  # (refused while another process trains it)
            self.lock = self.hold(out)
        # a run's checkpoints, or the metrics of one that never reached a checkpoint (its
        # tensorboard/ events would mix with the new run's); anything else stays beside
        # (rank 0 alone looks and decides, every rank waits for it: a rank looking after
        # the rename skipped the barrier, and the ranks' collectives no longer matched)
        if dist.is_main:  # (an earlier one's, killed: the staged writes' sweep skips them)
            for aside in stranded_asides(out):
                print(
                    f"gspo: warning: {aside} holds the run an earlier --overwrite of {out} set "
                    "aside and never put back (that process was killed before its new run "
                    "started): move it back to keep it, or delete it",
                    file=sys.stderr,
                    flush=True,
                )
        if self.replace and dist.is_main and holds_run(out):
            # (".aside", not ".old": a run killed before it started left the old one where
            # the next staged write beside it swept it as a leftover)
            self.aside = temp_path(out, secrets.token_hex(6), ".aside")
            out.rename(self.aside)
        try:  # (a failure here, before any run: the old one back where it was)
            self.made()
        except BaseException as error:
            if self.aside is not None:
                error.add_note(self.put_back())
            self.release()
            self.until_started.close()
            raise
        return self

    def made(self) -> None:
        """The run directory made (rank 0; every rank waits for its decision) and locked."""
        out = self.output_dir
        if self.dist.enabled:  # (every rank waits for rank 0's decision, and takes its
            # job id for UNDONE_MARK: each node's launcher has a pid of its own)
            self.job = self.dist.gather_objects(self.job)[0]
        if not self.dist.is_main:
            return
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"{self.name} {out}: cannot be made ({exc.strerror or exc})") from exc
        if self.aside is not None:  # (the lock taken on it went with it)
            self.aside_lock, self.lock = self.lock, None
        if self.lock is None:  # the directory the run is in
            self.lock = self.hold(out)
        if self.marked(drop=False) is False:  # another job's (its rank 0 tidied first)
            (out / UNDONE_MARK).unlink(missing_ok=True)
        self.kept = {p.name for p in out.iterdir()}  # (a directory that held no run)

    def marked(self, drop: bool) -> bool | None:
        """Whether another rank of this job left :data:`UNDONE_MARK` (None: there is none;
        False: one of another job's); ``drop`` removes this job's."""
        mark = self.output_dir / UNDONE_MARK
        try:
            ours = mark.read_text() == self.job
        except OSError:
            return None
        if ours and drop:
            mark.unlink(missing_ok=True)
        return ours

    def release(self) -> None:
        if self.lock is not None:
            os.close(self.lock)
            self.lock = None

    def drop_aside(self) -> None:
        """The old run set aside goes (its lock with it)."""
        if self.aside is not None:
            shutil.rmtree(self.aside, ignore_errors=True)
            self.aside = None
        if self.aside_lock is not None:
            os.close(self.aside_lock)
            self.aside_lock = None

    def hold(self, out: Path) -> int | None:
        return hold_lock(out, self.name)

    def put_back(self) -> str:
        """The old run back in the run directory, the failed one's files gone: swapped by
        renames first (a stop during the removal leaves a leftover, not half a run); a
        line saying so, or where the old run is if it could not be put back."""
        out, aside = self.output_dir, self.aside
        assert aside is not None
        failed = temp_path(out, secrets.token_hex(6), ".old")
        try:
            if out.exists():  # (else not made yet)
                out.rename(failed)
            try:
                aside.rename(out)
            except OSError:
                if failed.exists():
                    failed.rename(out)
                raise
        except OSError as exc:
            return (
                f"the run that was in {out} is in {aside} ({exc.strerror or exc} putting it back)"
            )
        self.aside = None
        self.drop_aside()  # (its lock)
        shutil.rmtree(failed, ignore_errors=True)
        return f"the run that was in {out} is back as it was"

    def built(self) -> None:
        self.is_built = True

    def started(self) -> None:
        self.has_started = True
        self.until_started.close()
        self.drop_aside()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, *rest: Any
    ) -> None:
        self.release()
        if error is None:
            self.started()
            return
        out = self.output_dir
        undone = not self.is_built or (not self.has_started and isinstance(error, INPUT_ERRORS))
        if not self.dist.is_main:
            if undone and out.is_dir():  # (rank 0 stops on the broken group, not on this)
                with contextlib.suppress(OSError):
                    (out / UNDONE_MARK).write_text(self.job)
            self.until_started.close()
            return
        # (another rank's input error: this rank's is the broken group)
        if self.marked(drop=True) and not self.has_started:
            if not undone and self.aside is None and self.is_built:
                error.add_note(
                    f"what the run wrote in {out} is removed; the same command runs once "
                    "its input is fixed"
                )
            undone = True
        with signals_held():
            self.tidy(error, undone)
        self.until_started.close()

    def tidy(self, error: BaseException, undone: bool) -> None:
        """The directory after a stop (rank 0): see the class's note."""
        out = self.output_dir
        # (interrupted before the new run wrote a checkpoint, a cold start's progress one
        # included: there is nothing to resume, and the old run went for nothing)
        nothing = isinstance(error, KeyboardInterrupt) and not (out / CHECKPOINTS).exists()
        if self.aside is not None and (undone or nothing):
            error.add_note(self.put_back())  # (put back, or where it is: said in the note)
        elif self.aside is not None:
            self.drop_aside()  # (interrupted, ...: the new run stays, to be resumed)
        elif undone and self.is_built:  # what the run wrote goes (nothing to reuse)
            if self.new:
                shutil.rmtree(out, ignore_errors=True)
            for path in out.iterdir() if out.is_dir() else ():
                if path.name not in self.kept and path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                elif path.name not in self.kept:
                    path.unlink(missing_ok=True)
        elif self.new:
            # nothing to resume from (no metric line, no checkpoint, a cold-start progress
            # checkpoint included): what it holds (a saved built-in, an empty metrics
            # file) is remade by a new start
            metrics = out / METRICS_FILE
            if not (out / CHECKPOINTS).exists() and not (
                metrics.is_file() and metrics.stat().st_size
            ):
                shutil.rmtree(out, ignore_errors=True)
                if self.dist.enabled:  # (the broken group's line offers a resume of it)
                    error.add_note(f"{out} held nothing to resume from: it is removed")


def finished_model_only(out: Path, config: Config) -> list[dict[str, Any]] | None:
    """A run whose last checkpoint holds only the model (``train.save_only_model``) and
    which took its ``train.max_steps``: resumed (the requeued job's ``--auto-resume``), it
    says so, as a finished run does, and its metric records are returned; such a
    checkpoint cannot be resumed from, and there was nothing to resume (exit 2 said it
    could not). None for any other run."""
    checkpoint = latest_checkpoint(out)
    if checkpoint is None or resume_problem(checkpoint) is None:
        return None
    on = f"its checkpoints hold only the model: start {new_run_from(checkpoint)}"
    line = took_its_steps(int(trainer_state(checkpoint)["step"]), config, on)
    if line is None:
        return None
    records = read_metrics(out / METRICS_FILE)
    if not not_rank_zero():  # (RANK=abc, or 3, without torchrun: one process, rank 0)
        print(line, flush=True)
        print_summary(records)
    return records


def auto_resumes(out: Path) -> bool:
    """``--auto-resume`` (``resume="auto"``): whether ``out`` holds a run to continue (a
    checkpoint, whole or not: the resume takes the newest whole one, or says why none
    can be; or a cold start's progress checkpoint), rather than a run to start (no run
    there, or one stopped before its first checkpoint: started over, as with
    ``--overwrite``)."""
    checkpoints = out / CHECKPOINTS
    steps = any(p.is_dir() for p in checkpoints.glob("step-*"))
    return steps or bool(progress_checkpoints(checkpoints))


def holds_run(out: Path) -> bool:
    """Whether ``out`` holds a run: its checkpoints, or the metrics of one that never
    reached a checkpoint."""
    return (out / CHECKPOINTS).exists() or (out / METRICS_FILE).exists()


def not_a_run(out: Path, how: str) -> str | None:
    """Why ``out`` is no run to resume (``how``: ``--resume``), or None. A checkpoint
    directory holds a config.yaml too, but resuming "into" it would start a new run there,
    over the checkpoint: it is said to be one, with its run."""
    if (out / TRAINER_STATE).is_file() and out.parent.name == CHECKPOINTS:
        run = out.parent.parent
        return (
            f"is a checkpoint of the run {run}: {how} takes the run's directory ({run}), "
            "and continues from its newest checkpoint"
        )
    if (out / TRAINER_STATE).is_file():  # a checkpoint copied out of its run
        return (
            f"is a checkpoint ({TRAINER_STATE}), not a run: {how} takes a run's directory; "
            "start a new run from its model with model.path"
        )
    if not (out / "config.yaml").is_file():
        if not out.is_dir():
            return "is a file, not a run's directory" if out.exists() else "does not exist"
        held = sorted(out.glob(f"{CHECKPOINTS}/step-*/{CONFIG}"))
        if held:  # (removed by hand: each checkpoint keeps the one it was trained with)
            return (
                f"has lost its config.yaml; each checkpoint holds a copy: cp {held[-1]} "
                f"{out}/, then {how} again"
            )
        names = [p.name for p in out.iterdir()]
        if not names or any(MARK in n or n in ("base_model", METRICS_FILE) for n in names):
            cli = how.startswith("--")
            anew = "without --resume, with --overwrite" if cli else "with overwrite=True"
            return (
                "holds no config.yaml (a run stopped as it started has none yet: start it "
                f"again {anew})"
            )
        return "is not a gspo run (no config.yaml)"
    return None


def resume_config(output_dir: str | Path, overrides: list[str]) -> Config:
    """The config a run was started with (``config.yaml``), plus overrides; an override
    (or an edit of config.yaml) that would change the model the checkpoints hold (its
    path, architecture, sizes, adapters) is a one-line error, not a config.yaml that
    names another model."""
    config = load_config(Path(output_dir) / "config.yaml", overrides)
    check_same_model(output_dir, config, "--resume", "--output-dir")
    return config


#: What a resumed run keeps: the staleness its batches were sampled at, and the optimizer
#: steps per rollout batch (which rollout batch a step is: another count took rollout
#: batches again, the rollout counter going back).
SAMPLED_AS = ("rollout.max_staleness", "algorithm.minibatches")


def _trained_config(out: Path) -> Path:
    """The config.yaml of the newest checkpoint that holds one, else the run's."""
    held = sorted((out / CHECKPOINTS).glob(f"step-*/{CONFIG}"), reverse=True)
    return held[0] if held else out / "config.yaml"


def relocated(out: Path, was: str | None, now: str | None) -> bool:
    """Whether ``model.path=now`` names where the run's model ``was`` (missing, even where
    it would lie had it moved with the run) was moved to, or a copy of it: a resume may say
    so. The weights must be those its checkpoints recorded (a LoRA adapter's base, a step 0
    naming its model: ``model_fingerprint.json``), else one line; a full fine-tuning run
    whose checkpoints all hold their own weights does not read it (so a copy, ``was``
    still there, is taken only where a record says it is one, and only with every other
    file the same: its tokenizer, chat template and config)."""
    if was is None or now is None or now == was or not Path(now).is_dir():
        return False
    records = sorted((out / CHECKPOINTS).glob(f"step-*/{MODEL_FINGERPRINT}"))
    if Path(was).exists():  # a copy: its weights as recorded, and every other file as it is
        if not records:
            return False
        if differ := _differing_file(Path(was), Path(now)):
            raise ValueError(
                f"model.path={now}: not a copy of the run's model {was} ({differ} differs); "
                "start a new run (--output-dir) to change it"
            )
    for recorded in records:
        change = fingerprint_change(json.loads(recorded.read_text()), model_files(now))
        if change:
            raise ValueError(
                f"model.path={now}: not the model {was} that {recorded.parent} was built on "
                f"({change})"
            )
    return True


def _differing_file(was: Path, now: Path) -> str | None:
    """The first file beside the weights (config, tokenizer, chat template, generation
    settings) that is not the same in the model directories ``was`` and ``now``; the weights
    are the fingerprint's to check."""
    names = sorted({p.name for d in (was, now) for p in d.iterdir() if p.is_file()})
    for name in names:
        if Path(name).suffix in WEIGHT_SUFFIXES:
            continue
        a, b = was / name, now / name
        if not (a.is_file() and b.is_file() and a.read_bytes() == b.read_bytes()):
            return name
    return None


def check_same_model(output_dir: str | Path, config: Config, how: str, other: str) -> None:
    """A resumed run continues the model its checkpoints hold and the schedule it was
    sampled on: ``config`` may not name another model (path, architecture, sizes,
    adapters) nor another :data:`SAMPLED_AS` setting; one line naming the key.

    The settings the checkpoints were trained with are the newest checkpoint's own
    ``config.yaml`` (:data:`gspo.training.checkpoint.CONFIG`; the run's config.yaml for
    checkpoints from before they held one): the run's config.yaml edited by hand since
    is checked as an override is. (Every checkpoint of a run holds the same values of
    these keys.)"""
    out, trained = Path(output_dir), _trained_config(Path(output_dir))
    first = with_absolute_paths(load_config(trained), lambda p: moved_path(p, out, trained))
    config = with_absolute_paths(config, lambda p: moved_path(p, out))  # (as recorded)
    started, now = (flat_settings(c.model.model_dump()) for c in (first, config))
    if relocated(out, started["path"], now["path"]):
        started["path"] = now["path"]  # (its weights: checked against the checkpoints' record)
    for key in started:
        if key not in RESUME_MAY_CHANGE and started[key] != now[key]:
            raise ValueError(
                f"model.{key}={now[key]}: {how} continues the checkpoints' model "
                f"(model.{key}={started[key]}); start a new run ({other}) to change it"
            )
    for key in SAMPLED_AS:  # (a larger staleness also lacks the weights it sampled by)
        section, name = key.split(".")
        was, asked = (getattr(getattr(c, section), name) for c in (first, config))
        if asked != was:
            raise ValueError(
                f"{key}={asked}: {how} continues the run as it was sampled ({key}={was}), "
                f"so that it ends as the uninterrupted run would; start a new run ({other}) "
                "to change it"
            )


def hold_lock(out: Path, name: str, doing: str = "training this run") -> int | None:
    """An exclusive lock on the directory ``out`` (the file descriptor: closing it
    releases it) for as long as this process runs (released at exit, a kill -9 included);
    a second gspo process at work there (a resume while it runs, an overwrite, a second
    ``gspo compare``) is one line. None where the filesystem cannot lock (the work goes
    on unguarded)."""
    try:
        fd = os.open(out, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(
            f"{name} {out}: another gspo process is {doing} (it holds the directory's "
            "lock); wait for it to finish or stop it"
        ) from None
    except OSError:
        os.close(fd)
        return None
    return fd
