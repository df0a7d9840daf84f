"""Rollout batches for the loop: sampled in step (``rollout.max_staleness=0``) or ahead.

The loop asks ``rollouts.experience(index)`` for rollout batch ``index``'s
:class:`Experience`, trains on it, then tells ``rollouts.trained(index)``. By default
(``k = 0``) the rollouts are the :class:`~gspo.training.rollout.RolloutStage` itself,
which samples the batch there and then with the current weights. :class:`AsyncRollouts` (``k =
rollout.max_staleness > 0``) has a producer thread sample batches ahead, on its own copy
of the weights, while the trainer trains:

- **Which weights sample which batch.** Let ``W_j`` be the weights after ``j`` rollout
  batches of updates (``W_0``: the cold-start model, or whatever RL starts from). Batch
  ``b`` is sampled by ``W_max(0, b - k)``, always, however fast either side runs: batch
  ``b + 1`` is sampled while batch ``b`` trains, by the weights batch ``b`` started from
  (``k = 1``). Its staleness, ``b - max(0, b - k) = min(b, k)`` rollout batches of
  updates, is logged as ``rollout/staleness``. A fixed lag rather than "at most k" keeps
  the run a pure function of its seed (timing never decides which weights sampled what).
- **Weight sync between batches only.** After each rollout batch the trainer snapshots
  its weights (a collective under torchrun, so it happens on the main thread, every rank
  at the same point); the producer loads a snapshot into its copy only between batches.
- **pi_old is the behaviour policy.** With ``algorithm.old_logprobs=sampler`` the
  sampler's log-probs are those of the weights that sampled the batch, so GSPO's ratio
  pi_theta / pi_old is exact against the real behaviour policy. With ``recompute`` the
  producer recomputes pi_old with the trainer's forward on *its* copy, the weights that
  sampled the batch (not the trainer's current ones), so the rollout correction sees the
  training/inference mismatch alone, not the staleness.
- **Resume.** Checkpoints hold the snapshots the next ``k`` batches need (``W_s-k ..
  W_s-1`` for a checkpoint at rollout batch ``s``, ``behaviour_weights.pt``); a resumed
  run regenerates the batches that were sampled ahead, with the same weights and seeds.
- **Deterministic.** Every batch's prompts, sampling seed and weights are fixed by
  ``(train.seed, index)``; scoring is serialised with evaluation (:class:`Scorer`'s lock).

Both engines: the torch engine samples the producer's copy itself; a vLLM engine (the
run's own, one per process) is shared with evaluation, which needs the trainer's current
weights in it: whoever generates next loads its weights first if the engine holds other
ones (:class:`StaleSampler`), under the sampler's lock. Under torchrun every rank
runs its own producer over its own share of the prompts. On CUDA the torch engine samples
on a stream of its own; the trainer marks a batch's tensors as in use on its stream when
it takes them (``record_stream``), so their memory is not reused early by the producer.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from gspo.config import Config
from gspo.engines import RolloutBatch, RolloutEngine, SamplingParams, TorchEngine
from gspo.training.policy import Policy, per_minibatch, recomputes_old_logprobs
from gspo.training.rollout import RolloutStage, Sampled
from gspo.training.sampler import PolicySampler, engine_dtype, push_weights
from gspo.training.update import Experience

#: The file in a checkpoint holding the stale weights the next rollout batches need.
BEHAVIOUR_WEIGHTS = "behaviour_weights.pt"

Snapshot = dict[str, torch.Tensor]


class StaleSampler:
    """The producer's sampler: samples ``module``, its own copy of the weights.

    The producer hands it the snapshot a batch is sampled by (:meth:`load`); the next
    :meth:`sync` copies it into ``module``. The torch engine samples ``module`` itself
    (under the policy's autocast). The run's own engine (vLLM, ``shared``: the run's
    sampler) is shared with evaluation, which needs the trainer's weights in it: this
    sampler loads ``module``'s weights into it (:func:`push_weights`) whenever they changed
    or the run's sampler loaded others since (an evaluation), and marks the run's sampler
    as behind, so that the next evaluation reloads the trainer's. Both hold the run's
    sampler's lock from the load through the generation.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        policy: Policy,
        module: torch.nn.Module,
        shared: PolicySampler | None = None,
    ):
        self.engine = engine
        self.policy = policy
        self.module = module
        self.shared = shared
        self.lock = shared.lock if shared is not None else contextlib.nullcontext()
        self.pending: Snapshot | None = None  # weights to copy into `module` at the next sync
        self.current = False  # whether a shared engine holds `module`'s present weights

    def load(self, weights: Snapshot) -> None:
        """Sample with ``weights`` from the next :meth:`sync` on."""
        self.pending = weights

    def sync(self) -> None:
        with self.lock:
            if self.pending is not None:
                params = dict(self.module.named_parameters())
                with torch.no_grad():
                    for name, tensor in self.pending.items():
                        params[name].copy_(tensor)
                self.pending, self.current = None, False
            if self.shared is not None and (not self.current or self.shared.version is not None):
                push_weights(self.engine, self.module)
                self.shared.version = None  # the engine no longer holds the policy's
                self.current = True

    def generate(
        self, prompts: list[list[int]], *, n: int, params: SamplingParams, seed: int
    ) -> RolloutBatch:
        with self.lock:
            self.sync()
            with engine_dtype(self.engine, self.policy):
                return self.engine.generate(prompts, n=n, params=params, seed=seed)


