"""What a run is built from: task data, the model, the optimizer, the reward functions and
each rank's share of the batch sizes."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gspo.config import (
    RESUME_MAY_CHANGE,
    Config,
    DataConfig,
    changed_settings,
    dump_config_text,
    flat_settings,
    load_config,
)
from gspo.data import load_rows, prepare_rows
from gspo.distributed import Distributed
from gspo.environments import EnvError, EnvironmentFactory, EnvTimeout
from gspo.models import (
    TinyModelSpec,
    build_char_tokenizer,
    build_tiny_model,
    disable_dropout,
    load_model,
    model_files,
    save_pretrained_atomic,
)
from gspo.models.kernels import set_linear_kernel
from gspo.moe import (
    experts_implementation,
    set_experts_implementation,
    unhandled_router,
)
from gspo.moved import model_not_found, moved_path, with_run_dir
from gspo.plugins import absolute_spec, counted, some_of
from gspo.rewards import RewardFunctions
from gspo.rewards.parsing import completion_text
from gspo.tasks import BUILTIN_TASKS, TaskData
from gspo.training.blocks import compile_blocks, enable_activation_checkpointing
from gspo.training.checkpoint import CHECKPOINTS, CONFIG, checkpoint_dir
from gspo.training.lora import (
    adam_state_bytes,
    attach_lora,
    base_model_path,
    is_lora_checkpoint,
    parameter_counts,
)
from gspo.training.reward_columns import check_reward_columns
from gspo.training.seeds import derive_seed


def load_task_data(config: Config) -> TaskData:
    """The built-in task or the user's data (``data.train`` / ``data.eval`` / ``data.sft``),
    each row's prompt (and answer, completion) built by the ``data.*`` keys."""
    data = config.data
    if data.train is None:
        make = BUILTIN_TASKS[data.task]
        # each task takes the data.* settings named like its keyword arguments
        settings = {k: getattr(data, k) for k in inspect.signature(make).parameters
                    if k in DataConfig.model_fields and k != "seed"}  # fmt: skip
        task = make(**settings, seed=derive_seed(config.task_seed, "task"))
        if data.eval is not None:
            task.eval = load_rows(data.eval, what="data.eval")
        if data.sft is not None:
            task.sft = load_rows(data.sft, what="data.sft")
    else:
        task = TaskData(
            train=load_rows(data.train, what="data.train"),
            eval=load_rows(data.eval, what="data.eval") if data.eval else [],
            sft=load_rows(data.sft, what="data.sft") if data.sft else [],
        )
    blank_ok = config.rollout.environment is not None  # (its reset writes the rest)
    return TaskData(
        train=prepare_rows(task.train, data, what="data.train", blank_ok=blank_ok),
        eval=prepare_rows(task.eval, data, what="data.eval", blank_ok=blank_ok),
        sft=prepare_rows(task.sft, data, what="data.sft", sft=True),
    )


def build_or_load_model(
    config: Config, output_dir: Path, device: torch.device, dist: Distributed | None = None
):
    """``model.path``, or a built-in tiny model saved to ``output_dir/base_model`` first.

    Both go through :func:`load_model`, so the built-in takes the user's code path. Under
    torchrun rank 0 builds and saves it and every rank loads the saved files.
    """
    if config.model.path is not None:
        return load_model(config.model.path, device=device, dtype=torch.float32)
    m = config.model
    spec = TinyModelSpec(
        architecture=m.builtin,
        layers=m.layers,
        hidden=m.hidden,
        heads=m.heads,
        kv_heads=m.kv_heads,
        intermediate=m.intermediate,
        experts=m.experts,
        experts_per_token=m.experts_per_token,
        expert_intermediate=m.expert_intermediate,
        norm_topk_prob=m.norm_topk_prob,
    )
    base, dist = output_dir / "base_model", dist or Distributed()
    if dist.is_main:
        tokenizer = build_char_tokenizer()
        model = build_tiny_model(spec, tokenizer, seed=derive_seed(config.train.seed, "init"))
        save_pretrained_atomic(model, tokenizer, base)
    dist.barrier()
    return load_model(base, device=device, dtype=torch.float32)


