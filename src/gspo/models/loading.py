"""Loading and saving model directories: any local HF causal LM (or the one a
checkpoint's pointer names), saved whole or not at all, and the compute dtype."""

from __future__ import annotations

import copy
import json
import os
import re
import sys
import types
import warnings
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from gspo.distributed import not_rank_zero
from gspo.models.memory import OutOfMemory, is_out_of_memory, what_ran_out
from gspo.moved import in_checkpoint
from gspo.plugins import one_line
from gspo.publish import check_manifest, megabytes, staged

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def quiet_transformers() -> None:
    """No per-shard progress bars in our logs."""
    from transformers.utils import logging

    logging.disable_progress_bar()


#: Set on a tokenizer that had no pad token and pads with EOS in gspo: checkpoints and
#: exports save it without one, as it came (a pad token equal to EOS makes common SFT
#: collators mask every EOS label, so a model fine-tuned on the export never stops).
PAD_FROM_EOS = "gspo_pads_with_eos"


def save_pretrained(model, tokenizer, directory: str | Path, *, state_dict=None) -> None:
    """``save_pretrained`` model and tokenizer into ``directory`` (made if missing).

    ``state_dict``: the weights to write instead of the model's own (a copy taken earlier).
    A LoRA adapter on the embeddings is saved with them, as PEFT does by default, without
    its warning that it does so at every checkpoint.
    """
    quiet_transformers()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Setting `save_embedding_layers` to `True`")
        model.save_pretrained(directory, state_dict=state_dict)
    if getattr(tokenizer, PAD_FROM_EOS, False):  # saved as it came, without the stand-in
        tokenizer = copy.deepcopy(tokenizer)  # (a checkpoint is written beside the run)
        tokenizer.pad_token = None
    tokenizer.save_pretrained(directory)


def save_pretrained_atomic(
    model, tokenizer, directory: str | Path, *, also: Callable[[Path], None] | None = None
) -> Path:
    """``save_pretrained`` model and tokenizer into ``directory`` whole or not at all.

    ``also(tmp_dir)`` may write more files (e.g. optimizer state) before it is put in
    place (:func:`gspo.publish.staged`); an existing ``directory`` is replaced.
    """
    directory = Path(directory)
    # (a full disk names what it takes: the weights, as their parameters hold them)
    needs = sum(p.numel() * p.element_size() for p in model.parameters())
    with staged(directory, needs=needs) as tmp:
        save_pretrained(model, tokenizer, tmp)
        if also is not None:
            also(tmp)
    return directory


def resolve_dtype(dtype: str, device: torch.device, *, builtin: bool = False) -> torch.dtype:
    """``model.dtype`` on ``device``; ``builtin``: the model is the built-in one (no
    ``model.path``), which ``auto`` keeps in float32 on CUDA too: a few million
    parameters gain no speed from bf16, and trained in it the demo ended 0.81 sampled /
    0.87 greedy against float32's 0.96 / 0.99 (docs/precision.md, on the CPU)."""
    if dtype == "auto":
        # bf16 matmuls are hundreds of times slower than fp32 on CPUs without AVX512-BF16.
        return torch.bfloat16 if device.type == "cuda" and not builtin else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype must be auto or one of {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


#: In a checkpoint whose model is another directory's, unchanged (the step 0 of a run that
#: no cold start changed): that directory, one line, relative to the checkpoint or
#: absolute. It stands for a copy of the weights and tokenizer (:func:`model_files`).
MODEL_POINTER = "model_dir.txt"


#: Beside a :data:`MODEL_POINTER`: the named model's weight files as they were when the
#: pointer was written (:func:`model_fingerprint`, as JSON), checked wherever it is followed.
MODEL_FINGERPRINT = "model_fingerprint.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin")
_SAMPLES, _SAMPLE_BYTES = 16, 64 * 1024  # at most 1 MiB read a file