class _Stopped(Exception):
    """The producer was asked to stop."""


class AsyncRollouts:
    """``rollout.max_staleness=k > 0``: a producer thread samples up to ``k`` batches ahead.

    ``checkpoint``: the checkpoint a resumed run starts from (its ``behaviour_weights.pt``
    holds the stale weights the first ``k`` batches after it are sampled by).
    """

    def __init__(
        self,
        config: Config,
        stage: RolloutStage,
        policy: Policy,
        tokenizer,
        checkpoint: Path | None = None,
    ):
        self.k = config.rollout.max_staleness
        self.minibatches = config.algorithm.minibatches
        self.recompute = recomputes_old_logprobs(config, policy.compute_dtype)
        self.stage = stage
        self.policy = policy
        self.checkpoint = checkpoint
        # the producer's own copy of the whole weights (a plain HF module)
        # in eval mode: its pi_old recompute, in a thread of its own, draws no dropout
        # masks from torch's global generator, which the update's forward seeds and uses
        self.module = copy.deepcopy(policy.replica()).requires_grad_(False).eval()
        for p in self.module.parameters():
            p.grad = None
        if config.rollout.engine == "torch":
            engine = TorchEngine(
                self.module,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                cuda_graphs=config.rollout.cuda_graphs,
                compile=config.rollout.compile,
            )
            self.sampler = StaleSampler(engine, policy, self.module)
        else:  # the run's own engine (vLLM), loaded with the producer's weights when needed
            shared = stage.generator.sampler
            assert isinstance(shared, PolicySampler)
            self.sampler = StaleSampler(shared.engine, policy, self.module, shared)
        # which tensors a snapshot holds: the trained ones (a LoRA run's adapters)
        self.names = [n for n, p in policy.module.named_parameters() if p.requires_grad]
        self.weights: dict[int, Snapshot] = {}  # W_j by j, the last k + 1
        self.cond = threading.Condition()
        self.ready: queue.Queue[Sampled | BaseException] = queue.Queue(maxsize=self.k)
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.loaded: int | None = None  # j of the weights in the producer's copy
        # the torch engine's kernels on a stream of their own (vLLM manages its own)
        on_cuda = policy.device.type == "cuda" and config.rollout.engine == "torch"
        self.stream = torch.cuda.Stream(device=policy.device) if on_cuda else None

    # ------------------------------------------------------------------ schedule
    def source(self, index: int) -> int:
        """``j`` of the weights ``W_j`` that sample rollout batch ``index``."""
        return max(0, index - self.k)

    # ------------------------------------------------------------------ main thread
    def snapshot(self) -> Snapshot:
        """The trainer's current weights, copied (a collective under torchrun)."""
        replica = dict(self.policy.replica().named_parameters())
        with torch.no_grad():
            snap = {name: replica[name].detach().clone() for name in self.names}
        if self.stream is not None:  # the copies are done before the producer reads them
            torch.cuda.current_stream(self.policy.device).synchronize()
        return snap

    def publish(self, j: int, weights: Snapshot) -> None:
        with self.cond:
            self.weights[j] = weights
            for old in [i for i in self.weights if i < j - self.k]:
                del self.weights[old]
            self.cond.notify_all()

    @contextlib.contextmanager
    def running(self, first: int, end: int) -> Iterator[None]:
        """The producer, sampling rollout batches ``first .. end - 1``, for the block."""
        if first > 0:
            for j, weights in self.load_behaviour_weights(first).items():
                self.publish(j, weights)
        self.publish(first, self.snapshot())
        self.thread = threading.Thread(
            target=self.produce, args=(first, end), name="gspo rollout producer", daemon=True
        )
        self.thread.start()
        try:
            yield
        finally:
            self.close()

    def experience(self, index: int) -> Experience:
        if self.thread is None:  # (it waited for ever: Trainer.rl_step called alone)
            raise RuntimeError(
                f"rollout.max_staleness={self.k}: rollout batches come from a producer thread "
                "that Trainer.fit runs; call fit(), or rl_step inside "
                "trainer.rollouts.running(first, end)"
            )
        start = time.perf_counter()
        item = self.ready.get()
        wait = time.perf_counter() - start
        if isinstance(item, BaseException):
            raise item
        assert item.index == index, (item.index, index)
        if self.stream is not None:
            # The batch's tensors were allocated on the producer's stream: once the trainer
            # frees them, the allocator must not hand their memory back to the producer
            # before the trainer's stream has finished with them.
            for t in tensors_in(item):
                if t.is_cuda:
                    t.record_stream(torch.cuda.current_stream(t.device))
        experience = self.stage.prepare(item)
        experience.staleness = index - self.source(index)
        experience.metrics["rollout/staleness"] = float(experience.staleness)
        experience.metrics["time/rollout_wait"] = wait
        return experience

    def trained(self, index: int) -> None:
        """Rollout batch ``index`` is trained: its weights are ``W_index+1``."""
        self.publish(index + 1, self.snapshot())

    def checkpoint_files(self) -> dict[str, object]:
        """What a checkpoint taken now needs to resume exactly: ``W_s-k .. W_s-1``."""
        with self.cond:
            if not self.weights:  # before RL (the cold start's checkpoint): none needed
                return {}
            s = max(self.weights)  # the trainer's current weights are W_s
            kept = {j: {n: t.cpu() for n, t in w.items()} for j, w in self.weights.items()}
        needed = {self.source(i) for i in range(s, s + self.k)} - {s}
        return {BEHAVIOUR_WEIGHTS: {"max_staleness": self.k, "weights": {
            j: kept[j] for j in sorted(needed)}}}  # fmt: skip

    def load_behaviour_weights(self, first: int) -> dict[int, Snapshot]:
        """The stale weights rollout batches ``first .. first + k - 1`` need, from the
        checkpoint resumed from; a one-line error if it lacks them."""
        needed = {self.source(i) for i in range(first, first + self.k)} - {first}
        if not needed:
            return {}
        path = None if self.checkpoint is None else self.checkpoint / BEHAVIOUR_WEIGHTS
        if path is None or not path.is_file():
            raise ValueError(
                f"rollout.max_staleness={self.k}: the checkpoint {self.checkpoint} holds no "
                f"{BEHAVIOUR_WEIGHTS} (written with rollout.max_staleness=0?); resume with the "
                "max_staleness it was written with"
            )
        saved = torch.load(path, map_location=self.policy.device, weights_only=True)
        missing = sorted(needed - set(saved["weights"]))
        if missing:
            raise ValueError(
                f"rollout.max_staleness={self.k}: {path} lacks the weights of rollout batch "
                f"{missing[0]} (written with rollout.max_staleness={saved['max_staleness']}); "
                "resume with the max_staleness it was written with"
            )
        return {j: saved["weights"][j] for j in sorted(needed)}

    def close(self) -> None:
        """Stop the producer (it finishes the batch it is sampling) and wait for it."""
        self.stop.set()
        with self.cond:
            self.cond.notify_all()
        while self.thread is not None and self.thread.is_alive():
            with contextlib.suppress(queue.Empty):  # unblock a pending put
                self.ready.get_nowait()
            self.thread.join(timeout=0.05)
        self.thread = None

    # ------------------------------------------------------------------ producer thread
    def produce(self, first: int, end: int) -> None:
        stream = torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext()
        try:
            with stream:
                for index in range(first, end):
                    self.put(self.sample(index))
        except _Stopped:
            return
        except BaseException as exc:  # re-raised by the main thread when it asks
            with contextlib.suppress(_Stopped):
                self.put(exc)

    def sample(self, index: int) -> Sampled:
        j = self.source(index)
        if self.loaded != j:  # copied into the producer's module by the sampler's sync
            self.sampler.load(self.wait_for(j))
            self.loaded = j
        sampled = self.stage.sample(index, self.sampler)
        if self.recompute:  # pi_old: the trainer's forward on the weights that sampled
            start = time.perf_counter()
            batch = sampled.scored.batch
            # on the update's layout, minibatch by minibatch: one forward over the whole
            # batch packs rows otherwise, and in bf16 that alone moved ratios past GSPO's
            # clip range, the on-policy minibatch's included
            rows = self.stage.minibatch_rows(index, len(batch))
            sampled.old_logprobs = per_minibatch(
                lambda part: self.policy.logprobs(part, self.module), batch, rows
            )
            sampled.metrics["time/old_logprobs_producer"] = time.perf_counter() - start
        if self.stream is not None:
            self.stream.synchronize()
        return sampled

    def wait_for(self, j: int) -> Snapshot:
        with self.cond:
            while j not in self.weights:
                if self.stop.is_set():
                    raise _Stopped
                self.cond.wait()
            return self.weights[j]

    def put(self, item: Sampled | BaseException) -> None:
        while True:
            if self.stop.is_set():
                raise _Stopped
            with contextlib.suppress(queue.Full):
                self.ready.put(item, timeout=0.05)
                return


def tensors_in(item: object) -> Iterator[torch.Tensor]:
    """Every tensor inside ``item``: through dataclass fields, dicts, lists and tuples."""
    if isinstance(item, torch.Tensor):
        yield item
    elif dataclasses.is_dataclass(item) and not isinstance(item, type):
        for f in dataclasses.fields(item):
            yield from tensors_in(getattr(item, f.name))
    elif isinstance(item, dict):
        for value in item.values():
            yield from tensors_in(value)
    elif isinstance(item, list | tuple):
        for value in item:
            yield from tensors_in(value)


def build_rollouts(
    config: Config,
    stage: RolloutStage,
    policy: Policy,
    tokenizer,
    checkpoint: Path | None = None,
) -> RolloutStage | AsyncRollouts:
    """``rollout.max_staleness``: 0 the stage itself (each batch sampled when the loop asks
    for it), above it the producer thread."""
    if config.rollout.max_staleness == 0:
        return stage
    return AsyncRollouts(config, stage, policy, tokenizer, checkpoint)
