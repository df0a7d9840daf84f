"""Micro-benchmarks behind the long-response speed choices (float32, CPU), interleaved.

    python benchmarks/long_levers.py [--reps 3] [--baseline 190be02] [--only gen,drop,layout]

On the long workload of ``vs_trl.py --long`` (the reference model with a 520-token
vocabulary, so completions run to ``max_new_tokens``), 16 prompts x 8 responses:

- gen: one rollout batch at 256 new tokens by ``TorchEngine`` as of the git revision
  ``--baseline`` (loaded from ``git show``), with the transformers forward
  (``fast=False``, the reference decoder), and with the fast decoder (``KVDecoder``)
  with either attention kernel (``KVDecoder.attention``), and with its linear layers on
  oneDNN (``model.cpu_linear``, the default of ``gspo train`` on the CPU);
  generated tokens/s and the share of this machine's float32 matmul peak they reach
  (2 x the weights per token, attention not counted). Then the floor of such a batch on
  this machine: its weight products at the matmul peak plus reading the key/value cache
  of every unfinished row at every step at the memory bandwidth (``decode_floor``).
- attn: one layer's single-query attention at batch 128, 206 cached tokens, the
  reference model's heads (4 query / 2 key-value, head_dim 64): ``scaled_dot_product_
  attention`` on [rows, kv heads, columns, head_dim] views of the buffers (the
  transformers layout) vs ``KVDecoder``'s batched products over transposed keys.
- check: the fast decoder reading which rows finished every step vs every 8 (default).
- drop: the fast decoder with finished rows leaving the batch and KV cache at every check
  where any row has finished (``gspo.engines.torch_engine.DROP_FRACTION = 0``, the default), once a
  quarter of the batch has, and never.
- train: ``gspo train`` on the long workload at 256 new tokens (``vs_trl.py --long``'s
  gspo side, 8 optimizer steps), once with this tree's code and once with the
  ``--baseline`` revision's (``git archive`` into a temporary folder, on ``PYTHONPATH``),
  alternating: whole process, ``time/generate`` per rollout batch, ``time/train`` per
  minibatch, from each run's ``metrics.jsonl``.
- linear: float32 linear layers on torch's default (``F.linear``, MKL) vs oneDNN
  (``gspo.models.kernels``, ``model.cpu_linear``): the products of a decoding step and of a
  training minibatch (forward, input gradient, weight gradient), then one rollout batch
  and one minibatch's forward + backward of the model with its layers on either.
- profile: where one rollout batch's time goes with the linear layers on oneDNN (torch
  profiler, self CPU time): the linear products, the single-query attention products
  (``bmm``/``baddbmm``) and everything else.
- layout: forward + backward of a training minibatch (32 completions drawn at random
  from a rollout batch, as the trainer draws them) with each group's prompt shared
  (one segment per group), not shared, and ``"auto"`` (the cheaper by estimate): on the
  long workload at 256 new tokens and on the reference workload (17 tokens, 32 new).

Variants run round-robin (A, B, C, A, B, C, ...), so drift in the machine's speed hits
all alike; figures are medians.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import workload  # noqa: E402
from levers import interleaved_times  # noqa: E402
from vs_trl import (  # noqa: E402
    LONG,
    flops_per_token,
    gspo_summary,
    matmul_peak,
    model_config,
    run_gspo,
)

from gspo.chat import encode_prompt  # noqa: E402
from gspo.engines import torch_engine as rollout  # noqa: E402
from gspo.engines.decoding import KVDecoder  # noqa: E402
from gspo.models import load_model, packed_completion_logprobs  # noqa: E402


def _module_at(revision: str, path: str, name: str, replace: dict[str, str]):
    """``path`` as of a git revision, imported as module ``name`` (None if it has none),
    with the ``replace`` substitutions made in its source first."""
    shown = subprocess.run(
        ["git", "-C", str(HERE), "show", f"{revision}:{path}"], capture_output=True, text=True
    )
    if shown.returncode:
        return None
    source = shown.stdout
    for old, new in replace.items():
        source = source.replace(old, new)
    file = Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def engine_at(revision: str):
    """The torch engine's module as of a git revision, imported under another name, with
    that revision's decoder when it has one (the layout before and after ``gspo.engines``)."""
    layouts = (
        (
            "src/gspo/engines/torch_engine.py",
            "src/gspo/engines/decoding.py",
            "gspo.engines.decoding",
        ),
        ("src/gspo/rollout.py", "src/gspo/decoding.py", "gspo.decoding"),
    )
    # what an older decoder imports under the names of its day
    renamed = {
        "from gspo.kernels import": "from gspo.models.kernels import",
        "from gspo import models\n": "from gspo.models import logprobs as models\n",
    }
    for engine_path, decoding_path, decoding_name in layouts:
        decoding = _module_at(revision, decoding_path, f"decoding_{revision}", renamed)
        replace = (
            {f"from {decoding_name} import": f"from {decoding.__name__} import"} if decoding else {}
        )
        engine = _module_at(revision, engine_path, f"rollout_{revision}", replace)
        if engine is not None:
            return engine
    return None


