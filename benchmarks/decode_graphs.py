"""Decode speed of the torch engine with ``rollout.cuda_graphs`` off and on, and how far a
step is from the memory-bandwidth floor (the ``decode`` stage of ``gpu_check.py``).

    PYTHONPATH=src python benchmarks/decode_graphs.py --work DIR [--tokens 512] [--device cuda]

``DIR`` is a workload folder (``workload.build``: ``model/`` and ``train.jsonl``). Its first
16 prompts, 8 responses each (128 rows, as ``vs_trl.py``), ``--tokens`` new tokens at
temperature 1, under bf16 autocast on CUDA (as the trainer samples) and in float32 on the
CPU, three ways: ``loop`` (``rollout.cuda_graphs=false``: the per-step Python loop),
``static eager`` (the static-shape step, not captured) and ``graphs`` (the static step
replayed as CUDA graphs; on the CPU it is the eager static step again). Each is one
``generate`` call after a short warm-up call, timed with CUDA events: ms per step is the
whole call (prefill included) over its decode steps. ``graphs`` is timed at its second
call of the same shapes (graphs kept from the first, as for every rollout batch after a
run's first); the first call's seconds, captures included, are reported beside it.

The model's head precision is what a run's ``model.head_precision=auto`` gives (bf16
weight on CUDA, float32 on the CPU). The floor: one step must read every matrix of the
step once (in the compute dtype; the head in the dtype the sampler computes it in) and
the keys and values of every row up to its current length (at the mean length of the
call); over the device's measured copy bandwidth, that is the fastest a step can be. The
fraction reported is floor / measured.

On CUDA it then times the single-query attention's other ways (:data:`ATTENTION_WAYS`:
SDPA as torch picks its kernel, over the loop's spans of 64 key columns or over keys
growing by one a step, SDPA with cuDNN's backend off, the memory-efficient kernel called
by name (``KVDecoder.sdpa_kernel``), the batched products) in the loop at up to 128
tokens and in the graphs, and profiles the static step
(:func:`step_kernels`): its device time per step by kernel family (attention, matrix
products, sampling, copies, the rest), to say which lever the step's time waits on,
and times the graphs with ``rollout.compile`` (the per-layer work compiled by inductor).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch

PROMPTS, GROUP = 16, 8


def copy_bandwidth(device: torch.device, megabytes: int = 1024, reps: int = 10) -> float:
    """Bytes/s a device-to-device copy moves (read + written), after one warm-up copy."""
    source = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    elapsed = timed(device, lambda: [target.copy_(source) for _ in range(reps)])
    return 2 * source.numel() * reps / elapsed


def timed(device: torch.device, fn) -> float:
    """Seconds ``fn()`` takes: CUDA events on a GPU, the wall clock elsewhere."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / 1e3


def step_bytes(model, dtype: torch.dtype, rows: int, columns: float) -> dict[str, float]:
    """Bytes one decode step must read: the fast decoder's matrices in ``dtype`` (the
    head as the decoder holds it) and the keys and values of ``rows`` rows over
    ``columns`` columns."""
    from gspo.engines.decoding import KVDecoder

    with autocast(model, dtype):
        decoder = KVDecoder(model)
    size = torch.tensor([], dtype=dtype).element_size()
    matrices = 0
    for layer in decoder.layers:
        matrices += layer.qkv.numel() + layer.o.numel()
        mlp = layer.mlp_weights or [
            getattr(layer.mlp, n).weight for n in ("gate_proj", "up_proj", "down_proj")
        ]
        matrices += sum(m.numel() for m in mlp)
    weights = matrices * size + decoder.head.numel() * decoder.head.element_size()
    kv = 2 * len(decoder.layers) * rows * decoder.kv_heads * decoder.head_dim * columns * size
    return {"weights": weights, "kv": kv}


def autocast(model, dtype: torch.dtype):
    device = next(model.parameters()).device.type
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device, dtype=dtype)