def build_policy_model(
    config: Config,
    output_dir: Path,
    device: torch.device,
    dist: Distributed,
    checkpoint: Path | None,
    compute_dtype: torch.dtype,
):
    """``(model, tokenizer, model_dir)``: the model a run trains, adapters attached if any.

    ``checkpoint`` (resuming) gives the whole model of a full fine-tuning run, or, for a
    LoRA run, the adapter whose base model ``adapter_config.json`` names (the adapter's
    weights are loaded later with the optimizer state). ``model_dir`` is a directory
    holding the whole weights the run starts from (what vLLM starts from).
    """
    lora = config.model.lora
    if checkpoint is not None:
        adapter = is_lora_checkpoint(checkpoint)
        if adapter != (lora.r > 0):
            raise ValueError(
                f"model.lora.r={lora.r}: the checkpoint {checkpoint} is "
                f"{'a LoRA adapter' if adapter else 'a full fine-tuning one'}"
            )
        # (the model it builds on: a LoRA adapter's base, a step 0's model, where it is now)
        where = config.model.path
        model_dir = (
            base_model_path(checkpoint, where) if adapter else model_files(checkpoint, where)
        )
        if not model_dir.is_dir():
            raise model_not_found(model_dir, checkpoint)
        model, tokenizer = load_model(model_dir, device=device, dtype=torch.float32)
    else:
        model, tokenizer = build_or_load_model(config, output_dir, device, dist)
        # (a step 0 naming its model as model.path: that model, so names never chain)
        model_dir = model_files(config.model.path or output_dir / "base_model")
    if tokenizer.eos_token_id is None and checkpoint is None and config.train.cold_start_steps:
        raise ValueError(
            f"model.path: the tokenizer of {model_dir} has no eos token, with which the cold "
            "start ends every completion (set eos_token in its tokenizer_config.json, or "
            "train.cold_start_steps=0)"
        )
    said, name = [], type(model).__name__
    if noise := disable_dropout(model):
        what = " and its ".join(f"{kind} (up to {rate:g})" for kind, rate in noise.items())
        said.append(
            f"note: the model's {what} {'are' if len(noise) > 1 else 'is'} off for the whole "
            "run: pi_theta/pi_old must be 1 on the sampled tokens"
        )
    if (router := unhandled_router(model)) is not None:
        said.append(
            f"warning: {name} is a mixture-of-experts model whose router ({router}) gspo "
            "does not handle: no expert churn (moe/*), Routing Replay or router loss for it "
            "(docs/moe.md lists the families handled)"
        )
    chosen = config.model.experts_implementation
    set_experts_implementation(model, chosen)
    if chosen != "auto" and experts_implementation(model) != chosen:
        said.append(  # (a dense model, or padded for a router not handled: it went unsaid)
            f"warning: model.experts_implementation={chosen} does nothing here: {name} has "
            "no experts gspo computes that way"
        )
    for line in said if dist.is_main else []:
        print(f"gspo: {line}", file=sys.stderr, flush=True)
    if config.model.activation_checkpointing:
        enable_activation_checkpointing(model)
    if lora.r > 0:
        # on CUDA the frozen base sits in the compute dtype (bf16: 2 bytes a weight)
        base_dtype = compute_dtype if device.type == "cuda" else torch.float32
        model = attach_lora(
            model,
            lora,
            seed=derive_seed(config.train.seed, "lora"),
            base_path=model_dir,
            base_dtype=base_dtype,
        )
    set_linear_kernel(model, config.model.cpu_linear, head_precision(config, device, compute_dtype))
    if config.model.compile:
        compile_blocks(model, dist)
    return model, tokenizer, model_dir


def head_precision(config: Config, device: torch.device, compute_dtype: torch.dtype) -> str:
    """``model.head_precision``, ``auto`` resolved: ``bf16_weight`` (the tensor cores) on
    CUDA below float32, where float32 products would run outside them; float32 otherwise."""
    if config.model.head_precision != "auto":
        return config.model.head_precision
    low = device.type == "cuda" and compute_dtype != torch.float32
    return "bf16_weight" if low else "float32"


def model_summary(model: torch.nn.Module) -> dict[str, float]:
    """What trains, logged at start-up: parameter counts and AdamW's state in bytes.

    ``optim/state_bytes`` is the RL optimizer's state once it has stepped (two moments per
    trained weight and a step count per tensor), for the whole model before sharding.
    """
    trainable, total = parameter_counts(model)
    return {
        "model/params": float(total),
        "model/trainable_params": float(trainable),
        "model/param_bytes": float(sum(p.numel() * p.element_size() for p in model.parameters())),
        "optim/state_bytes": float(adam_state_bytes(model)),
    }


