"""Peak memory of per-token log-probs + GSPO loss + backward at Qwen3's vocabulary.

    python benchmarks/logprob_memory.py [--tokens 8x2048] [--naive-tokens 8x512]

Compares gspo's chunked projection (also with ``train/entropy`` and an entropy bonus computed
in the same chunks, variant ``entropy``) (`gspo.models.logprobs_from_hidden`: the vocabulary
projection runs ``LOGPROB_CHUNK`` tokens at a time and each chunk is recomputed in backward)
with the naive path (full float32 logits, ``log_softmax``, ``gather``), and the chunked path
with the product on oneDNN (variant ``onednn``: ``model.cpu_linear=onednn``, what the
trainer uses on x86 CPUs), with each variant's seconds. Each measurement is a
fresh process; memory is the growth of peak RSS over the process's RSS once the inputs
(hidden states, LM-head weight) exist. Hidden size 1,024 (Qwen3-0.6B), vocabulary 151,936.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child import run_child

V, H = 151_936, 1024


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure(variant: str, n: int, t: int) -> dict:
    import torch

    from gspo.models import LOGPROB_CHUNK, logprobs_from_hidden
    from gspo.objectives import policy_loss

    torch.manual_seed(0)
    hidden = (torch.randn(n, t, H) * 0.02).requires_grad_()
    weight = (torch.randn(V, H) * 0.02).requires_grad_()
    ids = torch.randint(0, V, (n, t))
    old = torch.zeros(n, t) - 12.0
    advantages = torch.randn(n)
    mask = torch.ones(n, t, dtype=torch.bool)
    base = rss_mb()
    start = time.perf_counter()
    entropy = None
    if variant == "naive":
        logits = (hidden @ weight.T).float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    elif variant == "entropy":
        logprobs, entropy = logprobs_from_hidden(
            hidden, weight, ids, 1.0, LOGPROB_CHUNK, with_entropy=True
        )
    elif variant == "onednn":  # the product on oneDNN, as gspo's trainer on a CPU
        from gspo.models.kernels import onednn_linear

        logprobs = logprobs_from_hidden(
            hidden, weight, ids, 1.0, LOGPROB_CHUNK, linear=onednn_linear
        )
    else:
        logprobs = logprobs_from_hidden(hidden, weight, ids, 1.0, LOGPROB_CHUNK)
    coef = 0.0 if entropy is None else 0.01
    loss = policy_loss(logprobs, old, advantages, mask, entropy=entropy, entropy_coef=coef).loss
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
    return {
        "variant": variant,
        "tokens": f"{n}x{t}",
        "peak_over_inputs_mb": peak - base,
        "seconds": time.perf_counter() - start,
        "logprobs_head": logprobs[0, :4].tolist(),
        "grad_hidden_head": hidden.grad[0, 0, :4].tolist(),
    }


def check_values(n: int = 2, t: int = 256) -> float:
    """Max |difference| of log-probs and gradients between the two paths (small size)."""
    import torch

    from gspo.models import logprobs_from_hidden

    torch.manual_seed(1)
    hidden = (torch.randn(n, t, H) * 0.02).requires_grad_()
    weight = (torch.randn(V, H) * 0.02).requires_grad_()
    ids = torch.randint(0, V, (n, t))
    ours = logprobs_from_hidden(hidden, weight, ids, 1.0, 100)
    g_ours = torch.autograd.grad(ours.sum(), hidden)[0]
    naive = torch.log_softmax(hidden @ weight.T, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    g_naive = torch.autograd.grad(naive.sum(), hidden)[0]
    return max((ours - naive).abs().max().item(), (g_ours - g_naive).abs().max().item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="8x2048", help="N x T for the chunked path")
    parser.add_argument("--naive-tokens", default="8x512", help="N x T that fits naively")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        n, t = map(int, args.child[1].split("x"))
        print(json.dumps(measure(args.child[0], n, t)))
        return
    print(f"max |delta| log-prob or gradient, chunked vs naive (2x256): {check_values():.2e}")
    results = [
        run_child(__file__, ["--child", "naive", args.naive_tokens]),
        run_child(__file__, ["--child", "chunked", args.naive_tokens]),
        run_child(__file__, ["--child", "chunked", args.tokens]),
        run_child(__file__, ["--child", "entropy", args.naive_tokens]),
        run_child(__file__, ["--child", "entropy", args.tokens]),
        run_child(__file__, ["--child", "onednn", args.naive_tokens]),
    ]
    for r in results:
        peak, seconds = r["peak_over_inputs_mb"], r["seconds"]
        print(
            f"{r['variant']:8s} {r['tokens']:>8s}: peak {peak:8.0f} MB over inputs, "
            f"forward + loss + backward {seconds:.1f} s"
        )
    naive, same = results[0], results[1]
    for entropy, plain in ((results[3], results[1]), (results[4], results[2])):
        print(
            f"with entropy (bonus 0.01) at {entropy['tokens']}: "
            f"{entropy['peak_over_inputs_mb']:.0f} MB vs {plain['peak_over_inputs_mb']:.0f} MB "
            "without"
        )
    ratio = same["peak_over_inputs_mb"] / naive["peak_over_inputs_mb"]
    print(f"chunked / naive at {naive['tokens']}: {ratio:.3f}")
    n, t = map(int, args.tokens.split("x"))
    naive_n, naive_t = map(int, args.naive_tokens.split("x"))
    scale = n * t / (naive_n * naive_t)
    print(
        f"naive at {args.tokens} (linear extrapolation, does not fit in 24 GB): "
        f"{naive['peak_over_inputs_mb'] * scale:.0f} MB; chunked measured there: "
        f"{results[2]['peak_over_inputs_mb']:.0f} MB "
        f"({results[2]['peak_over_inputs_mb'] / (naive['peak_over_inputs_mb'] * scale):.3f} of it)"
    )


if __name__ == "__main__":
    main()
