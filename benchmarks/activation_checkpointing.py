"""Peak memory and time of one policy update with ``model.activation_checkpointing`` off / on.

    python benchmarks/activation_checkpointing.py [--responses 4] [--tokens 512]
        [--layers 8] [--hidden 256] [--intermediate 768]

One update as the trainer takes it (:class:`gspo.training.policy.Policy`: the packed
training forward with entropies, the GSPO loss, backward) of a built-in Qwen3 on
``--responses`` responses of ``--tokens`` tokens each (a 32-token prompt included), float32
on the CPU. Each setting runs in a fresh process: one warm-up update on a short batch, then
the measured one. Memory is the growth of peak RSS over the RSS once the model and the
batch exist (the peak is reset first, ``/proc/self/clear_refs``). Seconds: after its
measured update the second process takes ``--repeats`` more with each setting in turn
(switched on the same model) and keeps each one's fastest. The loss and the gradient norm
of both settings are printed: they must agree.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child import run_child

PROMPT = 32


def memory_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(on: bool, args: argparse.Namespace) -> dict:
    import torch

    from gspo.config import load_config
    from gspo.distributed import Distributed
    from gspo.engines import RolloutBatch
    from gspo.objectives import policy_loss
    from gspo.training.policy import Policy
    from gspo.training.setup import build_policy_model

    overrides = [
        "model.device=cpu",
        f"model.layers={args.layers}",
        f"model.hidden={args.hidden}",
        f"model.intermediate={args.intermediate}",
        f"model.activation_checkpointing={str(on).lower()}",
    ]
    config = load_config(None, overrides)
    with tempfile.TemporaryDirectory() as out:
        model, _, _ = build_policy_model(
            config, Path(out), torch.device("cpu"), Distributed(), None, torch.float32
        )
    policy = Policy(model, Distributed(), compute_dtype=torch.float32, temperature=1.0)
    policy.train()

    def batch(n: int, t: int) -> RolloutBatch:
        g = torch.Generator().manual_seed(0)
        return RolloutBatch(
            prompt_ids=torch.randint(3, 60, (n, PROMPT), generator=g),
            prompt_mask=torch.ones(n, PROMPT, dtype=torch.bool),
            completion_ids=torch.randint(3, 60, (n, t), generator=g),
            completion_mask=torch.ones(n, t, dtype=torch.bool),
            sampler_logprobs=torch.zeros(n, t),
            finish_reasons=["length"] * n,
            group_size=n,
        )

    def update(b: RolloutBatch) -> tuple[float, float]:
        logprobs, entropy = policy.logprobs(b, with_entropy=True)
        old = logprobs.detach() - 0.01
        advantages = torch.linspace(-1.0, 1.0, len(b))
        loss = policy_loss(
            logprobs, old, advantages, b.completion_mask, entropy=entropy, entropy_coef=0.01
        ).loss
        policy.backward(loss, len(b))
        norm = torch.sqrt(sum((p.grad**2).sum() for p in policy.parameters()))
        policy.module.zero_grad(set_to_none=True)
        return float(loss.detach()), float(norm)

    update(batch(2, 32))  # warm-up: one-time costs (kernels, allocator) out of the figures
    measured = batch(args.responses, args.tokens - PROMPT)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    base = memory_kb("VmRSS")
    loss, norm = update(measured)
    peak = (memory_kb("VmHWM") - base) / 1024
    seconds = alternate(model, lambda: update(measured), args.repeats) if on else None
    return {
        "on": on,
        "peak_over_base_mb": peak,
        "loss": loss,
        "grad_norm": norm,
        "seconds": seconds,
    }


def alternate(model, update, repeats: int) -> dict[str, float]:
    """The fastest of ``repeats`` updates with checkpointing off and on, taken in turn in
    one process (so that other load on the machine hits both alike)."""
    from gspo.training.blocks import enable_activation_checkpointing

    best = {"off": float("inf"), "on": float("inf")}
    for _ in range(repeats):
        for setting in ("off", "on"):
            if setting == "on":
                enable_activation_checkpointing(model)
            else:
                disable = getattr(model, "activation_checkpointing_disable", None)
                (disable or model.gradient_checkpointing_disable)()
            start = time.perf_counter()
            update()
            best[setting] = min(best[setting], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--responses", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512, help="per response, prompt included")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=2, help="timed updates per setting")
    parser.add_argument("--child", choices=["off", "on"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child == "on", args)))
        return
    argv = sys.argv[1:]
    off, on = (
        run_child(__file__, ["--child", "off", *argv]),
        run_child(__file__, ["--child", "on", *argv]),
    )
    seconds = on["seconds"]
    print(
        f"built-in qwen3 {args.layers} x {args.hidden} (MLP {args.intermediate}), "
        f"{args.responses} responses x {args.tokens} tokens, one update, float32 CPU"
    )
    for r, name in ((off, "off"), (on, "on")):
        print(
            f"activation_checkpointing={str(r['on']).lower():5s}: peak "
            f"{r['peak_over_base_mb']:5.0f} MB over the model and batch, "
            f"{seconds[name]:.2f} s (fastest of {args.repeats}), loss {r['loss']:.6f}, "
            f"grad norm {r['grad_norm']:.6f}"
        )
    print(
        f"on / off: memory {on['peak_over_base_mb'] / off['peak_over_base_mb']:.2f}, "
        f"time {seconds['on'] / seconds['off']:.2f}"
    )


if __name__ == "__main__":
    main()
