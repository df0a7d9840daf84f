"""LoRA adapters (``model.lora``, PEFT): attaching them, their weights, merged copies.

The policy of a LoRA run is a :class:`peft.PeftModel` around the frozen base model. Only
the adapters train, so only they have gradients and optimizer state; the KL reference is
the same module under :meth:`peft.PeftModel.disable_adapter` (no second copy); engines
that take weights (vLLM) and ``gspo export --merge`` get a merged copy made by PEFT's
``merge_and_unload`` on a copy, so the trained module is never merged into.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from gspo.config import Config, LoraSettings
from gspo.distributed import Distributed
from gspo.models.loading import MODEL_FINGERPRINT, fingerprint_change
from gspo.moved import in_checkpoint
from gspo.training.seeds import rank_seed, seeded_global_draws

#: PEFT's file names in a LoRA checkpoint.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """Around PEFT calls: no warnings that the user can do nothing about.

    PEFT's wrapper reads transformers' deprecated ``is_gradient_checkpointing`` (a
    FutureWarning since transformers 5.24), and on MoE models PEFT adds rank/alpha
    patterns of its own for fused experts' ``gate_up_proj``, then warns that they matched
    nothing when the experts are modules (gspo sets no pattern); on Conv1D layers (GPT-2)
    it corrects ``fan_in_fan_out`` itself, and warns.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
        warnings.filterwarnings(
            "ignore", "The following (rank|alpha)_pattern keys did not match", RuntimeWarning
        )
        # GPT-2's Conv1D layers: PEFT sets fan_in_fan_out itself, and says so
        warnings.filterwarnings("ignore", "fan_in_fan_out is set to False", UserWarning)
        yield