def memory_bandwidth(mib: int = 512, reps: int = 5) -> float:
    """This machine's memory read rate, bytes/s: the median time to sum a float32 tensor
    of ``mib`` MiB, far larger than the CPU's caches."""
    x = torch.ones(mib * 2**18)
    x.sum()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / statistics.median(times)


def decode_floor(batch, work: Path, peak: float, bandwidth: float) -> tuple[float, float]:
    """(weight products s, key/value reads s): the least time to decode ``batch`` here.

    Every generated token's products with the weights at the matmul ``peak``
    (:func:`vs_trl.flops_per_token`), and every decoding step reading the keys and values
    of each unfinished row's context (its prompt without padding and its tokens so far,
    every layer, float32) at the memory ``bandwidth``: rows leave the moment they finish.
    The first token of each row comes from the prompt's prefill and reads no cache.
    """
    config = model_config(work)
    per_context_token = (
        2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4
    )
    per_token, _ = flops_per_token(work)
    t = batch.completion_mask.sum(-1).double()
    p = batch.prompt_mask.sum(-1).double()
    steps = (t - 1).clamp(min=0)  # decoding steps after the prefill's token
    context = steps * p + steps * (steps + 1) / 2  # context tokens read over those steps
    return per_token * float(t.sum()) / peak, per_context_token * float(context.sum()) / bandwidth


def onednn_copy(model):
    """A copy of ``model`` with its linear layers on oneDNN (``model.cpu_linear=onednn``,
    what ``gspo train`` does on the CPU); ``model`` itself stays on F.linear."""
    import copy

    from gspo.models.kernels import set_linear_kernel

    other = copy.deepcopy(model)
    assert set_linear_kernel(other) == "onednn"
    return other


