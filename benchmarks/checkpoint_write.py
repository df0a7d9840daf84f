"""Where a checkpoint's write goes: a Qwen3-0.6B's weights and AdamW state (7.15 GB).

    .venv/bin/python benchmarks/checkpoint_write.py [--device cuda] [--layers 28] [--dir DIR]

A gspo checkpoint of a full fine-tuning run is the model's weights in Hugging Face
safetensors files (``save_pretrained``) and the optimizer's state (AdamW's two moments,
twice the weights' bytes) through ``torch.distributed.checkpoint`` (``sharded/``). On one
H200 the ~0.5B model's final checkpoint (6.1 GB) took 13.9 s to write, a third of the whole
run. This times each part on float32 tensors of Qwen3-0.6B's shapes (28 layers, hidden
1,024, intermediate 3,072, vocabulary 151,936, heads of 128: 596M parameters, a little more
than that model's 508M, whose heads are of 64), from ``--device`` memory as the final
checkpoint writes them: the safetensors file, and the DCP write as gspo called it before
2026-11-27 (one thread, every file synced), with ``thread_count`` and ``sync_files``
settings, and as gspo calls it now (8 threads, not synced), and the bare disk (the same
bytes from memory, synced). The writes go under ``--dir`` (default: a temporary directory
beside the runs), each removed after it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch


def shapes(layers: int, hidden: int = 1024, intermediate: int = 3072, vocab: int = 151936):
    """The weight shapes of a Qwen3 of these sizes (16 query / 8 key-value heads of 128)."""
    q, kv = 16 * 128, 8 * 128
    out = {"embed": (vocab, hidden), "norm": (hidden,)}
    for i in range(layers):
        for name, shape in (
            ("q", (q, hidden)), ("k", (kv, hidden)), ("v", (kv, hidden)), ("o", (hidden, q)),
            ("gate", (intermediate, hidden)), ("up", (intermediate, hidden)),
            ("down", (hidden, intermediate)), ("in_norm", (hidden,)), ("post_norm", (hidden,)),
        ):  # fmt: skip
            out[f"layers.{i}.{name}"] = shape
    return out


def timed(what: str, fn, where: Path, nbytes: int) -> None:
    where.mkdir(parents=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn(where)
    seconds = time.perf_counter() - start
    shutil.rmtree(where)
    print(f"| {what} | {nbytes / 1e9:.2f} | {seconds:.2f} | {nbytes / seconds / 1e9:.2f} |")


def synced_bytes(where: Path, tensors: dict[str, torch.Tensor]) -> None:
    """The tensors' bytes (already on the CPU) written and synced: the disk's own pace."""
    with (where / "raw").open("wb") as f:
        for t in tensors.values():
            f.write(t.numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--threads", type=int, nargs="*", default=[2, 4, 8, 16])
    args = parser.parse_args()
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from gspo.sharded import WRITE_THREADS

    generator = torch.Generator().manual_seed(0)
    weights = {
        k: torch.randn(s, generator=generator).to(args.device)
        for k, s in shapes(args.layers).items()
    }
    moments = {f"{k}.{m}": v.clone() for k, v in weights.items() for m in ("exp_avg", "sq")}
    w_bytes = sum(t.numel() * 4 for t in weights.values())
    m_bytes = 2 * w_bytes
    root = Path(tempfile.mkdtemp(prefix="ckpt_write_", dir=args.dir))
    print(f"device {args.device}, {args.layers} layers, under {root}\n")
    print("| write | GB | s | GB/s |\n|---|---|---|---|")
    try:

        def safetensors_file(where: Path) -> None:
            save_file({k: v.contiguous() for k, v in weights.items()}, str(where / "w.safetensors"))

        timed(
            "weights, safetensors (save_pretrained's file)", safetensors_file, root / "a", w_bytes
        )
        for label, writer in (
            ("AdamW state, DCP, 1 thread, synced (gspo before 2026-11-27)", {}),
            *((f"AdamW state, DCP, {n} threads, synced", {"thread_count": n})
              for n in args.threads),
            ("AdamW state, DCP, 1 thread, not synced", {"sync_files": False}),
            (f"AdamW state, DCP, {WRITE_THREADS} threads, not synced (gspo now)",
             {"thread_count": WRITE_THREADS, "sync_files": False}),
        ):  # fmt: skip
            timed(
                label,
                lambda w, kw=writer: dcp.save(
                    moments, storage_writer=dcp.FileSystemWriter(str(w), **kw), no_dist=True
                ),
                root / "b", m_bytes,
            )  # fmt: skip
        cpu = {k: v.cpu() for k, v in moments.items()}
        timed("the AdamW state's bytes from CPU memory, synced (the disk)",
              lambda w: synced_bytes(w, cpu), root / "c", m_bytes)  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
