"""Cold start: supervised fine-tuning on ``prompt`` -> ``completion`` rows before RL.

A cold start survives being killed and is not redone:

* every ``train.cold_start_save_every`` steps it writes its progress to
  ``checkpoints/cold-start-NNNNNNN`` (model, its own AdamW, the step, the metric lines so
  far; written atomically). A resumed run continues from the newest one: the row sampler
  is replayed to that step, so the result equals an uninterrupted cold start's.
* when it finishes, the model is kept in a cache (``train.cold_start_cache_dir``, by
  default ``$XDG_CACHE_HOME/gspo/cold-start``) under a content hash of everything that
  decides it (:func:`cold_start_key`); a later run with the same hash loads it instead of
  training (``train.cold_start_cache=false`` or ``--no-cache`` to skip the cache). The
  cache holds at most ``train.cold_start_cache_max_gb``: the least recently used entries
  go first (:func:`trim_cache`), since every change of gspo's code or settings makes a new
  key and the old entries would otherwise stay forever.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import math
import os
import random
import re
import secrets
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import gspo
from gspo.chat import encode_prompt, turn_end
from gspo.config import Config
from gspo.distributed import Distributed, whole
from gspo.engines import pad_batch
from gspo.models import model_context, model_files
from gspo.models.kernels import onednn_available, resolved_kernel
from gspo.objectives import read_scalars
from gspo.plugins import PYTHON_OBJECT, is_file_source, object_spec
from gspo.publish import (
    MANIFEST,
    manifest_changes,
    remove_leftovers,
    staged,
    temp_path,
    tree_bytes,
    write_manifest,
)
from gspo.sharded import load_sharded, save_sharded, sharded_problem
from gspo.telemetry import MetricsLogger
from gspo.training.cold_start_checks import (
    PROGRESS_PREFIX,
    STATE,
    cache_dir,
    progress_checkpoints,
    progress_settings,
)
from gspo.training.metrics import combine
from gspo.training.policy import Policy, loss_scaler
from gspo.training.sampler import MODEL_CONTEXT, said_context
from gspo.training.seeds import rank_seed
from gspo.training.setup import adamw
from gspo.training.time_limit import COLD_START_EVERY, TimeLimit
from gspo.training.update import NonFiniteTraining, step_if_finite

_LINES = "sft_metrics.jsonl"
_MODEL = "sharded"
_ENTRY = "entry.json"  # a cache entry's own record: its key
_INLINE_BYTES = 64 << 20
Encoded = tuple[list[int], list[int], list[bool]]  # a row: prompt, completion, loss mask


def _hash_dir(path: Path, h: Any) -> None:
    """Files of a model directory into ``h``: contents, or size+mtime for big weight files."""
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        stat = f.stat()
        h.update(str(f.relative_to(path)).encode())
        if stat.st_size <= _INLINE_BYTES:
            h.update(f.read_bytes())
        else:
            h.update(f"{stat.st_size}:{stat.st_mtime_ns}".encode())


def environment_key(environment: Any) -> str | None:
    """``rollout.environment`` in a cache key: its spec (a class given as a Python object:
    the spec that loads it) and a digest of the file that defines it (its tools' names,
    docstrings and types enter the SFT prompts: an edited file reused the old cold start),
    or for a class no spec loads its name and source (two classes of one name in two
    scripts differ)."""
    if environment is None:
        return None
    spec = environment if isinstance(environment, str) else object_spec(environment)
    if not spec.startswith(PYTHON_OBJECT):
        files = _spec_files(spec)
        return f"{spec} {_file_digest(*files)}" if files else spec
    try:
        source = inspect.getsource(environment)
    except (OSError, TypeError):
        source = ""
    return f"{spec} {hashlib.sha256(source.encode()).hexdigest()}"


def _spec_files(spec: str) -> list[Path]:
    """The files a ``source:Name`` spec's object comes from: a ``.py`` path; or a module's
    file and the one that defines the object, where the module imports it (a package's
    ``__init__.py`` re-exporting a class of one of its modules)."""
    import importlib
    import importlib.util

    source, _, name = (part.strip() for part in spec.rpartition(":"))
    if is_file_source(source):
        path = Path(source).expanduser()
        return [path] if path.is_file() else []
    try:
        found = importlib.util.find_spec(source)
    except (ImportError, ValueError):
        return []
    files: list[str | None] = [found.origin if found is not None else None]
    try:
        obj: Any = importlib.import_module(source)
        for part in name.split("."):
            obj = getattr(obj, part)
        files.append(inspect.getsourcefile(obj))
    except Exception:  # (not importable, no such name, no source file: the module's alone)
        pass
    return list(dict.fromkeys(Path(f) for f in files if f and Path(f).is_file()))


def _file_digest(*paths: Path) -> str:
    h = hashlib.sha256(paths[0].read_bytes())
    for path in paths[1:]:
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cold_start_key(config: Config, rows: list[dict[str, Any]], dist: Distributed) -> str:
    """Content hash of what decides a cold start's result.

    The model and data settings (and a user model's files), the SFT rows, the ``train.cold_start_*``
    settings, the seed, the sampling temperature (log-probs are taken at it), the number of
    ranks (each draws its own rows), and the code: gspo's source, torch and transformers
    versions, and which kernels this CPU takes. Anything else (RL settings, logging,
    checkpoints) does not enter it.
    """
    import transformers

    t = config.train
    h = hashlib.sha256()
    settings = {
        # (activation checkpointing recomputes the same sums: the same result either way)
        "model": config.model.model_dump(mode="json", exclude={"activation_checkpointing"}),
        "data": config.data.model_dump(mode="json"),  # templates and chat settings too
        "train": [t.seed, t.cold_start_steps, t.cold_start_lr, t.cold_start_batch_size],
        "temperature": config.rollout.temperature,
        "environment": environment_key(config.environment),  # its tools enter the prompts
        "world_size": dist.world_size,
        "versions": [torch.__version__, transformers.__version__],
        # the kernels the CPU takes (oneDNN's linear layers or MKL's, AVX2 or AVX-512)
        # round differently
        "cpu": [
            torch.backends.cpu.get_cpu_capability(),
            onednn_available(),
            resolved_kernel(config.model.cpu_linear),  # (auto: by the CPU's vendor)
        ],
    }
    h.update(json.dumps(settings, sort_keys=True).encode())
    h.update(json.dumps(rows, sort_keys=True, default=str).encode())
    if config.model.path is not None:
        _hash_dir(model_files(config.model.path), h)  # a step 0 naming its model: that one
    for source in sorted(Path(gspo.__file__).parent.rglob("*.py")):
        h.update(source.read_bytes())
    return h.hexdigest()[:32]


#: A cache entry's name: its key (:func:`cold_start_key`); earlier gspo versions' temporary
#: names of one (``.<key>.tmp``, ``.<key>.<pid>.tmp``, ``.<key>.sharded.tmp``).
_KEY = re.compile(r"[0-9a-f]{32}")
_OLD_TEMP = re.compile(r"\.[0-9a-f]{32}(\.[0-9]+|\.sharded)?\.tmp")
_OLD_TEMP_GRACE_S = 600.0  # younger than this, an old-style temporary may be in use


def _last_used(entry: Path) -> float:
    """When ``entry`` was last made or reused: its record's mtime (:func:`_touch`)."""
    try:
        return (entry / _ENTRY).stat().st_mtime
    except OSError:
        return entry.stat().st_mtime


def _touch(entry: Path) -> None:
    """Mark ``entry`` as just used (the cache trims the least recently used first)."""
    with contextlib.suppress(OSError):  # a read-only cache is still read
        os.utime(entry / _ENTRY)


def trim_cache(root: Path, keep: Path, max_bytes: float) -> tuple[int, int]:
    """Remove the least recently used entries of the cache ``root`` until the rest hold at
    most ``max_bytes`` (``keep``, the entry in use, is never removed), and the temporary
    directories nobody writes any more; how many entries and bytes went.

    An entry is moved aside first (``.old``: a reader never sees half of one, and a kill
    midway leaves a leftover that the next write clears).
    """
    remove_leftovers(keep)  # gspo's own unlocked temporaries, any key
    now = time.time()
    removed, freed = 0, 0
    for path in root.iterdir():
        if _OLD_TEMP.fullmatch(path.name) and now - path.stat().st_mtime > _OLD_TEMP_GRACE_S:
            freed += tree_bytes(path)
            shutil.rmtree(path, ignore_errors=True)
    entries = [p for p in root.iterdir() if _KEY.fullmatch(p.name) and p.is_dir()]
    entries.sort(key=lambda p: (p != keep, -_last_used(p)))  # keep first, then newest
    total = 0
    for entry in entries:
        size = tree_bytes(entry)
        total += size
        if entry == keep or total <= max_bytes:
            continue
        aside = temp_path(entry, secrets.token_hex(6), ".old")
        try:
            entry.rename(aside)
        except OSError:  # gone already, or not ours to move
            continue
        shutil.rmtree(aside, ignore_errors=True)
        total -= size
        removed, freed = removed + 1, freed + size
    return removed, freed


def _trimmed(config: Config, entry: Path, dist: Distributed) -> None:
    """``entry`` marked as used and the cache trimmed to ``train.cold_start_cache_max_gb``
    (rank 0; a cache it cannot trim is left as it is), said in one line when it removed any."""
    limit = config.train.cold_start_cache_max_gb
    if not dist.is_main or not entry.is_dir():
        return
    _touch(entry)
    if limit is None:
        return
    try:
        removed, freed = trim_cache(entry.parent, entry, limit * 1e9)
    except OSError:
        return
    if removed:
        print(f"cold start: cache over train.cold_start_cache_max_gb={limit:g}: removed "
              f"{removed} least recently used entries ({freed / 1e9:.2f} GB) from "
              f"{entry.parent}", flush=True)  # fmt: skip


def _save_progress(
    checkpoints: Path,
    step: int,
    policy: Policy,
    optimizer,
    lines: list[dict],
    dist: Distributed,
    extra: dict[str, Any],
) -> None:
    with staged(checkpoints / f"{PROGRESS_PREFIX}{step:07d}", dist) as tmp:
        save_sharded(tmp / _MODEL, policy.forward, optimizer)
        if dist.is_main:  # (extra: the loss scaler's state, the skipped steps' counts)
            torch.save({"step": step, "lines": lines, **extra}, tmp / STATE)
    if dist.is_main:
        for older in progress_checkpoints(checkpoints)[:-1]:
            shutil.rmtree(older)
    dist.barrier()


def _entry_problem(
    entry: Path, model: torch.nn.Module | None, *, contents: bool = False
) -> str | None:
    """Why the cache entry ``entry`` cannot be trusted, or None when it is whole.

    Its own record must name its key (the directory's name), its metric lines must read,
    its sharded checkpoint must hold every file its metadata names, and every tensor of
    ``model`` (if given) at its shape, and every file must be at the size its manifest
    records and, with ``contents``, hold the bytes it records (CRC-32s: a flipped byte).
    """
    try:
        made = json.loads((entry / _ENTRY).read_text())
        [json.loads(line) for line in (entry / _LINES).read_text().splitlines()]
    except FileNotFoundError as exc:
        return f"{Path(exc.filename).name} is missing"
    except (OSError, ValueError) as exc:
        return f"unreadable ({exc})"
    if not isinstance(made, dict) or made.get("key") != entry.name:
        return f"{_ENTRY} names another key"
    if not (entry / MANIFEST).is_file():  # an entry written before entries had one:
        return "missing"  # trained again and replaced, quietly, as a missing entry is
    problem = sharded_problem(entry / _MODEL, model)
    wrong = next(manifest_changes(entry, contents=contents), None)
    return problem or (None if wrong is None else " ".join(wrong))


def _store_in_cache(entry: Path, policy: Policy, lines: list[dict], dist: Distributed) -> None:
    def whole(existing: Path) -> bool:  # an identical run published first: keep its entry
        # (rank 0 alone: no model state; its bytes too, or a flipped byte stayed for good)
        return _entry_problem(existing, None, contents=True) is None

    try:
        with staged(entry, dist, keep=whole) as tmp:
            save_sharded(tmp / _MODEL, policy.forward, None)
            if dist.is_main:
                (tmp / _LINES).write_text("".join(json.dumps(line) + "\n" for line in lines))
                (tmp / _ENTRY).write_text(json.dumps({"key": entry.name, "ranks": dist.world_size}))
                write_manifest(tmp)  # (last: every rank's shards are written, dcp.save waits)
    except OSError as exc:  # a read-only or full cache never stops a run
        if dist.is_main:
            print(f"cold start: not cached ({entry.parent}: {exc.strerror or exc})", flush=True)
    dist.barrier()


def reusable_entry(
    config: Config, rows: list[dict[str, Any]], policy: Policy, dist: Distributed
) -> Path | None:
    """The whole cache entry :func:`cold_start` will take this run's cold start from (its
    lines' ``time/sft`` then the run's that trained it), else None; asked before it runs
    (a run's metrics are the same whether the cache gave its cold start or not)."""
    root = cache_dir(config)
    if root is None or config.train.cold_start_steps == 0 or not rows:
        return None
    entry = root / cold_start_key(config, rows, dist)
    whole = entry.exists() and _entry_problem(entry, policy.forward, contents=True) is None
    return entry if whole else None


def _cached(entry: Path | None, policy: Policy, dist: Distributed) -> bool:
    """Whether every rank sees a whole cache entry; a damaged one is said once and redone."""
    if entry is None:
        return False
    # (rank 0 reads the bytes, every rank the sizes and its shapes)
    found = entry.exists()
    problem = _entry_problem(entry, policy.forward, contents=dist.is_main) if found else "missing"
    problems = dist.gather_objects(problem)
    damaged = next((p for p in problems if p not in (None, "missing")), None)
    if damaged is not None and dist.is_main:
        print(f"cold start: ignoring the damaged cache entry {entry} ({damaged}); "
              "training it again", flush=True)  # fmt: skip
    return not any(problems)


def cold_start(
    config: Config,
    policy: Policy,
    tokenizer,
    rows: list[dict[str, Any]],
    logger: MetricsLogger,
    dist: Distributed,
    *,
    local_batch: int,
    checkpoints: Path,
    encode: Callable[[dict[str, Any]], Encoded] | None = None,
    time_limit: TimeLimit | None = None,
) -> bool:
    """``train.cold_start_steps`` SFT steps of ``train.cold_start_batch_size`` rows each
    (``local_batch`` of them on this rank), resumed from ``checkpoints`` or the cache.

    AdamW of its own (``train.cold_start_lr``, cosine decay to 10%), completions end with
    EOS, the loss is the mean token NLL of the completions. Logged at step 0 as ``sft/*``
    every 100 steps. Whether it changed the model (False: no steps, or no rows). Where
    ``time_limit`` is reached it writes its progress and returns (``time_limit.stopped``).
    """
    cfg = config.train
    if cfg.cold_start_steps == 0 or not rows:
        return False
    show = config.log.progress and dist.is_main
    root = cache_dir(config)
    entry = None if root is None else root / cold_start_key(config, rows, dist)
    if _cached(entry, policy, dist):
        assert entry is not None
        load_sharded(entry / _MODEL, policy.forward, None)
        policy.stepped()
        for line in (entry / _LINES).read_text().splitlines():  # (time/sft: the original's)
            logger.log(0, json.loads(line))
        if show:
            print(
                f"cold start: reused {entry} (--no-cache redoes it; from Python, "
                "train.cold_start_cache=false)",
                flush=True,
            )
        _trimmed(config, entry, dist)
        return True

    rng = random.Random(rank_seed(cfg.seed, dist, "sft"))
    optimizer = adamw(policy.forward, lr=cfg.cold_start_lr, betas=(0.9, 0.99))
    scaler = loss_scaler(policy)  # float16 only
    pad = tokenizer.pad_token_id
    encoded = encode_rows(rows, encode or single_turn_encoder(config, tokenizer), config)
    encoded = within_context(encoded, model_context(policy.module)[0], config, dist)
    first, lines, counts = 0, [], [0.0, 0.0]
    saved = progress_checkpoints(checkpoints)
    if saved:
        load_sharded(saved[-1] / _MODEL, policy.forward, optimizer)
        policy.stepped()
        state = torch.load(saved[-1] / STATE, weights_only=True)
        first, lines = int(state["step"]), list(state["lines"])
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        counts = state.get("skipped", counts)
        for line in lines:  # (the W&B and MLflow runs it goes on in have them)
            logger.log(0, line, replayed=True)
        for _ in range(first * local_batch):  # the row sampler, as it stood at that step
            rng.randrange(len(encoded))
        if show:
            print(f"cold start: resumed at step {first} from {saved[-1]}", flush=True)
    policy.train()
    start = time.perf_counter() - (lines[-1]["time/sft"] if lines else 0.0)
    # steps skipped (their gradients not finite): in all, in a row now, and the longest
    # such row (train.max_skipped's). Counted on the device, read with the logged lines (a
    # read each step would stall the queue); a float16 overflow at a scale above 1 neither
    # counts toward a row nor ends one, as in RL (gspo.training.update.step_if_finite)
    counts = [*counts, counts[1]][:3]  # (a progress checkpoint without the longest row)
    skipped, in_a_row, longest = (torch.tensor(float(n), device=policy.device) for n in counts)

    def save_progress(step: int) -> None:
        began = time.perf_counter()
        extra = {
            "scaler": None if scaler is None else scaler.state_dict(),
            "skipped": [skipped.item(), in_a_row.item(), longest.item()],
            "settings": progress_settings(config, rows),
        }
        _save_progress(checkpoints, step, policy, optimizer, lines, dist, extra)
        saves.append(time.perf_counter() - began)

    saves: list[float] = []  # (seconds each progress checkpoint took)
    stretch = time.perf_counter()
    for i in range(first, cfg.cold_start_steps):
        # cosine decay to 10% keeps the end of SFT from bouncing around
        lr = cfg.cold_start_lr * (0.55 + 0.45 * math.cos(math.pi * i / cfg.cold_start_steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        picked = [encoded[rng.randrange(len(encoded))] for _ in range(local_batch)]
        prompt_ids, prompt_mask = pad_batch([p for p, _, _ in picked], pad, policy.device)
        completion_ids, completion_mask = pad_batch(
            [c for _, c, _ in picked], pad, policy.device, side="right"
        )
        actions = torch.zeros_like(completion_mask, dtype=torch.bool)
        for row, (_, _, a) in enumerate(picked):
            actions[row, : len(a)] = torch.tensor(a, dtype=torch.bool)
        with policy.autocast():
            lp = policy.forward(prompt_ids, prompt_mask, completion_ids, completion_mask)
        loss = -lp[actions].mean()  # the model's tokens: not an episode's tool responses
        policy.backward(loss, actions.sum(), scaler=scaler)
        if scaler is not None:
            scaler.unscale_(optimizer)
        norm = whole(torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0))
        bad, counted = step_if_finite(optimizer, norm, scaler)
        skipped += bad
        in_a_row = (in_a_row + counted) * bad
        longest = torch.maximum(longest, in_a_row)
        optimizer.zero_grad(set_to_none=True)
        policy.stepped()
        if (i + 1) % 100 == 0 or i + 1 == cfg.cold_start_steps:
            line = combine(
                dist,
                config.algorithm.level,
                {
                    "sft/step": i + 1,
                    "sft/loss": loss.item(),
                    "sft/tokens": float(actions.sum().item()),
                    "time/sft": time.perf_counter() - start,
                },
            )
            skips = read_scalars({"skipped": skipped, "longest": longest})
            if skips["skipped"]:
                line["sft/skipped_steps"] = skips["skipped"]
            if skips["longest"] >= config.train.max_skipped:
                raise NonFiniteTraining(
                    f"train.max_skipped={config.train.max_skipped}: {skips['longest']:.0f} "
                    f"of the cold start's steps in a row (by step {i + 1}) had a non-finite "
                    f"loss or gradient (last loss {line['sft/loss']}); stopping. Lower "
                    f"train.cold_start_lr (it is {cfg.cold_start_lr:g})"
                )
            logger.log(0, line)
            lines.append(line)
            if show:
                print(
                    f"cold start {i + 1}/{cfg.cold_start_steps} | "
                    f"sft loss {line['sft/loss']:.4f} | {line['time/sft']:.0f}s",
                    flush=True,
                )
        every = cfg.cold_start_save_every
        saved = every and (i + 1) % every == 0 and i + 1 < cfg.cold_start_steps
        if saved:
            save_progress(i + 1)
        if time_limit is not None and (i + 1) % COLD_START_EVERY == 0:
            time_limit.took(time.perf_counter() - stretch, "sft")
            stretch = time.perf_counter()
            if i + 1 < cfg.cold_start_steps and time_limit.reached(max(saves, default=0), "sft"):
                if not saved:
                    save_progress(i + 1)
                of = cfg.cold_start_steps
                time_limit.stopped = f"in its cold start, after step {i + 1} of {of}"
                return True
    if entry is not None:
        _store_in_cache(entry, policy, lines, dist)
        _trimmed(config, entry, dist)
    return True


class DataError(ValueError):
    """A cold-start row found unusable once the run started (its chat template refuses
    it, or it leaves no room for its completion): one of the run's inputs."""


def rows_name(config: Config) -> str:
    return f"data.sft ({config.data.source_of('data.sft')})"


def encode_rows(
    rows: list[dict[str, Any]], encode: Callable[[dict[str, Any]], Encoded], config: Config
) -> list[Encoded]:
    """Each row encoded; one that cannot be (a chat template failing on its messages) is a
    one-line error naming it."""
    encoded = []
    for i, row in enumerate(rows, start=1):
        try:
            encoded.append(encode(row))
        except ValueError as exc:  # (EnvError included)
            raise DataError(f"{rows_name(config)} row {i}: {exc}") from exc
    return encoded


def within_context(
    encoded: list[Encoded], context: int | None, config: Config, dist: Distributed
) -> list[Encoded]:
    """The rows cut at the model's ``context`` (max_position_embeddings), as TRL's SFT
    cuts at ``max_length``: a learned position table has no position past it (an
    IndexError in the middle of the cold start before) and rotary positions past it are
    ones the model was not made for. Said in one warning line; a prompt that leaves no
    room for a completion token is a one-line error naming the row."""
    if context is None:
        return encoded
    name = rows_name(config)
    cut = []
    for i, (prompt, completion, actions) in enumerate(encoded):
        if len(prompt) >= context:
            raise DataError(
                f"{name} row {i + 1}: the prompt is {len(prompt)} tokens, leaving no room for its "
                f"completion in {said_context(context, MODEL_CONTEXT)}"
            )
        if len(prompt) + len(completion) > context:
            cut.append(len(prompt) + len(completion))
            room = context - len(prompt)
            encoded[i] = (prompt, completion[:room], actions[:room])
    if cut and dist.is_main:
        print(
            f"gspo: warning: {name}: {len(cut)} row(s) (the longest {max(cut)} tokens) run "
            f"past {said_context(context, MODEL_CONTEXT)}: cut there, so their completions "
            "lose their end (EOS included)",
            file=sys.stderr,
            flush=True,
        )
    return encoded


def single_turn_encoder(config: Config, tokenizer):
    """Encodes a row whose completion is a string: the model's tokens, then the end of
    its turn: the chat template's after a chat prompt (Gemma's ``<end_of_turn>``, where
    the tokenizer's EOS is ``<eos>``), EOS after a text prompt."""
    chat = config.data.chat_template_kwargs
    ends = {False: tokenizer.eos_token_id, True: turn_end(tokenizer, **chat)}

    def encode(row: dict[str, Any]) -> Encoded:
        ids = tokenizer(row["completion"], add_special_tokens=False)["input_ids"]
        ids = [*ids, ends[isinstance(row["prompt"], list)]]
        return encode_prompt(row["prompt"], tokenizer, **chat), ids, [True] * len(ids)

    return encode


def drop_progress(checkpoints: Path, dist: Distributed) -> None:
    """Remove the cold start's progress checkpoints once the step-0 checkpoint holds it."""
    if dist.is_main:
        for path in progress_checkpoints(checkpoints):
            shutil.rmtree(path)