def measure(
    model,
    tokenizer,
    prompts,
    *,
    tokens: int,
    dtype: torch.dtype,
    way: str,
    around=None,
    compile: bool = False,
    warmup: int = 16,
) -> dict:
    """One timed ``generate`` of ``way`` (``loop``, ``static eager``, ``graphs``) after a
    warm-up call of ``warmup`` tokens: seconds, decode steps, completion tokens. For ``graphs`` the
    timed call is the second of the same shapes (what every rollout batch after the first
    is: the engine keeps its graphs), and ``first seconds`` is the first, which captures.
    ``around``: a context manager the timed call runs in (a profiler); ``compile``:
    ``rollout.compile`` (compiled at the warm-up and, for new batch sizes, the first call)."""
    from gspo.engines import SamplingParams, TorchEngine
    from gspo.engines.static_decode import StaticDecoder

    device = next(model.parameters()).device
    engine = TorchEngine(
        model,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        cuda_graphs=way != "loop",
        compile=compile,
    )
    capture = StaticDecoder.capture
    StaticDecoder.capture = way == "graphs"
    try:
        with torch.no_grad(), autocast(model, dtype):
            params = SamplingParams(max_new_tokens=warmup, temperature=1.0)
            engine.generate(prompts, n=GROUP, params=params, seed=0)
            params = SamplingParams(max_new_tokens=tokens, temperature=1.0)
            out = {}
            first = None
            if way == "graphs":
                first = timed(
                    device, lambda: engine.generate(prompts, n=GROUP, params=params, seed=2)
                )
            with around or contextlib.nullcontext():
                seconds = timed(
                    device,
                    lambda: out.update(b=engine.generate(prompts, n=GROUP, params=params, seed=1)),
                )
    finally:
        StaticDecoder.capture = capture
    batch = out["b"]
    return {
        "seconds": seconds,
        "first seconds": first,
        "steps": int(batch.completion_lengths.max()),
        "tokens": int(batch.completion_mask.sum()),
        "prompt columns": batch.prompt_ids.shape[1],
    }


def ms_per_step(m: dict) -> float:
    """A :func:`measure`'s milliseconds per decode step (the prefill included)."""
    return 1e3 * m["seconds"] / m["steps"]


def compare(
    work: Path, *, device: str = "cuda", tokens: int = 512, limit: float | None = None
) -> dict[str, float | str]:
    """The figures of the three ways on ``work``'s model (see the module docstring); the
    CUDA-only measurements after them only while ``limit`` seconds have not passed."""
    begin = time.perf_counter()
    from gspo.config import load_config
    from gspo.models import load_model
    from gspo.models.kernels import set_linear_kernel
    from gspo.training.setup import head_precision

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model, tokenizer = load_model(work / "model", device=dev, dtype=torch.float32)
    head = head_precision(load_config(None, []), dev, dtype)  # as a run's default
    set_linear_kernel(model, "onednn", head)
    lines = (work / "train.jsonl").read_text().splitlines()[:PROMPTS]
    prompts = [tokenizer(json.loads(x)["prompt"])["input_ids"] for x in lines]
    bandwidth = copy_bandwidth(dev)
    figures: dict[str, float | str] = {
        "rows x new tokens": f"{PROMPTS * GROUP} x {tokens}",
        "head precision": head,
        "copy bandwidth GB/s": round(bandwidth / 1e9, 1),
    }
    ms = {}
    for way in ("loop", "static eager", "graphs"):
        m = measure(model, tokenizer, prompts, tokens=tokens, dtype=dtype, way=way)
        ms[way] = ms_per_step(m)
        figures[f"{way}: tokens/s"] = round(m["tokens"] / m["seconds"])
        figures[f"{way}: ms per step"] = round(ms[way], 2)
        if m["first seconds"] is not None:  # the first rollout batch: graphs captured
            figures[f"{way}: first generation s (captures) / next s"] = (
                f"{m['first seconds']:.2f} / {m['seconds']:.2f}"
            )
        mean_columns = m["prompt columns"] + m["steps"] / 2
    need = step_bytes(model, dtype, PROMPTS * GROUP, mean_columns)
    floor_ms = 1e3 * (need["weights"] + need["kv"]) / bandwidth
    figures["bytes per step: weights / KV (GB)"] = (
        f"{need['weights'] / 1e9:.2f} / {need['kv'] / 1e9:.2f}"
    )
    figures["floor ms per step"] = float(f"{floor_ms:.3g}")
    for way, value in ms.items():
        figures[f"{way}: fraction of the floor"] = float(f"{floor_ms / value:.3g}")
    figures["graphs vs loop speed-up"] = round(ms["loop"] / ms["graphs"], 2)
    if dev.type == "cuda":  # each apart: one failing (no Triton, say) keeps the others
        short = min(tokens, 128)
        extras = {  # the graphs' levers first (the 30k target), the quick ones before
            "graphs attention": lambda: attention_ways(
                model, tokenizer, prompts, dtype, tokens, "graphs"
            ),
            "graphs step kernels": lambda: step_kernels(model, tokenizer, prompts, dtype, short),
            "graphs, compiled layers": lambda: compiled_graphs(
                model, tokenizer, prompts, dtype, tokens
            ),
            "loop attention": lambda: attention_ways(
                model, tokenizer, prompts, dtype, short, "loop"
            ),
        }
        for label, extra in extras.items():
            spent = time.perf_counter() - begin
            if limit is not None and spent > limit:
                figures[f"{label}: not run"] = f"the stage's {limit:.0f} s were spent"
                continue
            try:
                figures.update(extra())
            except Exception as exc:  # (reported in the stage, not raised)
                text = " ".join(f"{type(exc).__name__}: {exc}".split())
                figures[f"{label}: error"] = text[:300]
    return figures