def setup(folder: Path, vocab: int | None):
    work = workload.build(folder, vocab=vocab)
    model, tokenizer = load_model(work / "model", device=torch.device("cpu"), dtype=torch.float32)
    rows = [json.loads(x) for x in (work / "train.jsonl").read_text().splitlines()[:16]]
    prompts = [encode_prompt(r["prompt"], tokenizer) for r in rows]
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return work, model, prompts, ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("runs/bench_long_levers"))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--baseline", default="190be02", help="git revision of 'today'")
    parser.add_argument("--only", default="gen,attn,check,drop,train,linear,profile,layout")
    args = parser.parse_args()
    only = set(args.only.split(","))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    work, model, prompts, ids = setup(args.workdir / "long", workload.LONG_VOCAB)
    model.eval()
    params = rollout.SamplingParams(max_new_tokens=256, temperature=1.0)
    peak = matmul_peak()
    print(f"matmul peak: {peak / 1e9:.1f} GFLOP/s", flush=True)
    per_token, _ = flops_per_token(work)

    def generate(engine, batches: list, attention: str = "products") -> Callable[[], object]:
        seeds = iter(range(10**6))

        def run() -> None:
            KVDecoder.attention = attention
            batches.append(engine.generate(prompts, n=8, params=params, seed=next(seeds) % 3))

        return run

    if "gen" in only:
        default = KVDecoder.attention
        fast = rollout.TorchEngine(model, **ids)
        engines = {
            f"TorchEngine at {args.baseline}": (
                engine_at(args.baseline).TorchEngine(model, **ids),
                default,
            ),
            "transformers forward (fast=False)": (
                rollout.TorchEngine(model, fast=False, **ids),
                default,
            ),
            "KVDecoder, SDPA attention": (fast, "sdpa"),
            "KVDecoder, batched products": (fast, "products"),
            "KVDecoder, batched products, oneDNN linears": (
                rollout.TorchEngine(onednn_copy(model), **ids),
                "products",
            ),
        }
        batches: dict[str, list] = {name: [] for name in engines}
        times = interleaved_times(
            {k: generate(e, batches[k], a) for k, (e, a) in engines.items()}, args.reps
        )
        KVDecoder.attention = default
        print("\ngen: one rollout batch, 128 responses, up to 256 new tokens")
        print("| decoder | median s | tokens/s | share of matmul peak |\n|---|---|---|---|")
        for name, ts in times.items():
            # the warm-up's tokens are not timed
            rate = sum(int(b.completion_mask.sum()) for b in batches[name][1:]) / sum(ts)
            print(
                f"| {name} | {statistics.median(ts):.2f} | {rate:,.0f} | "
                f"{rate * per_token / peak:.2f} |",
                flush=True,
            )
        bandwidth = memory_bandwidth()
        fastest = batches["KVDecoder, batched products, oneDNN linears"][1:]
        floors = [decode_floor(b, work, peak, bandwidth) for b in fastest]
        weights, reads = (statistics.median(f[i] for f in floors) for i in (0, 1))
        baseline = statistics.median(times[f"TorchEngine at {args.baseline}"])
        print(
            f"\nfloor of one such batch on this machine: weight products at the matmul peak "
            f"{weights:.2f} s + key/value cache reads at {bandwidth / 1e9:.1f} GB/s "
            f"{reads:.2f} s = {weights + reads:.2f} s; 3x {args.baseline}'s speed is "
            f"{baseline / 3:.2f} s",
            flush=True,
        )

    if "attn" in only:
        import torch.nn.functional as F

        rows, kv, group, d, cap, length = 128, 2, 2, 64, 262, 206
        gen = torch.Generator().manual_seed(0)
        keys = torch.randn(rows, kv, cap, d, generator=gen)
        keys_t = keys.transpose(-1, -2).contiguous()  # [rows, kv, d, cap]
        values = torch.randn(rows, kv, cap, d, generator=gen)
        q = torch.randn(rows, kv, group, d, generator=gen)
        none = torch.zeros(1, 1, 1)

        def sdpa() -> Tensor:
            k, v = keys[:, :, :length], values[:, :, :length]
            return F.scaled_dot_product_attention(q, k, v, scale=d**-0.5)

        def products() -> Tensor:
            k = keys_t[..., :length].reshape(rows * kv, d, length)
            v = values[:, :, :length].reshape(rows * kv, length, d)
            scores = torch.baddbmm(none, q.reshape(rows * kv, group, d), k, beta=0.0, alpha=d**-0.5)
            return torch.bmm(scores.softmax(-1), v)

        assert (products().view(rows, kv, group, d) - sdpa()).abs().max() < 1e-5
        times = interleaved_times({"SDPA": sdpa, "batched products": products}, args.reps * 20)
        print("\nattn: one layer, 128 rows, 206 cached tokens, 4/2 heads")
        print("| kernel | median ms |\n|---|---|")
        for name, ts in times.items():
            print(f"| {name} | {1000 * statistics.median(ts):.2f} |", flush=True)

    def by_setting(engine, setting: str, values: dict[str, object], title: str, column: str):
        """One rollout batch of ``engine`` per value of ``gspo.engines.<setting>``,
        interleaved; the setting is restored after."""
        default = getattr(rollout, setting)

        def with_value(value) -> Callable[[], object]:
            run = generate(engine, [])

            def timed() -> None:
                setattr(rollout, setting, value)
                run()

            return timed

        times = interleaved_times({k: with_value(v) for k, v in values.items()}, args.reps)
        setattr(rollout, setting, default)
        print(f"\n{title}\n| {column} | median s |\n|---|---|")
        for name, ts in times.items():
            print(f"| {name} | {statistics.median(ts):.2f} |", flush=True)

    if "check" in only:
        by_setting(
            rollout.TorchEngine(model, **ids),
            "CHECK_EVERY",
            {f"every {k}": k for k in (1, 8)},
            "check: one rollout batch (256 new tokens), finished rows read every k steps",
            "k",
        )

    if "drop" in only:
        by_setting(
            rollout.TorchEngine(onednn_copy(model), **ids),
            "DROP_FRACTION",
            {"any finished (default)": 0.0, "a quarter": 0.25, "never": 2.0},
            "drop: one rollout batch (256 new tokens), finished rows leave once ...",
            "share finished",
        )

    if "train" in only:
        base = Path(tempfile.mkdtemp())
        archive = subprocess.run(
            ["git", "-C", str(HERE.parent), "archive", args.baseline, "src"],
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
        sources = {"this tree": str(HERE.parent / "src"), args.baseline: str(base / "src")}
        runs: dict[str, list[dict]] = {name: [] for name in sources}
        for i in range(args.reps):
            for name in sources if i % 2 == 0 else list(sources)[::-1]:
                old_path = os.environ.get("PYTHONPATH")
                os.environ["PYTHONPATH"] = sources[name]
                try:
                    seconds, run = run_gspo(work, name=f"gspo_{i}", schedule=LONG)
                finally:
                    if old_path is None:
                        del os.environ["PYTHONPATH"]
                    else:
                        os.environ["PYTHONPATH"] = old_path
                summary = gspo_summary(run)
                runs[name].append({"seconds": seconds, **summary})
        print("\ntrain: gspo train, long workload, 256 new tokens, 8 optimizer steps")
        print(
            "| code | whole process s | time/generate s per rollout batch | "
            "time/train s per minibatch | completion tokens |\n|---|---|---|---|---|"
        )
        for name, rs in runs.items():
            whole = statistics.median(r["seconds"] for r in rs)
            gen = statistics.median(r["phases"]["generation"] / 2 for r in rs)
            train = statistics.median(r["phases"]["forward/backward/optimizer"] / 8 for r in rs)
            tokens = statistics.median(r["completion_tokens"] for r in rs)
            print(f"| {name} | {whole:.1f} | {gen:.2f} | {train:.2f} | {tokens:,.0f} |", flush=True)

    if "linear" in only:
        linear_lever(model, prompts, ids, params, args.reps)

    if "profile" in only:
        profile_lever(model, prompts, ids, params)

    if "layout" in only:
        print("\nlayout: forward + backward of a minibatch of 32 completions")
        print("| workload | prompt shared | not shared | auto |\n|---|---|---|---|")
        cases = [("long, 256 new tokens", model, prompts, ids, params)]
        _, ref_model, ref_prompts, ref_ids = setup(args.workdir / "reference", None)
        ref_params = rollout.SamplingParams(max_new_tokens=32, temperature=1.0)
        cases.append(("reference, 32 new tokens", ref_model, ref_prompts, ref_ids, ref_params))
        for name, m, ps, kw, p in cases:
            m.eval()
            batch = rollout.TorchEngine(m, **kw).generate(ps, n=8, params=p, seed=2)
            pick = torch.randperm(128, generator=torch.Generator().manual_seed(0))[:32]
            mb = batch.select(pick)
            m.train()

            def fwd_bwd(share, m=m, mb=mb) -> Callable[[], object]:
                def run() -> None:
                    lp = packed_completion_logprobs(
                        m,
                        mb.prompt_ids,
                        mb.prompt_mask,
                        mb.completion_ids,
                        mb.completion_mask,
                        share_prompts=share,
                    )
                    lp.sum().backward()
                    m.zero_grad()

                return run

            variants = {"shared": fwd_bwd(True), "alone": fwd_bwd(False), "auto": fwd_bwd("auto")}
            times = interleaved_times(variants, args.reps * 3)
            ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
            tokens = int(mb.completion_mask.sum())
            print(
                f"| {name} ({tokens} completion tokens) | {ms['shared']:.0f} ms | "
                f"{ms['alone']:.0f} ms | {ms['auto']:.0f} ms |",
                flush=True,
            )


def linear_lever(model, prompts, ids, params, reps: int) -> None:
    """F.linear vs oneDNN: single products, then a rollout batch and a training minibatch."""
    from functools import partial

    import torch.nn.functional as F

    from gspo.models.kernels import onednn_linear

    gen = torch.Generator().manual_seed(0)
    cases = {  # (rows, in, out): a decoding step's QKV, a minibatch's MLP up and down,
        # and one 256-token chunk of the vocabulary projection at Qwen3-0.6B's shape
        "decode [128 x 256] x [256 x 768]": (128, 256, 768),
        "train [6100 x 256] x [256 x 768]": (6100, 256, 768),
        "train [6100 x 768] x [768 x 256]": (6100, 768, 256),
        "LM head chunk [256 x 1024] x [1024 x 151936]": (256, 1024, 151936),
    }
    print("\nlinear: one product, median of interleaved runs (ms)")
    print("| product | F.linear | oneDNN | F.linear / oneDNN |\n|---|---|---|---|")
    for name, (m, k, n) in cases.items():
        x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
        grad = torch.randn(m, n, generator=gen)
        parts = {"forward": (partial(F.linear, x, w), partial(onednn_linear, x, w))}
        if m > 128 or n > 100_000:
            xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()

            def backward(fn, xg=xg, wg=wg, grad=grad) -> Callable[[], object]:
                return lambda: torch.autograd.grad(fn(xg, wg), (xg, wg), grad)

            parts["forward + backward"] = (backward(F.linear), backward(onednn_linear))
        for part, (ref, mine) in parts.items():
            runs = reps * (1 if n > 100_000 else 20 if m > 128 else 200)
            times = interleaved_times({"torch": ref, "onednn": mine}, runs)
            a, b = (1000 * statistics.median(times[v]) for v in ("torch", "onednn"))
            print(f"| {name}, {part} | {a:.3f} | {b:.3f} | {a / b:.2f}x |", flush=True)

    variants = {"torch": model, "onednn": onednn_copy(model)}
    batch = rollout.TorchEngine(model, **ids).generate(prompts, n=8, params=params, seed=2)
    mb = batch.select(torch.randperm(128, generator=torch.Generator().manual_seed(0))[:32])

    def rollout_batch(m) -> Callable[[], object]:
        m.eval()
        return lambda: rollout.TorchEngine(m, **ids).generate(prompts, n=8, params=params, seed=2)

    def fwd_bwd(m) -> Callable[[], object]:
        def run() -> None:
            m.train()
            lp = packed_completion_logprobs(
                m, mb.prompt_ids, mb.prompt_mask, mb.completion_ids, mb.completion_mask,
                share_prompts="auto",
            )  # fmt: skip
            lp.sum().backward()
            m.zero_grad()

        return run

    tokens = int(mb.completion_mask.sum())
    print(
        "\n| the model's linear layers on | one rollout batch (s) | forward + backward of "
        f"a minibatch ({tokens} completion tokens, s) |\n|---|---|---|"
    )
    gen_times = interleaved_times({k: rollout_batch(m) for k, m in variants.items()}, reps)
    train_times = interleaved_times({k: fwd_bwd(m) for k, m in variants.items()}, reps * 3)
    for kernel in variants:
        print(
            f"| {kernel} | {statistics.median(gen_times[kernel]):.2f} | "
            f"{statistics.median(train_times[kernel]):.3f} |",
            flush=True,
        )


def profile_lever(model, prompts, ids, params) -> None:
    """Self CPU time of one rollout batch (after a warm-up one), by kind of operation."""
    from torch.profiler import profile

    engine = rollout.TorchEngine(onednn_copy(model), **ids)
    engine.generate(prompts, n=8, params=params, seed=2)
    with profile() as prof:
        engine.generate(prompts, n=8, params=params, seed=2)
    kinds = {"linear products (oneDNN)": 0.0, "attention products (bmm, baddbmm)": 0.0}
    rest = 0.0
    for event in prof.key_averages():
        seconds = event.self_cpu_time_total / 1e6
        if event.key == "mkldnn::_linear_pointwise":
            kinds["linear products (oneDNN)"] += seconds
        elif event.key in ("aten::bmm", "aten::baddbmm"):
            kinds["attention products (bmm, baddbmm)"] += seconds
        else:
            rest += seconds
    kinds["everything else (elementwise, cache writes, sampling)"] = rest
    print("\nprofile: one rollout batch (256 new tokens), self CPU time (s)")
    print(f"| kind | s |\n|---|---|\n| all | {sum(kinds.values()):.2f} |")
    for name, seconds in kinds.items():
        print(f"| {name} | {seconds:.2f} |", flush=True)


if __name__ == "__main__":
    main()