def adapter_dropout_seed(config: Config, dist: Distributed, rollout_index: int) -> int | None:
    """With ``model.lora.dropout > 0``: the seed of rollout batch ``rollout_index``'s
    dropout masks (:meth:`Policy.same_dropout`), from ``train.seed``, so a run and its
    resume drop the same inputs; None without dropout."""
    if not config.model.lora.drops_inputs:
        return None
    return rank_seed(config.train.seed, dist, "dropout", rollout_index)


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` carries PEFT adapters (no model does if PEFT was never imported,
    which spares a full fine-tuning run PEFT's ~0.1 s import)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def _each_target_matches(targets: list[str], wrapped: torch.nn.Module) -> None:
    """One line for a name of the list that no adapted module has (its whole name, or
    its last parts, as PEFT matches a list): ``[q_proj, v_prj]`` adapted q_proj alone."""
    adapted = [n for n, m in wrapped.named_modules() if hasattr(m, "base_layer")]
    for target in targets:
        if not any(n == target or n.endswith(f".{target}") for n in adapted):
            linear = sorted(
                {
                    n.removesuffix(".base_layer").rpartition(".")[2]
                    for n, m in wrapped.named_modules()
                    if isinstance(m, torch.nn.Linear) and "lora_" not in n
                }
            )
            raise ValueError(
                f"model.lora.target_modules: {target!r} matches no module of the model (its "
                f"linear layers: {', '.join(linear)})"
            )


def _tuple_routers(model: torch.nn.Module) -> list[str] | None:
    """The routers that are ``nn.Linear`` subclasses returning a tuple (PhiMoE's
    ``PhimoeTopKRouter``, Llama 4's ``Llama4Router``): ``all-linear`` took them, and PEFT's
    layer added its update to their tuple (AttributeError in the first forward)."""
    found = [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and type(module).__name__.endswith("Router")
        and type(module).forward is not torch.nn.Linear.forward
    ]
    return found or None


def attach_lora(
    model: torch.nn.Module,
    settings: LoraSettings,
    *,
    seed: int,
    base_path: Path | None = None,
    base_dtype: torch.dtype = torch.float32,
) -> torch.nn.Module:
    """``model`` wrapped with fresh adapters (``model.lora``); its own weights frozen.

    The adapters' random init (PEFT draws ``lora_A`` from the global generator) runs
    under a generator forked and seeded with ``seed``, so it is a function of the seed
    and leaves the caller's random state alone. The adapters are float32; the frozen
    base is cast to ``base_dtype`` (the compute dtype on CUDA: 2 bytes a weight in bf16
    instead of 4, the point of LoRA on a GPU). Target modules that match nothing are a
    one-line ``ValueError`` naming ``model.lora.target_modules``. ``base_path`` is
    recorded in the adapter's ``adapter_config.json`` (``base_model_name_or_path``).
    """
    from peft import LoraConfig, get_peft_model

    routers = _tuple_routers(model) if settings.target_modules == "all-linear" else None
    if routers and "exclude_modules" not in LoraConfig.__dataclass_fields__:  # (PEFT < 0.14)
        raise ValueError(
            f"model.lora.target_modules=all-linear: {routers[0]} returns a tuple, which a "
            "LoRA layer cannot wrap, and this PEFT cannot leave it out: upgrade peft (>= "
            "0.14) or list the modules to adapt (model.lora.target_modules=[q_proj,v_proj])"
        )
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=settings.target_modules,
        **({"exclude_modules": routers} if routers else {}),
        bias="none",
        task_type="CAUSAL_LM",
    )
    tied = tied_embeddings(model)
    # (torch.manual_seed seeded every CUDA device, and the fork gave back only the model's)
    with seeded_global_draws(seed, model.device), quiet_peft():
        # (PEFT warns of a tied layer it adapts: refused below, in one line)
        warnings.filterwarnings("ignore", ".*tie_word_embeddings.*", UserWarning)
        try:
            peft_model = get_peft_model(model, config)
        except ValueError as exc:
            said = str(exc).strip()
            # "Target module Qwen3Attention(\n  (q_proj): ...\n) is not supported. ...":
            # the module's class and PEFT's list, not the module's print-out
            module = re.match(r"Target module (\w+)\(.*\) is not supported\.(.*)", said, re.S)
            if module:
                said = (
                    f"matches a {module[1]}, which is not a layer LoRA adapts (name its "
                    f"linear layers, e.g. q_proj, or all-linear):{module[2]}"
                )
            raise ValueError(
                f"model.lora.target_modules={settings.target_modules!r}: {said.splitlines()[0]}"
            ) from None
    wrapped = peft_model.get_base_model()  # the model, its adapted layers replaced
    adapted = [name for name in tied if hasattr(wrapped.get_submodule(name), "base_layer")]
    if adapted:
        raise ValueError(
            f"model.lora.target_modules={settings.target_modules!r} adapts {adapted[0]}, which "
            "this model ties to its other embedding (tie_word_embeddings): no merge of such "
            "an adapter gives the trained policy (gspo export --merge, vLLM's weights), so "
            "leave it out (the default all-linear does)"
        )
    if isinstance(settings.target_modules, list):  # (PEFT needs one name to match, not each)
        _each_target_matches(settings.target_modules, wrapped)
    # Set after wrapping: get_peft_model overwrites it with the model's own name_or_path (the
    # path as the user wrote it) and warns that it "was renamed" if the config held another.
    peft_model.peft_config["default"].base_model_name_or_path = (
        str(Path(base_path).resolve()) if base_path else None
    )
    if base_dtype != torch.float32:
        for param in peft_model.parameters():
            if not param.requires_grad:
                param.data = param.data.to(base_dtype)
    for param in peft_model.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    return peft_model


def tied_embeddings(model: torch.nn.Module) -> list[str]:
    """The names of the input and output embeddings when they share one weight
    (``tie_word_embeddings``: Qwen3 up to 4B, Llama 3.2 1B/3B); none otherwise."""
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if inputs is None or outputs is None or inputs.weight is not outputs.weight:
        return []
    names = {id(module): name for name, module in model.named_modules()}
    return [names[id(inputs)], names[id(outputs)]]


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter counts of ``model`` (before any sharding)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def adam_state_bytes(model: torch.nn.Module) -> int:
    """Bytes of AdamW's state over ``model``'s trainable parameters once it has stepped.

    Two moments the size of each trained parameter (its dtype) and a float32 step count
    per parameter tensor, as ``torch.optim.AdamW`` keeps them.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    return sum(2 * p.numel() * p.element_size() + 4 for p in params)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors an optimizer holds now (this rank's share under FSDP)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total


def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable tensors of ``model`` by state-dict name (the adapters of a LoRA run)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def merged_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A plain HF model whose weights are ``model``'s base with its adapters merged in.

    Made from a deep copy (PEFT's ``merge_and_unload``), so ``model`` itself, base and
    adapters, is left bitwise as it was; the copy costs one model's memory while it lives.
    """
    return copy.deepcopy(model).merge_and_unload()


def base_path_of(peft_model) -> Path:
    """The base model directory a LoRA policy's adapters were attached to."""
    return Path(peft_model.peft_config["default"].base_model_name_or_path)


def base_model_path(checkpoint: Path, model_path: str | Path | None = None) -> Path:
    """The base model a LoRA checkpoint's adapter was trained on (``adapter_config.json``).

    Its weights must still be the ones the checkpoint's ``model_fingerprint.json`` records
    (checkpoints written before it was: not checked): else one line naming the base and
    what changed. A resume or merge on other base weights is another model, silently.
    A run's own ``base_model/`` (the built-in model's) is found beside the checkpoints
    when the run was moved since; a model moved elsewhere, where ``model_path`` (a resume's
    ``model.path``, by default the run's config.yaml's) names it now.
    """
    checkpoint = Path(checkpoint)
    config = json.loads((checkpoint / ADAPTER_CONFIG).read_text())
    base = Path(config["base_model_name_or_path"])
    own = checkpoint.parent.parent / base.name  # a run's own base_model/, the run moved
    if not base.is_dir() and base.name == "base_model" and own.is_dir():
        base = own  # (the fingerprint below still checks it is the same weights)
    else:  # (a model.path moved together with the run)
        base = in_checkpoint(base, checkpoint, model_path)
    fingerprint = checkpoint / MODEL_FINGERPRINT
    if fingerprint.is_file() and base.is_dir():  # (a missing base: the caller says so)
        changed = fingerprint_change(json.loads(fingerprint.read_text()), base)
        if changed:
            raise ValueError(
                f"{checkpoint}'s adapter was trained on the base model {base}, whose weights "
                f"changed since ({changed}); put the original weights back (on other base "
                "weights the adapter is another model)"
            )
    return base


def is_lora_checkpoint(path: Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()