def start_line(
    summary: dict[str, float], adapters: bool, dtype: torch.dtype, recompute: bool
) -> str:
    """The run's first line: what trains (:func:`model_summary`), the compute dtype and
    where pi_old comes from (``algorithm.old_logprobs=auto`` resolved: it was said nowhere)."""
    return (
        f"model: {summary['model/trainable_params']:,.0f} of {summary['model/params']:,.0f} "
        f"parameters train{' (LoRA adapters)' if adapters else ''}; AdamW state "
        f"{summary['optim/state_bytes'] / 2**20:.2f} MiB; computes in "
        f"{str(dtype).removeprefix('torch.')}, "
        f"pi_old {'recomputed by the trainer' if recompute else 'from the sampler'}"
    )


def adamw(model: torch.nn.Module, **kwargs: Any) -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters, fused into one kernel where PyTorch has one.

    Fused (CPU and CUDA): clip + step 3.8 ms against 6.8 ms for the per-tensor loop on
    the benchmark model on 2 CPU cores (``python benchmarks/levers.py``, adamw).
    """
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]  # a LoRA run: the adapters
    return torch.optim.AdamW(params, fused=device.type in ("cpu", "cuda"), **kwargs)


def rl_optimizer(
    config: Config, model: torch.nn.Module
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """RL's optimizer (``optim.*``) and its schedule: linear warm-up, then constant."""
    optim = config.optim
    optimizer = adamw(model, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay)
    warmup = optim.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
    )
    return optimizer, scheduler