def model_fingerprint(directory: str | Path) -> dict[str, list[int]]:
    """The weight files (``*.safetensors``, ``*.bin``) of the model ``directory``: name ->
    ``[bytes, CRC-32 of 16 blocks of 64 KiB spread evenly over the file]`` (of the whole
    file when it is smaller).

    It reads at most 1 MiB a file, whatever the model's size, and the bytes, not the
    times: a model copied elsewhere (``cp -r`` gives new mtimes) still matches, and one
    saved again over the same directory (another fine-tune: the same names and sizes,
    other values in every block) does not. A few bytes changed between two samples go
    unseen; that is a damaged disk's case, not the one this guards against.
    """
    found = {}
    for file in sorted(Path(directory).iterdir()):
        if file.suffix not in WEIGHT_SUFFIXES or not file.is_file():
            continue
        size = file.stat().st_size
        crc = 0
        with file.open("rb") as f:
            if size <= _SAMPLES * _SAMPLE_BYTES:
                crc = zlib.crc32(f.read(), crc)
            else:
                for i in range(_SAMPLES):
                    f.seek(i * (size - _SAMPLE_BYTES) // (_SAMPLES - 1))
                    crc = zlib.crc32(f.read(_SAMPLE_BYTES), crc)
        found[file.name] = [size, crc]
    return found


def fingerprint_change(recorded: dict[str, list[int]], directory: Path) -> str | None:
    """What changed in ``directory``'s weight files since ``recorded`` was taken, or None."""
    now = model_fingerprint(directory)
    changes = []
    for name in sorted(recorded.keys() | now.keys()):
        was, got = recorded.get(name), now.get(name)
        if got is None:
            changes.append(f"{name} is gone")
        elif was is None:
            changes.append(f"{name} is new")
        elif was[0] != got[0]:
            changes.append(f"{name} is {got[0]:,} bytes, was {was[0]:,}")
        elif was[1] != got[1]:
            changes.append(f"{name} holds other bytes")
    return "; ".join(changes) or None


def model_files(path: str | Path, model_path: str | Path | None = None) -> Path:
    """The directory holding the model files of ``path``: the one its :data:`MODEL_POINTER`
    names (where it lies now: :func:`gspo.moved.in_checkpoint`, ``model_path`` a resume's
    ``model.path``), else ``path`` itself. Every reader of a model directory goes through it.

    Where the pointer has its :data:`MODEL_FINGERPRINT` beside it, the named model's
    weights must still be the ones it records: else a one-line ``ValueError`` naming the
    directory and what changed (a pointer written before fingerprints is followed as it is).
    """
    path = Path(path)
    pointer = path / MODEL_POINTER
    if not pointer.is_file():
        return path
    named = path / pointer.read_text().strip()  # (an absolute line replaces ``path``)
    named = in_checkpoint(named, path, model_path)  # (moved with the run, or elsewhere)
    fingerprint = path / MODEL_FINGERPRINT
    if fingerprint.is_file() and named.is_dir():  # (a missing directory: the caller says so)
        try:
            recorded = json.loads(fingerprint.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{fingerprint} is unreadable ({type(exc).__name__})") from exc
        changed = fingerprint_change(recorded, named)
        if changed:
            raise ValueError(
                f"{pointer} names the model {os.path.normpath(named)}, whose weights changed "
                f"since the checkpoint was written ({changed}); put the original weights "
                "back, or start the run again (this checkpoint holds no weights of its own)"
            )
    return named


def is_model_file(name: str) -> bool:
    """Whether the file ``name`` (relative to a checkpoint) is one the HF loaders read: the
    checkpoint's top level, less the ``.pt`` files of ``torch.save`` (trainer state)."""
    return "/" not in name and not name.endswith(".pt")


def _weight_bytes(path: Path) -> int:
    files = path.iterdir() if path.is_dir() else ()
    return sum(f.stat().st_size for f in files if f.suffix in WEIGHT_SUFFIXES and f.is_file())


def loading_message(
    path: str | Path, dtype: torch.dtype, device: torch.device, error: BaseException
) -> str:
    """One line: what ran out loading the model ``path`` in ``dtype`` onto ``device`` (and
    how large its weight files are), and what lowers the model's memory."""
    size = _weight_bytes(Path(path))
    files = f", {megabytes(size)} of weight files" if size else ""
    name = str(dtype).removeprefix("torch.")
    why = ""
    if dtype == torch.float32:
        why = " (gspo loads a model in float32 whatever model.dtype, the compute dtype)"
    return (
        f"{what_ran_out(error)} loading the model {os.path.normpath(path)} "
        f"({name} on {device}{files}){why}: "
        "pick a smaller model (model.path) or a device with more memory (model.device); "
        "full fine-tuning then adds gradients and AdamW's two moments, about 3x the "
        "weights: LoRA adapters (model.lora.r > 0) train far fewer, their frozen base "
        "held in model.dtype on CUDA (bfloat16: half of float32)"
    )


@contextmanager
def loading_model(path: str | Path, *, dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """Turn an out-of-memory error inside the block, which loads the model ``path`` in
    ``dtype`` onto ``device`` (or builds the policy from it), into :class:`OutOfMemory`."""
    try:
        yield
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
        if not is_out_of_memory(exc):
            raise
        raise OutOfMemory(loading_message(path, dtype, device, exc)) from exc


#: MoE blocks' training-mode noise on the hidden states or router logits (Mixtral's,
#: MiniMax's and Switch's ``jitter_noise``, PhiMoE's ``input_jitter_noise``; DBRX's
#: ``moe_jitter_eps`` is off at None). Not PhiMoE's ``router_jitter_noise``: its
#: routing's masking threshold, in eval mode too (0 would change the model)
_JITTER = ("jitter_noise", "input_jitter_noise", "moe_jitter_eps")

#: Routers that *sample* their experts in training mode (PhiMoE's sparsemixer: Gumbel
#: draws among the experts within ``router_jitter_noise`` of the best); kept in eval mode,
#: where they pick the best as at inference.
_SAMPLING_ROUTERS = ("PhimoeTopKRouter",)


def _eval_only(self: torch.nn.Module, mode: bool = True) -> torch.nn.Module:
    """``train`` of a module pinned to eval mode (bound per instance: copies keep it)."""
    return torch.nn.Module.train(self, False)


def disable_dropout(model: torch.nn.Module) -> dict[str, float]:
    """Switch off every dropout of ``model`` (its ``nn.Dropout`` modules and the attention
    modules' ``attention_dropout``) and its MoE blocks' jitter; the largest of each
    switched off (``{"dropout": 0.1, "router jitter": 0.01}``; empty: none).

    RL's ratio pi_theta / pi_old needs the trainer's forward to compute the sampler's
    probabilities: with dropout on in training mode (GPT-2's configs: 0.1) the on-policy
    ratios are off 1 by the dropped units and GSPO's narrow range clips most sequences;
    Mixtral's ``router_jitter_noise`` moves them the same way (an audit's probe, not a
    command of the repository, saw 43% of the on-policy tokens clipped at 0.1). PhiMoE's
    routers draw their experts at random in training mode (any ``router_jitter_noise``):
    they are kept in eval mode, which routes as inference does, with the gate's plain
    gradient in place of sparsemixer's estimate. ``config.json`` is left as it was (an
    export keeps the model's own dropout).
    """
    largest: dict[str, float] = {}

    def off(kind: str, rate: object) -> bool:
        if isinstance(rate, float) and rate > 0:
            largest[kind] = max(largest.get(kind, 0.0), rate)
            return True
        return False

    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and off("dropout", module.p):
            module.p = 0.0
        if off("dropout", getattr(module, "attention_dropout", None)):
            module.attention_dropout = 0.0
        for name in _JITTER:
            if off("router jitter", getattr(module, name, None)):
                setattr(module, name, None if name == "moe_jitter_eps" else 0.0)
        if type(module).__name__ in _SAMPLING_ROUTERS and "train" not in vars(module):
            # (at 0 nothing is drawn: eval mode is then the same sums, and nothing is said)
            off("expert sampling within router_jitter_noise", module.router_jitter_noise)
            module.train = types.MethodType(_eval_only, module)
            module.train(False)
    return largest


def length_dependent_rope(model: torch.nn.Module) -> tuple[str, int] | None:
    """``(rope type, positions)`` when the model's rotary frequencies depend on the length
    a forward call sees: transformers' ``dynamic`` (NTK) and ``longrope`` rescale them from
    the call's largest position once it passes ``positions`` (``max_position_embeddings``,
    or longrope's ``original_max_position_embeddings``; per layer type, the smallest).
    Else None (a fixed scaling, no rotary embedding, one transformers does not type)."""
    try:
        rotary = model.get_decoder().rotary_emb
    except AttributeError:
        return None
    rope_type = getattr(rotary, "rope_type", None)  # (GPT-J's and CodeGen's have none)
    kinds = rope_type if isinstance(rope_type, dict) else {None: rope_type}
    # the config the embedding reads itself (a composite model's is its text config's)
    params = getattr(getattr(rotary, "config", model.config), "rope_parameters", None) or {}
    found = []
    for layer_type, kind in kinds.items():
        kind = str(kind)
        if kind == "longrope":
            own = params.get(layer_type, params) if layer_type is not None else params
            found.append((kind, int(own["original_max_position_embeddings"])))
        elif "dynamic" in kind:
            found.append((kind, int(rotary.original_max_seq_len)))
    return min(found, key=lambda kind_positions: kind_positions[1], default=None)


def model_context(model: torch.nn.Module) -> tuple[int | None, bool]:
    """``(max_position_embeddings or None, learned)``: ``learned`` when the positions are
    a table of that many rows (GPT-2's ``wpe``): no sequence may run past it (past a
    rotary model's context the quality degrades; past a table the lookup fails)."""
    context = getattr(model.config, "max_position_embeddings", None)
    if not isinstance(context, int):
        return None, False
    words = model.get_input_embeddings()
    tables = (
        m
        for m in model.modules()
        if isinstance(m, torch.nn.Embedding) and m is not words
        and m.num_embeddings in (context, context + 2)  # (OPT's table has 2 more rows)
    )  # fmt: skip
    return context, next(tables, None) is not None


#: Files of which a Hugging Face tokenizer is loaded (one of them at least).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
    "spiece.model",
)  # fmt: skip


@contextmanager
def _no_load_report() -> Iterator[None]:
    """transformers' multi-line load report (missing or mismatched tensors) is left out:
    :func:`check_loaded_weights` says what matters in one line."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def check_loaded_weights(path: Path, info: dict[str, Any], *, warn: bool = True) -> None:
    """A weight the model has and the files lack (it would train from its random
    initialisation), or one of another shape than ``config.json`` makes, is one line.
    Tensors of the files the model has no place for (more layers than ``config.json``
    makes, another architecture's parts, a value head) are left out, as transformers
    does, with one warning line when ``warn`` (on rank 0 under torchrun)."""
    mismatched = sorted(info.get("mismatched_keys") or (), key=str)
    if mismatched:
        key, stored, made = mismatched[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise ValueError(
            f"model.path: {path}: {key} is {list(stored)} in the weight files but "
            f"{list(made)} in the model its config.json makes{more}; config.json does not "
            "describe these weights"
        )
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(
            f"model.path: {path}: the weight files lack {missing[0]}{more}, which the "
            "model its config.json makes needs (it would train from random values)"
        )
    unexpected = sorted(info.get("unexpected_keys") or ())
    if unexpected and warn and not not_rank_zero():
        named = ", ".join(unexpected[:3]) + (", ..." if len(unexpected) > 3 else "")
        print(
            f"gspo: warning: model.path: {path}: {len(unexpected)} tensor(s) of the weight "
            f"files have no place in the model its config.json makes ({named}): left out; "
            "if they are its own (more layers, another architecture), config.json is wrong",
            file=sys.stderr,
            flush=True,
        )


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def check_model_type(path: Path) -> None:
    """A ``config.json`` that is not JSON, or whose ``model_type`` this transformers does
    not know, is one line (transformers printed a warning line of its own before its
    error, or failed first on the tokenizer, which reads the file too)."""
    from transformers import CONFIG_MAPPING

    try:
        model_type = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"model.path: {path}/config.json is not whole JSON ({exc})") from None
    if isinstance(model_type, dict) and "auto_map" in model_type:  # (its own modelling code)
        return  # (transformers says it needs trust_remote_code, which gspo does not pass)
    model_type = model_type.get("model_type") if isinstance(model_type, dict) else None
    if isinstance(model_type, str) and model_type not in CONFIG_MAPPING:
        import transformers

        raise ValueError(
            f"model.path: {path}/config.json has model_type {model_type!r}, which transformers "
            f"{transformers.__version__} does not know (a misspelling, or a newer transformers)"
        )


def tokenizer_problem(path: Path, exc: BaseException) -> str:
    """What is wrong with the tokenizer files of ``path``, for the error ``exc`` loading
    them gave: the file that is not whole JSON, the vocabulary missing beside
    ``tokenizer_config.json`` (transformers' own line stopped at "from one of:")."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        try:
            json.loads((path / name).read_text(encoding="utf-8"))
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as bad:
            return f"{name} is not whole JSON ({bad})"
    if "instantiate the backend tokenizer" in str(exc):
        return (
            "no vocabulary beside its tokenizer_config.json (no tokenizer.json); save the "
            "tokenizer there whole (tokenizer.save_pretrained)"
        )
    return one_line(exc, 300) or type(exc).__name__


def damaged_safetensors(path: Path) -> str:
    """The first ``.safetensors`` file of ``path`` whose header safetensors cannot read
    (a model in shards named which one), else "a .safetensors file"."""
    from safetensors import safe_open

    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(file, "pt"):
                pass
        except (SafetensorError, OSError):
            return file.name
    return "a .safetensors file"


def check_token_ids(path: Path, tokenizer, model) -> None:
    """The ids gspo feeds the model itself (the pad, with which finished rows go on, and
    eos) must have a row in its embedding table, and there must be a pad (or an eos to
    stand in): one line each, where they failed inside the first generation. A tokenizer
    with more tokens than rows is a warning line (prompts holding those fail)."""
    rows = model.get_input_embeddings().num_embeddings
    if tokenizer.pad_token_id is None:
        raise ValueError(
            f"model.path: the tokenizer of {path} has no pad token and no eos token: gspo "
            "pads finished completions with one; set eos_token (or pad_token) in its "
            "tokenizer_config.json"
        )
    for role in ("pad", "eos"):
        token, ident = getattr(tokenizer, f"{role}_token"), getattr(tokenizer, f"{role}_token_id")
        if ident is not None and ident >= rows:
            raise ValueError(
                f"model.path: {path}: the tokenizer's {role} token {token!r} is id {ident}, "
                f"past the model's {rows}-row embedding table (a token added without "
                "model.resize_token_embeddings(len(tokenizer)) before saving)"
            )
    if len(tokenizer) > rows:
        print(
            f"gspo: warning: model.path: {path}: the tokenizer has {len(tokenizer)} tokens, the "
            f"embedding table {rows} rows: prompts holding ids {rows} and up cannot be read",
            file=sys.stderr,
            flush=True,
        )


def load_model(path: str | Path, *, device: torch.device, dtype: torch.dtype, warn: bool = True):
    """Load a local HF causal-LM directory (AutoModelForCausalLM + AutoTokenizer), or the
    one a checkpoint's :data:`MODEL_POINTER` names.

    Raises ``FileNotFoundError``/``ValueError`` with a one-line message naming the path;
    a checkpoint's model file whose bytes are not those written (its ``manifest.json``)
    is a :class:`gspo.publish.DamagedFile` naming it; running out of memory (reading it,
    moving it to ``device``) an :class:`gspo.models.memory.OutOfMemory` naming the path,
    the dtype, the device and what lowers it. Tensors of the files the model does not use
    are a warning line (:func:`check_loaded_weights`) unless ``warn`` is False.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    path = Path(path)
    if not path.is_dir():
        hub = re.fullmatch(r"[\w.-]+/[\w.-]+", str(path)) is not None  # (owner/name)
        if hub:
            hint = (
                "; gspo reads local model directories only (nothing is downloaded during a "
                f"run): download it first (hf download {path} --local-dir DIR), then "
                "model.path=DIR"
            )
        elif there := sorted(p.name for p in path.parent.glob("step-*") if p.is_dir()):
            hint = (  # (a step a run removed since: no download to advise)
                f": no such checkpoint ({path.parent} holds {', '.join(there)}; a run keeps "
                "its newest train.keep_checkpoints)"
            )
        elif not path.exists():  # (a recipe's /models/NAME, before its download)
            hint = (
                f": no such directory; download the model there (hf download ORG/NAME "
                f"--local-dir {path}) or set model.path to a local model directory"
            )
        else:
            hint = " (a file)"
        raise FileNotFoundError(f"model.path: {path} is not a directory{hint}")
    if model_files(path) != path:
        named, path = path, model_files(path)
        if not path.is_dir():
            raise FileNotFoundError(
                f"model.path: {named} is the model {path} (its {MODEL_POINTER}), "
                "which is not a directory"
            )
    if not (path / "config.json").is_file():
        if (path / "adapter_config.json").is_file():  # a LoRA run's checkpoint
            raise FileNotFoundError(
                f"model.path: {path} is a LoRA adapter, not a whole model: gspo export "
                f"{path} --merge OUT makes one (or gspo train --resume its run)"
            )
        if (path / "checkpoints").is_dir() and (path / "config.yaml").is_file():  # a run
            raise FileNotFoundError(
                f"model.path: {path} is a gspo run, not a model: name one of its checkpoints "
                f"({path}/checkpoints/step-N), or gspo export {path} --merge OUT"
            )
        raise FileNotFoundError(f"model.path: {path} has no config.json (not a HF model dir)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"model.path: {path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
            "save the model's tokenizer there too (tokenizer.save_pretrained)"
        )
    check_manifest(path, is_model_file)
    check_model_type(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(
            f"model.path: cannot load the tokenizer of {path}: {tokenizer_problem(path, exc)}"
        ) from exc
    try:
        with loading_model(path, dtype=dtype, device=device), _no_load_report():
            model, info = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, output_loading_info=True, ignore_mismatched_sizes=True
            )
    except (OSError, ValueError, KeyError, SafetensorError) as exc:
        if isinstance(exc, OutOfMemory):
            raise
        said = _first_line(exc)
        if isinstance(exc, SafetensorError):
            said = f"{damaged_safetensors(path)} is truncated or damaged ({said})"
        raise ValueError(f"model.path: cannot load {path}: {said}") from exc
    check_loaded_weights(path, info, warn=warn)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
        setattr(tokenizer, PAD_FROM_EOS, True)
    check_token_ids(path, tokenizer, model)
    tokenizer.padding_side = "left"
    with loading_model(path, dtype=dtype, device=device):
        model.to(device)
    model.config.use_cache = True
    return model, tokenizer