def compiled_graphs(model, tokenizer, prompts, dtype, tokens: int) -> dict[str, float | str]:
    """The graphs with ``rollout.compile``: tokens/s, ms per step, and the first
    generation's seconds (compiles and captures) beside the next's."""
    m = measure(model, tokenizer, prompts, tokens=tokens, dtype=dtype, way="graphs",
                compile=True)  # fmt: skip
    return {
        "graphs, compiled layers (rollout.compile): tokens/s": round(m["tokens"] / m["seconds"]),
        "graphs, compiled layers: ms per step": round(ms_per_step(m), 2),
        "graphs, compiled layers: first generation s (compiles, captures) / next s": (
            f"{m['first seconds']:.2f} / {m['seconds']:.2f}"
        ),
    }


#: Single-query attention as a step may run it: (``KVDecoder.attention``, cuDNN's SDPA
#: backend on, ``KVDecoder.key_span``: the loop's, None its default,
#: ``KVDecoder.sdpa_kernel``: "sdpa" torch's pick), by label.
ATTENTION_WAYS = {
    "SDPA": ("sdpa", True, None, "sdpa"),
    "SDPA, keys growing by one": ("sdpa", True, 1, "sdpa"),
    "SDPA, cuDNN off": ("sdpa", False, None, "sdpa"),
    "SDPA, cuDNN off, keys growing by one": ("sdpa", False, 1, "sdpa"),
    "efficient kernel by name": ("sdpa", True, None, "efficient"),
    "products": ("products", True, None, None),
}