def local_shares(config: Config, dist: Distributed) -> tuple[int, int]:
    """This rank's shares of the global batch sizes (``rollout.prompts_per_batch``,
    ``train.cold_start_batch_size``); one-line errors if they do not divide, or if a rank
    holds fewer responses than ``algorithm.minibatches``. A run without a cold start
    never uses its batch size (unchecked: its share rounded down)."""
    local_prompts = dist.shard(config.rollout.prompts_per_batch, "rollout.prompts_per_batch")
    if config.train.cold_start_steps > 0:
        local_sft = dist.shard(config.train.cold_start_batch_size, "train.cold_start_batch_size")
    else:
        local_sft = max(1, config.train.cold_start_batch_size // dist.world_size)
    if local_prompts * config.rollout.group_size < config.algorithm.minibatches:
        raise ValueError(
            f"algorithm.minibatches={config.algorithm.minibatches} exceeds the "
            f"{local_prompts * config.rollout.group_size} responses each of the "
            f"{dist.world_size} ranks holds per rollout batch: a larger "
            "rollout.prompts_per_batch, or fewer ranks (a resumed run keeps its "
            "algorithm.minibatches)"
        )
    return local_prompts, local_sft


def with_absolute_paths(
    config: Config, moved: Callable[[Path], Path | None] | None = None
) -> Config:
    """``config`` with the files and directories it names relative to the current
    directory made absolute (``model.path``, ``data.train/eval/sft``, ``reward.functions``,
    ``reward.sources`` and ``rollout.environment`` files, ``train.cold_start_cache_dir``):
    what the run records in its config.yaml, so a resume from another directory reads the same files
    (it failed, or read another ``varied.py`` there). A hub id or module name stays, and
    a key left at its default stays unset. ``moved(path)``: where a recorded path that
    is missing lies now, the run having moved with it (:func:`gspo.moved.moved_path`).
    """

    def found(value: str) -> Path | None:
        path = Path(value).expanduser()
        if path.exists():
            return path.resolve()
        return None if moved is None else moved(path)

    def local(value: Any) -> Any:
        where = found(value) if isinstance(value, str) else None
        return value if where is None else str(where)

    def data(value: Any) -> Any:  # a file or directory, or a local DIR:CONFIG:SPLIT
        if not isinstance(value, str) or found(value) is not None:
            return local(value)
        source, sep, rest = value.partition(":")
        where = found(source) if sep else None
        return f"{where}:{rest}" if where is not None and where.is_dir() else value

    def cache(value: Any) -> Any:  # made by the run: absolute whether or not it exists yet
        if not isinstance(value, str):
            return value
        return str(found(value) or Path(value).expanduser().resolve())

    def spec(value: Any) -> Any:
        return absolute_spec(value, found)

    keys = {
        "model": {"path": local},
        "data": {"train": data, "eval": data, "sft": data},
        "reward": {
            "functions": lambda specs: [spec(f) for f in specs],
            "sources": lambda routes: {k: spec(v) for k, v in routes.items()},
        },
        "rollout": {"environment": spec},
        "train": {"cold_start_cache_dir": cache},
    }
    sections = {}
    for name, fields in keys.items():
        section = getattr(config, name)
        changed = {key: how(getattr(section, key)) for key, how in fields.items()}
        changed = {k: v for k, v in changed.items() if v != getattr(section, k)}
        if changed:  # (only what changed: model_copy marks a key it updates as set)
            sections[name] = section.model_copy(update=changed)
    return config.model_copy(update=sections) if sections else config


def record_config(
    config: Config, output_dir: Path, finished: bool, moved: Callable[[Path], Path | None] | None
) -> None:
    """Write the run's config.yaml (rank 0): ``config``; for a finished run resumed, what it
    trained with, kept as it is, unless its model was moved since (a resume's
    ``model.path=NEW``, :func:`gspo.runs.relocated`): then that, where the model is now."""
    recorded = config
    if finished:
        recorded = with_absolute_paths(load_config(output_dir / "config.yaml"), moved)
        if recorded.model.path == config.model.path:
            return
        model = recorded.model.model_copy(update={"path": config.model.path})
        recorded = recorded.model_copy(update={"model": model})
    text = with_run_dir(dump_config_text(recorded), output_dir)
    (output_dir / "config.yaml").write_text(text)


#: What a resume may change without a word: how the run is logged, kept and written, and
#: how the same weights are computed (``model.path``: refused unless the same weights moved)
RESUME_FREE = (
    "log.", "train.cold_start_cache", "train.keep_checkpoints", "train.save_every",
    "train.time_limit",
    "train.background_checkpoints", "train.save_only_model", "rollout.vllm.cpu_kv_cache_gb",
    "model.path", *(f"model.{key}" for key in RESUME_MAY_CHANGE),
)  # fmt: skip


def resume_changes(config: Config, checkpoint: Path) -> str | None:
    """The settings a resumed run changes from those its ``checkpoint`` was trained with
    (the config.yaml it holds; :data:`RESUME_FREE` and a longer ``train.max_steps`` aside), as one
    line: the run's metrics go on as one run, which a changed seed, algorithm or task
    makes two experiments (nothing said before)."""
    held = checkpoint / CONFIG
    if not held.is_file():  # (a checkpoint from before they held their config)
        return None
    run = checkpoint.parent.parent  # (paths recorded where the run was: as moved with it)
    was = with_absolute_paths(load_config(held), lambda path: moved_path(path, run, held))
    changed = changed_settings(flat_settings(was), flat_settings(config), free=RESUME_FREE)
    if not changed:
        return None
    return (
        f"resumed with settings {checkpoint.name} was not trained with: {'; '.join(changed)} "
        "(metrics.jsonl goes on as one run)"
    )


def check_eval_row(environment: EnvironmentFactory | None, rows: list[dict[str, Any]]) -> None:
    """The first ``data.eval`` row tried up front (:meth:`EnvironmentFactory.try_row`), as
    the first training row is (a column that only ``data.eval`` lacks stopped the run at
    its first evaluation, after the cold start); its error names the row."""
    if environment is None or not rows:
        return
    try:
        environment.try_row(rows[0])
    except EnvTimeout:
        raise
    except EnvError as e:
        raise EnvError(f"data.eval row 1: {e}") from e


def with_environment_reward(config: Config, environment: Any | None) -> Config:
    """``config``, with ``reward.functions`` the environment's own reward (``get_reward``)
    when it has one and the key is not set: what the run records in its config.yaml, so a
    resumed run is scored as it was (it fell back to the default exact_match)."""
    explicit = "functions" in config.reward.model_fields_set
    if environment is None or not environment.has_reward or explicit:
        return config
    reward = config.reward.model_copy(update={"functions": ["environment"]})
    return config.model_copy(update={"reward": reward})


def start_warnings(
    config: Config, rewards: RewardFunctions, data: TaskData, environment: Any, out: Path
) -> list[str]:
    """The lines a new run warns with before it starts: settings that do nothing
    (:meth:`Config.warnings`), rows a reward function cannot score, empty cold-start
    completions, a held-out set cut to ``eval.max_prompts``, a base model another run
    may remove. (Errors in the same inputs are raised by the same functions.)"""
    return [
        *config.warnings(),
        *check_reward_columns(rewards, data, config, environment),
        *empty_completions(data.sft, config),
        *held_out_cut(data.eval, config),
        *fewer_prompts_than_a_batch(data.train, config),
        *base_in_another_run(config, out),
        *one_turn_with_tools(config, environment),
    ]


def one_turn_with_tools(config: Config, environment: Any | None) -> list[str]:
    """``rollout.max_turns=1`` with an environment that has tools: a turn that calls one is
    the episode's last, cut ("length") before the tool's result could reach the model."""
    tools = getattr(environment, "tool_names", None)
    if not tools or config.rollout.max_turns > 1:
        return []
    return [
        f"rollout.max_turns=1 with the environment's tools ({', '.join(tools)}): a turn that "
        "calls one ends its episode there, cut as 'length', the tool's result never seen by "
        "the model; rollout.max_turns=2 or more lets it use them"
    ]


def empty_completions(sft: list[dict], config: Config) -> list[str]:
    """A warning line when cold-start rows have an empty completion (blank text, or no
    assistant text in a conversation): the cold start teaches those prompts to end at
    once. Nothing when no cold start runs."""
    if config.train.cold_start_steps == 0:
        return []

    def text(completion: Any) -> str:  # (a conversation's assistant messages: not tools')
        if isinstance(completion, str):
            return completion
        return "".join(completion_text(m) for m in completion if m.get("role") == "assistant")

    empty = [i for i, row in enumerate(sft, start=1) if not text(row["completion"]).strip()]
    if not empty:
        return []
    where = config.data.source_of("data.sft")
    return [
        f"data.sft ({where}): {some_of(empty, len(sft), 'row')} an "
        "empty completion: the cold start teaches their prompts to end at once"
    ]


def held_out_cut(eval_rows: list[dict], config: Config) -> list[str]:
    """A warning line when the user's held-out rows are more than ``eval.max_prompts``:
    the first that many are evaluated (a 1,319-row test set was measured on 500, unsaid)."""
    most = config.eval.max_prompts
    if config.data.eval is None or len(eval_rows) <= most:
        return []
    where = config.data.source_of("data.eval")
    return [
        f"data.eval ({where}) has {len(eval_rows)} rows; eval.max_prompts={most} evaluates "
        f"the first {most} (eval.max_prompts={len(eval_rows)} evaluates them all)"
    ]


def fewer_prompts_than_a_batch(train_rows: list[dict], config: Config) -> list[str]:
    """A warning line when the RL prompts are fewer than one rollout batch takes: a batch
    then holds some prompt's group twice or more (it did, unsaid)."""
    wanted = config.rollout.prompts_per_batch
    if config.data.train is None or not train_rows or len(train_rows) >= wanted:
        return []
    where = config.data.source_of("data.train")
    return [
        f"data.train ({where}) has {counted(len(train_rows), 'row')}, fewer than "
        f"rollout.prompts_per_batch={wanted}: each rollout batch takes some prompts more than "
        "once (their groups are alike; a smaller rollout.prompts_per_batch takes each once)"
    ]


def base_in_another_run(config: Config, output_dir: Path) -> list[str]:
    """A warning line when ``model.path`` is a checkpoint (past step 0) of another run:
    that run, continued, removes all but its newest ``train.keep_checkpoints``, and a LoRA
    run built on it could then be neither resumed nor exported (its base gone). None for a
    run of no RL steps (an evaluation: ``gspo eval``, the recipe before it)."""
    if config.model.path is None or config.train.max_steps == 0:
        return []
    path = Path(config.model.path).resolve()
    run = path.parent.parent
    if path.parent.name != CHECKPOINTS or not (run / "config.yaml").is_file():
        return []
    if path == checkpoint_dir(run, 0) or run == Path(output_dir).resolve():
        return []  # (step 0 is never removed)
    return [
        f"model.path is {path.name} of the run {run}, which removes it once it has "
        "train.keep_checkpoints newer ones (gspo train --resume there); this run needs "
        f"it to resume and export: copy it elsewhere first (cp -r {path} DIR; model.path=DIR)"
    ]


def reward_functions(config: Config) -> RewardFunctions:
    """``reward.functions`` with their weights, called as ``reward.workers`` says."""
    return RewardFunctions.from_specs(
        config.reward.specs(),
        config.reward.weights,
        workers=config.reward.workers,
        timeout=config.reward.timeout,
    )
