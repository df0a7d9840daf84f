"""MoE experts on the CPU: transformers' eager loop vs ``model.experts_implementation=padded``.

    python benchmarks/moe_experts.py [--experts 8 128] [--reps 3]

Forward + backward of 512 tokens (4 rows x 128) through a built-in Qwen3-MoE (4 layers,
hidden 256, top-8 of the given number of experts, expert width 96, as in docs/moe.md's
Qwen3-30B-A3B-like example; random weights with the routers spread so that tokens use
many experts), with the experts computed by transformers' loop over experts and by
:func:`gspo.moe.padded_experts_forward` (three batched products). The two run
interleaved (eager, padded, eager, ...); medians in seconds.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from levers import interleaved_times  # noqa: E402

from gspo.models import TinyModelSpec, build_char_tokenizer, build_tiny_model  # noqa: E402
from gspo.moe import find_routers, use_padded_experts  # noqa: E402
from gspo.provenance import measured_at  # noqa: E402


def fwd_bwd(model: torch.nn.Module, ids: torch.Tensor) -> Callable[[], object]:
    def run() -> None:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids).logits.square().mean().backward()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 128])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    print(measured_at(), flush=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    tokenizer = build_char_tokenizer()
    ids = torch.randint(4, len(tokenizer), (4, 128), generator=torch.Generator().manual_seed(0))
    print(
        "\n| experts (top-8) | transformers' default | its time s | eager loop s | padded s |"
        "\n|---|---|---|---|---|"
    )
    for experts in args.experts:
        spec = TinyModelSpec(
            architecture="qwen3_moe", experts=experts, experts_per_token=8, expert_intermediate=96
        )
        eager = build_tiny_model(spec, tokenizer, seed=0)
        with torch.no_grad():  # spread the tokens over the experts
            for router in find_routers(eager):
                router.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
        default = copy.deepcopy(eager)
        eager.set_experts_implementation("eager")
        padded = copy.deepcopy(eager)
        use_padded_experts(padded)
        models = {"default": default, "eager": eager, "padded": padded}
        times = interleaved_times({k: fwd_bwd(m, ids) for k, m in models.items()}, args.reps)
        d, e, p = (statistics.median(times[k]) for k in models)
        name = default.config._experts_implementation
        print(f"| {experts} | {name} | {d:.2f} | {e:.2f} | {p:.2f} |", flush=True)


if __name__ == "__main__":
    main()