def attention_ways(
    model, tokenizer, prompts, dtype, tokens: int, way: str
) -> dict[str, float | str]:
    """``way``'s ms per step, ``tokens`` new tokens, by its single-query attention
    (:data:`ATTENTION_WAYS`; for ``graphs`` the first, the default, is timed by
    :func:`compare`, as is the loop's default, ``gspo.engines.decoding.LOOP_SDPA_KERNEL``).
    The loop's key length, hence SDPA's shape, grows every step: on an H200 at 887befd its
    128-token step took 65.3 ms with SDPA, 14.3 with cuDNN's backend off, 15.8 with the
    products; the graphs fix their shapes at capture, and their SDPA (cuDNN's kernel) took
    up to 1.5 of their 4.9 ms a step there (by the profiled batch's table, the training
    forwards' calls of that kernel among them). The loop's SDPA runs over spans of 64 key
    columns since (``KVDecoder.key_span``), timed against keys growing by one; the graphs
    have spans of their own. The loop's ways are timed after a warm-up of as many tokens, so
    that the timed call meets shapes already met (at 9891430 the warm-up was 16 tokens, and
    cuDNN's 35.37 ms a step against 22.06 by name may be its plans for new shapes, which it
    keeps)."""
    from gspo.engines.decoding import KVDecoder

    figures: dict[str, float | str] = {}
    for label, (attention, cudnn, span, kernel) in ATTENTION_WAYS.items():
        if way == "graphs" and (label == "SDPA" or span is not None):
            continue
        kept = (KVDecoder.attention, KVDecoder.key_span, KVDecoder.sdpa_kernel)
        cudnn_kept = torch.backends.cuda.cudnn_sdp_enabled()
        KVDecoder.attention, KVDecoder.key_span, KVDecoder.sdpa_kernel = attention, span, kernel
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        try:
            warmup = tokens if way == "loop" else 16  # (the graphs' shapes are fixed)
            m = measure(
                model, tokenizer, prompts, tokens=tokens, dtype=dtype, way=way, warmup=warmup
            )
        except Exception as exc:  # (one way failing, the kernel by name say, keeps the rest)
            said = f"{type(exc).__name__}: {exc}"[:300]
            figures[f"{way}, {tokens} tokens, {label}: failed"] = said
            continue
        finally:
            KVDecoder.attention, KVDecoder.key_span, KVDecoder.sdpa_kernel = kept
            torch.backends.cuda.enable_cudnn_sdp(cudnn_kept)
        figures[f"{way}, {tokens} tokens, {label}: ms per step"] = round(ms_per_step(m), 2)
    return figures


#: Kernel families of a decoding step, by a piece of the kernel's name (the first that
#: matches; case-insensitive); the rest are elementwise kernels, reductions and the like.
KERNEL_FAMILIES = {
    "attention": ("sdpa", "fmha", "flash", "attention", "attn"),
    "matrix products": ("gemm", "gemv", "nvjet", "cutlass", "xmma", "splitk"),
    "sampling (sort, scan, search)": ("scan", "sort", "search"),
    "copies, fills": ("memcpy", "memset", "copy_kernel"),
}


def kernel_families(totals: dict[str, list[float]], steps: int) -> dict[str, float]:
    """``device_totals``' kernels as ms per step by :data:`KERNEL_FAMILIES` (and ``other``)."""
    ms = dict.fromkeys([*KERNEL_FAMILIES, "other"], 0.0)
    for name, (_, us) in totals.items():
        low = name.lower()
        family = next((f for f, keys in KERNEL_FAMILIES.items() if any(k in low for k in keys)),
                      "other")  # fmt: skip
        ms[family] += us / 1e3 / steps
    return ms


def step_kernels(model, tokenizer, prompts, dtype, tokens: int) -> dict[str, float | str]:
    """Where a graphs step's device time goes: one ``static eager`` call (the captured
    step's kernels, launched one by one, so the profiler sees each whatever it records of
    a graph), ``tokens`` new tokens, under the profiler: its kernels' device time as ms
    per step, all of it, by family and the three costliest by name (the prefill's and the
    first token's kernels included, spread over the steps)."""
    import gzip
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from gspo.telemetry.profiling import device_totals

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    m = measure(
        model, tokenizer, prompts, tokens=tokens, dtype=dtype, way="static eager", around=prof
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json.gz"
        prof.export_chrome_trace(str(path))
        totals = device_totals(json.loads(gzip.decompress(path.read_bytes())))
    steps = m["steps"]
    families = kernel_families(totals, steps)
    figures: dict[str, float | str] = {
        "graphs step, all kernels: ms": round(sum(families.values()), 3)
    }
    for family, ms in families.items():
        figures[f"graphs step, {family}: ms"] = round(ms, 3)
    top = sorted(totals.items(), key=lambda kv: -kv[1][1])[:3]
    for i, (name, (calls, us)) in enumerate(top, 1):
        short = name if len(name) <= 60 else name[:57] + "..."
        figures[f"graphs step, kernel {i}: ms, calls"] = (
            f"{us / 1e3 / steps:.3f}, {calls / steps:.0f}: {short}"
        )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    for key, value in compare(args.work, device=args.device, tokens=args.tokens).items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
