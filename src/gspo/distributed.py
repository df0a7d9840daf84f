"""Data-parallel runs under ``torchrun``: process group, FSDP2 sharding, reductions (the
shards' checkpoints: :mod:`gspo.sharded`).

One process per device. Each rank samples its share of a rollout batch's prompts with its
own rollout engine, scores them and computes group advantages locally (a group never
spans ranks), and trains on its share; the policy is sharded with FSDP2
(``fully_shard``): parameters, gradients and optimizer state are split across ranks.

Without ``torchrun`` (``WORLD_SIZE`` unset or 1) :class:`Distributed` is the single
process: every function here is then a no-op or the identity and adds no arithmetic to
the single-process path (its metrics were checked bit for bit against the code before it).

Rules that make N ranks equal to one process with the whole batch:

- batch sizes in the config are global (per optimizer step); a rank takes ``1/N`` of the
  prompts of every rollout batch and of every minibatch;
- a loss that is a mean over responses (or tokens) is multiplied by
  :meth:`Distributed.mean_scale` so that FSDP's gradient average over ranks is the
  gradient of the mean over the whole batch;
- metrics are combined with :func:`combine_metrics` (weighted by the token or response
  counts behind them) before rank 0 logs them.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

import torch

Reduction = Literal["sum", "min", "max", "mean"]


@dataclass(frozen=True)
class Distributed:
    """This process's place in the run: ``rank`` of ``world_size`` (1 = no torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0 writes metrics, plots, checkpoints' HF export and the progress bar."""
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            torch.distributed.barrier()

    def gather_objects(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order (``[obj]`` in a single process)."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def mean_scale(self, local_count: float | torch.Tensor) -> float | torch.Tensor:
        """Factor for a rank's mean-over-``local_count`` loss so ranks average to the global mean.

        FSDP averages gradients over ranks, so rank r's loss ``sum_r / n_r`` is multiplied
        by ``N * n_r / n`` (``n`` the count over all ranks): the average of the scaled
        losses is ``sum / n``, the loss of one process holding the whole batch. A rank
        with nothing counted gets 0 (its loss is already 0 and has no gradient). Under
        torchrun a float64 0-dim tensor on the collectives' device, computed there (a count
        on the GPU is not read back: NCCL's sum is queued like any kernel).
        """
        if not self.enabled:
            return 1.0
        local = torch.as_tensor(local_count, dtype=torch.float64).to(self.device()).reshape(1)
        total = local.clone()
        torch.distributed.all_reduce(total)
        return (self.world_size * local / total.clamp(min=1.0)).reshape(())

    def device(self) -> torch.device:
        """The device collectives run on (CUDA under NCCL, CPU under gloo)."""
        if torch.distributed.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def shard(self, sizes: int, what: str) -> int:
        """This rank's share of a global batch size; a one-line error if it does not divide."""
        if sizes % self.world_size:
            raise ValueError(
                f"{what}={sizes} is not divisible by the {self.world_size} ranks "
                "(torchrun's --nnodes times --nproc-per-node): batch sizes are global, split evenly"
            )
        return sizes // self.world_size

    def part_shares(self, local: int, parts: int) -> list[tuple[int, int]]:
        """``(start, end)`` of this rank's rows in each of ``parts`` parts of a batch of
        which every rank holds ``local`` rows: the parts are those one process splits the
        whole batch into (``tensor_split``'s sizes), over the ranks' rows interleaved (row
        ``i`` of rank ``r`` is row ``i * world_size + r`` of the whole), so each part's
        size is the one-process size whether or not ``local`` divides by ``parts``.
        In one process: ``tensor_split``'s own bounds."""
        whole, world = local * self.world_size, self.world_size
        size, extra = divmod(whole, parts)
        bounds = [k * size + min(k, extra) for k in range(parts + 1)]
        mine = [max(0, -(-(b - self.rank) // world)) for b in bounds]  # ceil((b - rank) / W)
        return list(itertools.pairwise(mine))


def rank_said() -> str:
    """``" (rank R of N)"`` under torchrun, ``""`` in one process: a warning about what one
    rank saw in its own share of a batch, which the other ranks may not have seen."""
    return f" (rank {os.environ.get('RANK', '0')} of {world_size()})" if several_ranks() else ""


def world_size() -> int:
    """``WORLD_SIZE``, the number of processes torchrun started (1 when unset): the one
    place it is read. A value that is no whole number of at least 1 (``WORLD_SIZE=x``, set
    by hand) is a ValueError naming it (it was a traceback of ``int()``)."""
    text = os.environ.get("WORLD_SIZE")
    if text is None:
        return 1
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(
            f"WORLD_SIZE is {text!r}, not a number of processes (a whole number, at least 1): "
            "a run of several processes is started by torchrun (torchrun --nproc-per-node N "
            "-m gspo train ...), which sets it; unset WORLD_SIZE for one"
        )
    return int(text)


def several_ranks() -> bool:
    """Whether this process is one of several torchrun ranks; a ``WORLD_SIZE`` that
    :func:`world_size` refuses counts as one process here (this is asked while an error,
    that one included, is being said)."""
    try:
        return world_size() > 1
    except ValueError:
        return False


def not_rank_zero() -> bool:
    """Whether this process is a torchrun rank other than 0."""
    return several_ranks() and os.environ.get("RANK", "0") != "0"


def leads_another_node() -> bool:
    """Whether this process is the first rank (``LOCAL_RANK`` 0) of a node other than rank
    0's (torchrun's ``GROUP_RANK``, the node's, above 0): that node's log is its own, and
    rank 0's launcher, elsewhere, cannot stop it before it has said its setup error."""
    node = os.environ.get("GROUP_RANK", "0")
    return not_rank_zero() and os.environ.get("LOCAL_RANK") == "0" and node not in ("", "0")


class SaidByRankZero(Exception):
    """An error on a torchrun rank other than 0 that rank 0 says (a setup error, the same
    on every rank; rank 0's own, which it alone met): its ``__cause__`` is the error."""


@contextlib.contextmanager
def said_once() -> Iterator[None]:
    """Bad input found while setting up (config, model, data, rewards) is the same on every
    torchrun rank: only rank 0 prints its line (and the first rank of another node, in its
    own log), the others leave quietly with status 2; each posts its error, which rank 0
    says where it had none (a node's own files). (Errors once training runs may be one
    rank's own: every rank says those.)"""
    try:
        yield
    except (ValueError, FileNotFoundError) as exc:
        if not_rank_zero():  # (a RANK without WORLD_SIZE > 1 is no torchrun rank)
            post_setup_error(str(exc))  # (this rank's own, its files: rank 0 says it)
            raise SaidByRankZero from exc
        # rank 0 says it for every rank: its line names no rank
        exc.for_every_rank = True  # type: ignore[attr-defined]
        raise


class Terminated(KeyboardInterrupt):
    """SIGTERM, what a scheduler (SLURM, Kubernetes, ``kill``) stops a job with: raised in
    the main thread, so the run stops as on Ctrl-C, saying how to resume (it ended at
    once with status 143 and no word)."""


def _terminated(signum: int, frame: object) -> NoReturn:
    raise Terminated


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Inside the block, SIGTERM raises :class:`Terminated` in the main thread (a handler
    can be set nowhere else; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


@contextlib.contextmanager
def sigterm_stops_as_ctrl_c() -> Iterator[None]:
    """Inside the block, SIGTERM raises :class:`Terminated` (in the main thread only: a
    handler can be set nowhere else). Not under torchrun: a rank waiting in a collective
    would outlive it, and the launcher stops its ranks itself (but see ``RunDirectory``)."""
    if several_ranks():
        yield
        return
    with sigterm_raises():
        yield


def peer_gone(exc: BaseException) -> bool:
    """Whether ``exc`` is a torchrun collective failing because another rank left (gloo's
    broken connections, torch's ``DistError``s): that rank says its own error."""
    if not several_ranks():
        return False
    dist = sys.modules.get("torch.distributed")
    if dist is not None and isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return "gloo" in text or "Connection reset by peer" in text or "Connection closed" in text


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM ignored while a stopped run's directory is put in order, so that
    a stop arriving meanwhile (torchrun's SIGTERM to the other ranks once one has failed)
    cannot cut a put-back or a removal in half: the process is on its way out with its own
    error already. (Handlers are the process's, whichever thread a signal reaches: a
    thread's signal mask held back nothing in a process with threads, as every rank is.)
    Only the main thread can set them; elsewhere nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stops = (signal.SIGINT, signal.SIGTERM)
    previous = {stop: signal.signal(stop, signal.SIG_IGN) for stop in stops}
    try:
        yield
    finally:
        for stop, handler in previous.items():
            signal.signal(stop, signal.SIG_DFL if handler is None else handler)


def setup_distributed(
    device: str = "auto", run_dir: str | os.PathLike | None = None
) -> Distributed:
    """Join the ``torchrun`` process group if there is one.

    ``WORLD_SIZE``/``RANK``/``LOCAL_RANK`` come from ``torchrun``. On CUDA each rank takes
    GPU ``LOCAL_RANK`` and the backend is NCCL; on CPU it is gloo. A single process
    (``WORLD_SIZE`` unset or 1) starts no process group. ``run_dir``: the run this rank
    trains, named by its line should its launcher go (:func:`watch_launcher`).
    """
    world = world_size()
    if world <= 1:
        return Distributed()
    dist = Distributed(
        rank=_launcher_number("RANK", None, world),
        world_size=world,
        local_rank=_launcher_number("LOCAL_RANK", "0"),
    )
    resolved = rank_device(device, dist)
    if resolved.type == "cuda":
        torch.cuda.set_device(resolved)
    if not torch.distributed.is_initialized():
        # (a rank whose others never come waited gloo's 30 minutes without a word)
        joined = threading.Event()
        waiting = threading.Thread(target=_wait_for_joins, args=(dist, joined), daemon=True)
        waiting.start()
        try:
            torch.distributed.init_process_group("nccl" if resolved.type == "cuda" else "gloo")
        finally:
            joined.set()
    watch_launcher(dist, run_dir)
    return dist


#: Seconds a rank waits for the others to join before it says so (once).
JOIN_SAY_S = 30.0
#: How often a rank waiting for the others to join looks for a setup error one posted.
JOIN_POLL_S = 0.5


def _wait_for_joins(dist: Distributed, joined: threading.Event) -> None:
    """While this rank joins the process group: say so once after :data:`JOIN_SAY_S`, and
    end the process with status 2 once another rank posted a setup error (it will never
    join: rank 0 waited for it until gloo's 30 minutes ran out), rank 0 saying it."""
    start, said, store = time.monotonic(), False, None
    while not joined.wait(
        JOIN_POLL_S if said else min(JOIN_POLL_S, max(0.0, start + JOIN_SAY_S - time.monotonic()))
    ):
        if not said and time.monotonic() - start >= JOIN_SAY_S:
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            print(f"gspo: rank {dist.rank} of {dist.world_size}: still waiting at {where} for "
                  "the other ranks to join (started by torchrun, each with its RANK?)",
                  file=sys.stderr, flush=True)  # fmt: skip
            said = True
        store = store or _launcher_store()
        posted = posted_setup_error(store)
        if posted is not None and not joined.is_set():
            if dist.is_main:
                print(f"gspo: error: {posted}", file=sys.stderr, flush=True)
            os._exit(2)


def _launcher_store() -> Any | None:
    """A client of torchrun's own store (``MASTER_ADDR:MASTER_PORT``, its agent's, there
    before any rank starts: ``TORCHELASTIC_USE_AGENT_STORE``), or None (no torchrun, or
    a launcher that leaves the store to rank 0: it is not there before rank 0 joins)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from datetime import timedelta

    try:
        return torch.distributed.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
            timeout=timedelta(seconds=5),
        )  # fmt: skip
    except (KeyError, ValueError, RuntimeError):  # (DistError is a RuntimeError)
        return None


def _setup_error_key() -> str:
    return f"gspo/setup_error/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def post_setup_error(error: str) -> None:
    """A setup error of this rank (not 0), where rank 0 finds it in torchrun's store: one
    that is this rank's alone (a node whose --output-dir is not the others', or misses a
    checkpoint) was said nowhere (this rank waits for rank 0 to say it, and its launcher
    stopped it first) or rank 0 waited 30 minutes for it to join."""
    store = _launcher_store()
    with contextlib.suppress(RuntimeError):
        if store is not None:
            store.set(_setup_error_key(), f"rank {os.environ.get('RANK')} of {world_size()} "
                      f"stopped setting up: {error}")  # fmt: skip


def posted_setup_error(store: Any | None = None) -> str | None:
    """The setup error another rank posted (:func:`post_setup_error`), else None."""
    store = store or _launcher_store()
    if store is None:
        return None
    with contextlib.suppress(RuntimeError):
        if store.check([_setup_error_key()]):
            return store.get(_setup_error_key()).decode(errors="replace")
    return None


def _launcher_number(name: str, default: str | None, below: int | None = None) -> int:
    """The launcher's ``name`` (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``): a whole number
    (below ``below``); else one line saying what sets it (a traceback, KeyError: 'RANK',
    where WORLD_SIZE was set by hand)."""
    text = os.environ.get(name, default)
    if text is None or not text.strip().isdigit() or (below is not None and int(text) >= below):
        got = "unset" if text is None else f"{text!r}"
        raise ValueError(
            f"{name} is {got} beside WORLD_SIZE={os.environ.get('WORLD_SIZE')}: a run of "
            "several processes is started by torchrun (torchrun --nproc-per-node N -m gspo "
            "train ...), which sets WORLD_SIZE, RANK and LOCAL_RANK; unset WORLD_SIZE for one"
        )
    return int(text)


#: how often a rank looks whether its launcher is still there (seconds)
LAUNCHER_POLL_S = 1.0

#: which of this process's two enders said its line (:func:`last_words`)
_ENDING: dict[str, Any] = {"watch": False, "collective": False, "lock": threading.Lock()}

#: the run the launcher watch names in its line (the last :func:`watch_launcher` call's)
_WATCHED: dict[str, str | None] = {"run": None}


#: How long a rank other than 0 whose collective another rank broke waits before it says
#: so: the rank that stopped says why first (rank 0's setup error came second).
PEER_LINE_AFTER_S = 1.0


def last_words(line: str, by: Literal["watch", "collective"]) -> bool:
    """Print ``line`` to stderr as this rank's last, unless the other ender said its own:
    the launcher watch's thread and the main thread's broken collective can each end a
    rank at once (the other rank left first), and a rank says one line. Whether it
    printed. (Each ender may say its line again: ``gspo.cli.main`` called in one process
    again, as tests do.) The line is printed holding the lock: the watch, finding the
    collective's line claimed, ends the process at once, and ended it before the line was
    out (a test saw one rank's line of two)."""
    other = "collective" if by == "watch" else "watch"
    with _ENDING["lock"]:
        if _ENDING[other]:
            return False
        _ENDING[by] = True
        print(line, file=sys.stderr, flush=True)
    return True


def watch_launcher(dist: Distributed, run_dir: str | os.PathLike | None = None) -> None:
    """Stop this rank once the process that started it (torchrun) is gone.

    A torchrun launcher killed with SIGKILL cannot stop its ranks: they trained on to the
    end as orphans, holding the run's lock, so ``--resume`` was refused meanwhile. A
    daemon thread sees the parent change (the rank was adopted) and ends the process with
    one line, as a kill would: checkpoints are never half-written. Its line names
    ``run_dir`` in the ``--resume`` to run (it named none: on a node of several, which
    run?). Started once a process; a later call changes the run it names.
    """
    _WATCHED["run"] = None if run_dir is None else os.fspath(run_dir)
    parent = os.getppid()
    name = "gspo-launcher-watch"
    if parent == 1 or any(t.name == name for t in threading.enumerate()):
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(LAUNCHER_POLL_S)
        run = _WATCHED["run"]
        resume = "gspo train --resume" + ("" if run is None else f" {shlex.quote(run)}")
        last_words(
            f"gspo: error{rank_said()}: the launcher (pid {parent}) is gone, so this "
            f"rank stops; checkpoints already written are intact, and {resume} "
            "continues from the last",
            by="watch",
        )
        os._exit(1)

    threading.Thread(target=watch, name=name, daemon=True).start()


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ValueError(f"model.device={device}: not a torch device (cpu, cuda, cuda:1)") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"model.device={device}: this torch has no usable CUDA device")
    return resolved


def rank_device(device: str, dist: Distributed) -> torch.device:
    """``model.device`` for this rank: under torchrun, CUDA means GPU ``LOCAL_RANK``."""
    resolved = resolve_device(device)
    if dist.enabled and resolved.type == "cuda" and resolved.index is None:
        return torch.device("cuda", dist.local_rank)
    return resolved


def teardown_distributed(dist: Distributed) -> None:
    """Leave the process group :func:`setup_distributed` joined, if it joined one (and
    nobody destroyed it yet). A single process leaves alone any group another library
    made for itself: vLLM starts one of its own and tears it down at exit."""
    if dist.enabled and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a HF model (its ``_no_split_modules`` classes).

    These are the FSDP units: each block's parameters are gathered just before it runs
    and freed after, so at most one block is whole at a time.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(
            f"cannot shard {type(model).__name__}: it names no transformer block classes "
            "(_no_split_modules)"
        )
    return blocks


def shard_policy(root: torch.nn.Module, model: torch.nn.Module, world_size: int) -> None:
    """FSDP2: every transformer block of ``model`` its own unit, the rest under ``root``.

    ``root`` is the module whose ``forward`` the trainer calls (it holds ``model``), so
    FSDP's root hooks gather the embeddings, final norm and LM head around every forward
    and reduce-scatter their gradients in backward.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device_type = next(model.parameters()).device.type
    mesh = init_device_mesh(device_type, (world_size,))
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(root, mesh=mesh)


def full_state_dict(
    model: torch.nn.Module, dist: Distributed, *, trainable_only: bool = False
) -> dict[str, torch.Tensor]:
    """The whole (unsharded) weights of ``model`` on every rank: a collective under FSDP.

    ``trainable_only``: only the parameters that train (a LoRA run's adapters).
    """
    if not dist.enabled:
        state = model.state_dict()
    else:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, ignore_frozen_params=trainable_only)
        state = get_model_state_dict(model, options=options)
    if trainable_only:
        # (DCP keeps a frozen weight tied to another name, e.g. lm_head to the embeddings)
        trained = {name for name, p in model.named_parameters() if p.requires_grad}
        state = {k: v for k, v in state.items() if k in trained}
    return state


def whole(value: torch.Tensor) -> torch.Tensor:
    """A tensor whole: a DTensor under FSDP (e.g. a gradient norm) gathered, any other as
    it is."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


# ---------------------------------------------------------------- metrics across ranks
def combine_metrics(
    per_rank: Sequence[Mapping[str, float]],
    rule: Callable[[str], tuple[Reduction, str | None]],
) -> dict[str, float]:
    """One metrics dict from every rank's, each key combined by ``rule(key)``.

    ``rule`` returns ``(reduction, weight_key)``: ``"sum"``, ``"min"``, ``"max"``, or
    ``"mean"`` weighted by the value of ``weight_key`` on each rank (``None``: equal
    weights). A rank missing a key, or whose value is NaN with weight 0, is left out of it;
    a key whose every weight is 0 keeps its plain mean (NaN stays NaN). Weights are read
    before anything is combined, so a weight key may itself be summed.
    A key every rank logs as an integer stays one where the result is whole (a step or
    minibatch index reads as in one process).
    """
    keys = list(dict.fromkeys(k for metrics in per_rank for k in metrics))
    out: dict[str, float] = {}
    for key in keys:
        how, weight_key = rule(key)
        present = [m for m in per_rank if key in m]
        values = [float(m[key]) for m in present]
        if how == "sum":
            out[key] = math.fsum(values)
        elif how in ("min", "max"):
            # a rank with nothing to measure reports NaN: it has no say in the extreme
            finite = [v for v in values if not math.isnan(v)] or values
            out[key] = min(finite) if how == "min" else max(finite)
        else:
            weights = [float(m.get(weight_key, 0.0)) if weight_key else 1.0 for m in present]
            pairs = [(v, w) for v, w in zip(values, weights, strict=True) if w > 0]
            total = math.fsum(w for _, w in pairs)
            if total > 0:
                out[key] = math.fsum(v * w for v, w in pairs) / total
            else:
                out[key] = math.fsum(values) / len(values)
        counts = all(isinstance(m[key], int) and not isinstance(m[key], bool) for m in present)
        if counts and float(out[key]).is_integer():  # (train/minibatch 0, not 0.0)
            out[key] = int(out[key])
    return out
