"""MoE routing: capture, Routing Replay, expert-change fraction, and the trainer's use of them."""

import pytest
import torch
from conftest import CPU
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    GptOssConfig,
    GraniteMoeConfig,
    JambaConfig,
    MixtralConfig,
    OlmoeConfig,
    Qwen2MoeConfig,
)

from gspo.config import ConfigError, load_config
from gspo.models import TinyModelSpec, build_tiny_model, completion_logprobs
from gspo.moe import (
    ROUTERS,
    SCORED_ROUTERS,
    capture_router_logits,
    capture_routing,
    expert_change_fraction,
    experts_implementation,
    find_routers,
    load_balancing_loss,
    replay_routing,
    response_token_mask,
    set_experts_implementation,
    use_padded_experts,
)
from gspo.telemetry import read_metrics
from gspo.trainer import Trainer
from gspo.training.policy import RoutedForward, moe_settings
from gspo.training.setup import build_or_load_model

MOE = TinyModelSpec(
    architecture="qwen3_moe",
    layers=2,
    hidden=64,
    heads=2,
    kv_heads=1,
    intermediate=128,
    experts=8,
    experts_per_token=2,
    expert_intermediate=32,
)


FAST_MOE = [
    CPU,  # the CPU and float32 (conftest)
    "model.builtin=qwen3_moe",
    "model.layers=2",
    "model.hidden=64",
    "model.heads=2",
    "model.kv_heads=1",
    "model.intermediate=128",
    "model.experts=4",
    "data.eval_size=8",
    "data.sft_size=64",
    "train.cold_start_steps=0",
    "rollout.group_size=4",
    "rollout.prompts_per_batch=4",
    "rollout.max_new_tokens=4",
    "eval.samples=1",
    "eval.max_prompts=4",
    "eval.every=0",
    "eval.greedy=false",
    "train.max_steps=4",
    "optim.lr=3e-2",
    "log.progress=false",
    "log.plots=false",
    "log.tensorboard=false",
]


@pytest.fixture
def moe_model(tokenizer):
    return build_tiny_model(MOE, tokenizer, seed=0)


def tokens(batch=3, length=7, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, 60, (batch, length), generator=generator)


def scramble_routers(model, seed=1):
    """A large weight change: every router's weight replaced by large random values."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in find_routers(model):
            router.weight.copy_(torch.randn(router.weight.shape, generator=generator) * 10)


def moe_blocks(model):
    return [
        m
        for m in model.modules()
        if (hasattr(m, "gate") or hasattr(m, "router")) and hasattr(m, "experts")
    ]


def experts_used(model, run):
    """The top-k indices the expert modules actually received during ``run()``."""
    seen = []

    def pre_hook(module, args, kwargs):
        seen.append(args[1].clone())

    handles = [
        block.experts.register_forward_pre_hook(pre_hook, with_kwargs=True)
        for block in moe_blocks(model)
    ]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack(seen)


# ---------------------------------------------------------------------------- capture


def test_dense_model_has_no_routers(tiny_model):
    with pytest.raises(ValueError, match="model has no MoE routers"):
        find_routers(tiny_model)
    with pytest.raises(ValueError, match="model has no MoE routers"), capture_routing(tiny_model):
        pass


def test_capture_records_k_experts_per_token_per_layer(moe_model):
    ids = tokens(3, 7)
    with torch.no_grad(), capture_routing(moe_model) as recorder:
        moe_model(input_ids=ids)
    experts = recorder.experts
    assert experts.shape == (MOE.layers, 3 * 7, MOE.experts_per_token)
    assert int(experts.min()) >= 0 and int(experts.max()) < MOE.experts
    # the k experts of one token are distinct
    assert (experts[..., 0] != experts[..., 1]).all()
    # what the experts modules ran is what was recorded
    used = experts_used(moe_model, lambda: moe_model(input_ids=ids))
    assert torch.equal(used, experts.long())
    # hooks are removed on exit
    assert all(not r._forward_hooks for r in find_routers(moe_model))


# ----------------------------------------------------------------------------- replay


def test_replay_on_unchanged_weights_gives_identical_logits_and_gradients(moe_model):
    ids = tokens()
    with capture_routing(moe_model) as recorder:
        logits = moe_model(input_ids=ids).logits
    logits.square().mean().backward()
    grads = [r.weight.grad.clone() for r in find_routers(moe_model)]
    moe_model.zero_grad()
    with replay_routing(moe_model, recorder.experts):
        replayed = moe_model(input_ids=ids).logits
    replayed.square().mean().backward()
    assert torch.equal(logits, replayed)
    for grad, router in zip(grads, find_routers(moe_model), strict=True):
        assert torch.allclose(grad, router.weight.grad, atol=1e-7)
        assert router.weight.grad.abs().sum() > 0  # gradient reaches the gate weights
    assert all("forward" not in r.__dict__ for r in find_routers(moe_model))  # restored


def test_replay_pins_the_routing_after_a_large_weight_change(moe_model):
    ids = tokens()
    with torch.no_grad(), capture_routing(moe_model) as recorder:
        moe_model(input_ids=ids)
    old = recorder.experts
    scramble_routers(moe_model)

    natural = experts_used(moe_model, lambda: moe_model(input_ids=ids))
    overall, _ = expert_change_fraction(old, natural)
    assert overall > 0.3  # without replay the routing moved a lot

    def replayed_forward():
        with replay_routing(moe_model, old):
            moe_model(input_ids=ids).logits.sum().backward()

    assert torch.equal(experts_used(moe_model, replayed_forward), old.long())
    for router in find_routers(moe_model):
        # finite even where the new router gives the replayed experts ~0 probability
        assert torch.isfinite(router.weight.grad).all()
        assert router.weight.grad.abs().sum() > 0


def test_replayed_block_output_is_the_experts_at_the_recorded_routing(moe_model):
    block = moe_blocks(moe_model)[0]
    hidden = torch.randn(2, 5, MOE.hidden, generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), capture_routing(moe_model) as recorder:
        block(hidden)
    old = recorder.calls[0][0].long()  # only block 0 ran
    scramble_routers(moe_model)
    with torch.no_grad():
        natural = block(hidden)
        with replay_routing(moe_model, torch.stack([old] * MOE.layers)):
            replayed = block(hidden)
        flat = hidden.reshape(-1, MOE.hidden)
        # p_i / sum_j p_j over the replayed experts = a softmax over their logits
        gates = torch.softmax((flat @ block.gate.weight.T).gather(-1, old), dim=-1)
        expected = block.experts(flat, old, gates)
    assert torch.allclose(replayed.reshape(-1, MOE.hidden), expected, atol=1e-6)
    assert not torch.allclose(natural, replayed, atol=1e-4)


def test_replay_rejects_a_different_layout(moe_model):
    with torch.no_grad(), capture_routing(moe_model) as recorder:
        moe_model(input_ids=tokens(3, 7))
    with (
        pytest.raises(ValueError, match="same \\[B, L\\] input layout"),
        replay_routing(moe_model, recorder.experts),
    ):
        moe_model(input_ids=tokens(3, 8))
    with (
        pytest.raises(ValueError, match="MoE layers"),
        replay_routing(moe_model, recorder.experts[:1]),
    ):
        pass


def _tiny(config_class, **kwargs):
    common = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        config_class(**{**common, **kwargs}), dtype=torch.float32
    )
    with torch.no_grad():  # DeepSeek-V3's choice bias (a buffer, zeros at init): one that counts
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.copy_(torch.randn(module.num_experts) * 0.3)
            if type(module).__name__ == "GptOssTopKRouter":  # (its logits' bias: zeros at init)
                module.bias.copy_(torch.randn(module.num_experts) * 0.3)
    return model


#: DeepSeek's attention (MLA) at a tiny size, its MoE on every layer with a shared expert.
DEEPSEEK = dict(
    num_key_value_heads=2, n_routed_experts=8, moe_intermediate_size=16, n_shared_experts=1,
    n_group=2, topk_group=1, first_k_dense_replace=0, q_lora_rank=16, kv_lora_rank=16,
    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5,
)  # fmt: skip


@pytest.mark.parametrize(
    "make",
    [
        lambda: _tiny(MixtralConfig, num_local_experts=4),
        lambda: _tiny(OlmoeConfig, num_experts=4, norm_topk_prob=False),
        lambda: _tiny(
            Qwen2MoeConfig,
            num_experts=4,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
        ),
        # grouped top-k on sigmoid scores + bias, renormalised: refused before (the MoE audit)
        lambda: _tiny(DeepseekV3Config, **DEEPSEEK, norm_topk_prob=True),
        lambda: _tiny(DeepseekV3Config, **DEEPSEEK, norm_topk_prob=False),
        lambda: _tiny(DeepseekV2Config, **DEEPSEEK, topk_method="group_limited_greedy"),
        lambda: _tiny(DeepseekV2Config, **DEEPSEEK, topk_method="greedy"),
        # top-k of the logits, softmax over the k (GPT-OSS: a router bias); Jamba's unnormalised
        lambda: _tiny(GptOssConfig, num_local_experts=4, head_dim=16, sliding_window=8),
        lambda: _tiny(GraniteMoeConfig, num_local_experts=4),
        lambda: _tiny(JambaConfig, num_experts=4, expert_layer_period=1, expert_layer_offset=0,
                      attn_layer_period=1, attn_layer_offset=0, use_mamba_kernels=False),
    ],
    ids=["mixtral", "olmoe", "qwen2_moe", "deepseek_v3", "deepseek_v3_unnormalised",
         "deepseek_v2_grouped", "deepseek_v2_greedy", "gpt_oss", "granitemoe", "jamba"],
)  # fmt: skip
def test_capture_and_replay_on_other_moe_families(make):
    model = make()
    ids = tokens(2, 6)
    with capture_routing(model) as recorder:
        logits = model(input_ids=ids).logits
    assert recorder.experts.shape == (2, 12, 2)
    # what the experts ran: the router's own choice (DeepSeek's bias and groups included)
    assert torch.equal(experts_used(model, lambda: model(input_ids=ids)), recorder.experts.long())
    with replay_routing(model, recorder.experts):
        assert torch.equal(model(input_ids=ids).logits, logits)
    scramble_routers(model)

    def replayed_forward():
        with replay_routing(model, recorder.experts):
            model(input_ids=ids)

    assert not torch.equal(experts_used(model, lambda: model(input_ids=ids)), recorder.experts)
    assert torch.equal(experts_used(model, replayed_forward), recorder.experts.long())


# ------------------------------------------------------------------- change fraction


def test_expert_change_fraction_counts_changed_experts_as_sets():
    old = torch.tensor([[[0, 1], [2, 3], [4, 5]]])  # 1 layer, 3 tokens, k = 2
    assert expert_change_fraction(old, old) == (0.0, [0.0])
    reordered = torch.tensor([[[1, 0], [3, 2], [5, 4]]])
    assert expert_change_fraction(old, reordered)[0] == 0.0
    new = torch.tensor([[[0, 7], [6, 7], [4, 5]]])  # 1 + 2 + 0 of 6 activations changed
    assert expert_change_fraction(old, new)[0] == pytest.approx(3 / 6)
    mask = torch.tensor([1, 0, 1])  # token 1 does not count: 1 of 4
    assert expert_change_fraction(old, new, mask)[0] == pytest.approx(1 / 4)
    two_layers = expert_change_fraction(torch.cat([old, old]), torch.cat([old, new]))
    assert two_layers[0] == pytest.approx(3 / 12)
    assert two_layers[1] == pytest.approx([0.0, 0.5])
    assert expert_change_fraction(old, new, torch.zeros(3)) == (0.0, [0.0])


def test_change_fraction_is_zero_for_identical_weights_and_positive_after_a_large_step(
    moe_model,
):
    ids = tokens()

    def routing():
        with torch.no_grad(), capture_routing(moe_model) as recorder:
            moe_model(input_ids=ids)
        return recorder.experts

    before = routing()
    assert expert_change_fraction(before, routing())[0] == 0.0
    optimizer = torch.optim.SGD(moe_model.parameters(), lr=50.0)
    moe_model(input_ids=ids).logits.logsumexp(-1).mean().backward()
    optimizer.step()
    overall, per_layer = expert_change_fraction(before, routing())
    assert overall > 0 and len(per_layer) == MOE.layers


def test_response_token_mask_finds_the_response_tokens_in_any_layout(moe_model):
    prompt_ids = torch.tensor([[0, 11, 12], [13, 14, 15]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    completion_ids = torch.tensor([[16, 17], [18, 0]])
    completion_mask = torch.tensor([[1, 1], [1, 0]])

    def padded(p, c):  # a known layout: [B, P + T] row-major
        return moe_model(input_ids=torch.cat([p, c], dim=1))

    with capture_routing(moe_model) as recorder:
        mask = response_token_mask(moe_model, padded, prompt_ids, prompt_mask, completion_mask)
    assert mask.tolist() == [bool(x) for x in [0, 0, 0, 1, 1, 0, 0, 0, 1, 0]]
    assert recorder.calls == [[], []]  # the probe stops before any layer runs

    # the trainer's forward (completion_logprobs: padded or packed, its business)
    def trainer_forward(p, c):
        return completion_logprobs(moe_model, p, prompt_mask, c, completion_mask)

    mask = response_token_mask(moe_model, trainer_forward, prompt_ids, prompt_mask, completion_mask)
    with torch.no_grad(), capture_routing(moe_model) as recorder:
        trainer_forward(prompt_ids, completion_ids)
    assert mask.shape[0] == recorder.experts.shape[1]
    assert int(mask.sum()) == int(completion_mask.sum())


# ---------------------------------------------------------------------------- trainer


def test_moe_keys_on_a_dense_model_are_errors(tmp_path):
    with pytest.raises(ConfigError, match="moe.routing_replay needs a MoE model"):
        load_config(None, ["moe.routing_replay=true"])
    with pytest.raises(ConfigError, match="moe.measure_churn needs a MoE model"):
        load_config(None, ["moe.measure_churn=true"])


def test_moe_keys_on_a_dense_model_path_are_errors(tiny_model):
    config = load_config(None, ["model.path=/models/dense", "moe.routing_replay=true"])
    with pytest.raises(ValueError, match="moe.routing_replay: model has no MoE routers"):
        moe_settings(config, tiny_model)
    # measure_churn=None means "on for MoE models": off for a dense one, no error
    assert moe_settings(load_config(None, ["model.path=/models/dense"]), tiny_model) == (
        False,
        False,
    )


@pytest.mark.slow
def test_trainer_on_moe_without_measuring_logs_no_moe_metrics(tmp_path):
    config = load_config(None, [*FAST_MOE, "train.max_steps=2", "moe.measure_churn=false"])
    Trainer(config, tmp_path / "run").fit()
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert records and not any(k.startswith("moe/") for r in records for k in r)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("level", "old_logprobs"),
    [
        ("sequence", "sampler"),
        ("sequence_token", "sampler"),
        ("token", "sampler"),
        ("token", "recompute"),
    ],
)
def test_trainer_with_routing_replay_logs_expert_change(
    tmp_path, level, old_logprobs, varied_reward
):
    config = load_config(
        None,
        [
            *FAST_MOE,
            varied_reward,
            "moe.routing_replay=true",
            f"algorithm.level={level}",
            f"algorithm.old_logprobs={old_logprobs}",
        ],
    )
    Trainer(config, tmp_path / "run").fit()
    lines = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r]
    assert len(lines) == 4
    for line in lines:
        assert 0.0 <= line["moe/expert_change_fraction"] <= 1.0
        per_layer = [line[f"moe/expert_change_fraction/layer_{i}"] for i in range(2)]
        assert line["moe/expert_change_fraction"] == pytest.approx(sum(per_layer) / 2)
        # the response tokens counted: at most the minibatch's, at least its loss tokens
        assert line["train/tokens"] <= line["moe/churn_tokens"] <= 16  # 4 responses of <= 4
    assert max(line["moe/expert_change_fraction"] for line in lines) > 0  # lr 3e-2 moves it


@pytest.mark.slow
def test_trainer_replays_the_old_routing_in_every_minibatch(tmp_path, monkeypatch, varied_reward):
    config = load_config(
        None,
        [
            *FAST_MOE,
            varied_reward,
            "moe.routing_replay=true",
            "algorithm.level=token",
        ],
    )
    trainer = Trainer(config, tmp_path / "run")
    used, recorded = [], []
    original = RoutedForward.logprobs

    def spy(self, batch, k, routing):
        with capture_routing(self.policy.module) as recorder:
            out = original(self, batch, k, routing)
        used.append(recorder.experts)
        recorded.append(routing[k].clone())
        return out

    monkeypatch.setattr(RoutedForward, "logprobs", spy)
    lines = trainer.rl_step(0)
    assert len(used) == config.algorithm.minibatches
    for experts, old in zip(used, recorded, strict=True):
        assert torch.equal(experts, old)
    # while the model's own routing did move (lr 3e-2): replay is what kept it fixed
    assert max(line["moe/expert_change_fraction"] for _, line in lines) > 0


# ------------------------------------------------------- Qwen3-MoE-like routing shape

#: Fine-grained routing as in Qwen3-30B-A3B (128 experts, top-8, narrow experts), small.
FINE = TinyModelSpec(
    architecture="qwen3_moe",
    layers=3,
    hidden=64,
    heads=2,
    kv_heads=1,
    experts=128,
    experts_per_token=8,
    expert_intermediate=16,
)


def test_builtin_moe_takes_qwen3_moe_routing_from_config_keys(tmp_path):
    config = load_config(
        None,
        [
            "model.builtin=qwen3_moe",
            "model.layers=3",
            "model.hidden=64",
            "model.heads=2",
            "model.kv_heads=1",
            "model.experts=128",
            "model.experts_per_token=8",
            "model.expert_intermediate=16",
            "model.norm_topk_prob=false",
        ],
    )
    model, _ = build_or_load_model(config, tmp_path, torch.device("cpu"))
    c = model.config
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (128, 8, 16)
    assert c.num_hidden_layers == 3 and c.norm_topk_prob is False
    routers = find_routers(model)
    assert len(routers) == 3 and all(r.top_k == 8 and r.num_experts == 128 for r in routers)
    experts = model.model.layers[0].mlp.experts
    assert tuple(experts.gate_up_proj.shape) == (128, 2 * 16, 64)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_fine_grained_routing_shape_and_gate_normalisation(tokenizer, norm_topk_prob):
    spec = TinyModelSpec(**{**FINE.__dict__, "norm_topk_prob": norm_topk_prob})
    model = build_tiny_model(spec, tokenizer, seed=0)
    ids = tokens(3, 7)
    gates = []
    handle = find_routers(model)[0].register_forward_hook(lambda m, a, out: gates.append(out[1]))
    with torch.no_grad(), capture_routing(model) as recorder:
        model(input_ids=ids)
    handle.remove()
    experts = recorder.experts
    assert experts.shape == (FINE.layers, 3 * 7, 8)
    assert int(experts.max()) < 128
    # 8 distinct experts per token, and the tokens use many different experts
    assert (experts.long().sort(-1).values.diff(dim=-1) > 0).all()
    assert experts.unique().numel() > 32
    sums = gates[0].sum(-1)
    if norm_topk_prob:
        assert torch.allclose(sums, torch.ones_like(sums), atol=1e-5)
    else:  # the raw softmax mass of 8 of 128 experts
        assert (sums < 0.99).all()


def test_padded_experts_match_the_eager_loop(tokenizer):
    model = build_tiny_model(FINE, tokenizer, seed=0)
    with torch.no_grad():  # non-zero router weights so that tokens spread over experts
        for router in find_routers(model):
            router.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
    ids = tokens(4, 9)

    def run():
        model.zero_grad()
        with capture_routing(model) as recorder:
            logits = model(input_ids=ids).logits
        logits.square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        return logits.detach(), grads, recorder.experts

    default = run()  # as transformers set the model up
    set_experts_implementation(model, "eager")
    assert model.config._experts_implementation == "eager"
    eager = run()
    use_padded_experts(model)
    assert experts_implementation(model) == "padded"
    padded = run()
    for other in (default, padded):
        assert torch.equal(eager[2], other[2])  # same routing
        assert torch.allclose(eager[0], other[0], atol=1e-5)
        assert len(eager[1]) == len(other[1])
        for a, b in zip(eager[1], other[1], strict=True):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    with pytest.raises(ValueError, match="no expert modules"):
        use_padded_experts(torch.nn.Linear(2, 2))


def test_load_balancing_loss_is_transformers_one_and_grows_with_imbalance(tokenizer):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = build_tiny_model(FINE, tokenizer, seed=0)
    ids = tokens(3, 7)
    with capture_router_logits(model) as calls:
        model(input_ids=ids)
    logits = [c[0] for c in calls]
    mask = torch.ones(3, 7)
    mask[0, :4] = 0
    ours = load_balancing_loss(logits, 8, mask.reshape(-1))
    theirs = load_balancing_loss_func(tuple(logits), 128, 8, attention_mask=mask)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)
    assert ours.requires_grad
    # every token sent to the same 8 experts with near-certainty: 128 / 8 x the uniform 8
    skewed = torch.full((21, 128), -30.0)
    skewed[:, :8] = 0.0
    assert load_balancing_loss([skewed], 8).item() == pytest.approx(128.0, rel=1e-4)
    # uniform probabilities and an even top-k assignment give top_k
    even = torch.zeros((16, 128))
    even[torch.arange(16).repeat_interleave(8), torch.arange(128)] = 1e-6
    assert load_balancing_loss([even], 8).item() == pytest.approx(8.0, rel=1e-3)


def test_router_aux_loss_on_a_dense_model_is_an_error():
    with pytest.raises(ConfigError, match="moe.router_aux_loss_coef needs a MoE model"):
        load_config(None, ["moe.router_aux_loss_coef=0.01"])


def test_deepseek_routers_get_churn_and_replay_but_not_the_softmax_aux_loss(tmp_path):
    """DeepSeek-V3's router (sigmoid scores, a choice bias, grouped top-k) trained with
    neither churn nor replay; gspo's load-balancing loss is a softmax router's, not its."""
    model = _tiny(DeepseekV3Config, **DEEPSEEK)
    path = f"model.path={tmp_path}"
    replay, churn = moe_settings(load_config(None, [path, "moe.routing_replay=true"]), model)
    assert replay and churn
    said = r"^moe.router_aux_loss_coef: DeepseekV3TopkRouter scores its experts its own way"
    with pytest.raises(ValueError, match=said + r" .*; set moe.router_aux_loss_coef=0$"):
        moe_settings(load_config(None, [path, "moe.router_aux_loss_coef=0.01"]), model)


def test_padded_experts_for_gpt_oss_experts_is_one_line():
    """GPT-OSS's experts (biased, transposed) are not padded's layout: handled since the MoE
    audit, a bare ValueError naming no key would have ended the run."""
    model = _tiny(GptOssConfig, num_local_experts=4, head_dim=16, sliding_window=8)
    with pytest.raises(ValueError, match=r"^model.experts_implementation=padded: GptOssExperts: "
                       r"expert weights not in the \[E, 2I, H\] layout; use auto$"):  # fmt: skip
        set_experts_implementation(model, "padded")
    set_experts_implementation(model, "eager")  # transformers' own names reach them
    assert experts_implementation(model) == "eager"


@pytest.mark.slow
def test_router_aux_loss_changes_the_loss_only_when_on(tmp_path, varied_reward):
    def first_line(coef, name):
        config = load_config(None, [*FAST_MOE, varied_reward, f"moe.router_aux_loss_coef={coef}"])
        return Trainer(config, tmp_path / name).rl_step(0)[0][1]

    off, on = first_line(0.0, "off"), first_line(0.5, "on")
    assert "moe/router_aux_loss" not in off
    # the same weights and samples: the policy part of the loss is the same, plus the aux
    aux = on["moe/router_aux_loss"]
    assert aux > 0.5 * 2 * 0.99  # coef x a loss of at least top_k (2) for 4 experts
    assert on["train/loss"] == pytest.approx(off["train/loss"] + aux, abs=1e-5)
    assert on["train/clip_fraction"] == off["train/clip_fraction"]


def test_router_aux_loss_with_async_rollouts_trains(tmp_path, varied_reward):
    # the async producer hands pi_old's log-probs over, so no old-routing pass runs: the
    # aux loss must not need one (it raised IndexError at the first update)
    common = [*FAST_MOE, varied_reward, "moe.router_aux_loss_coef=0.1", "train.max_steps=8",
              "algorithm.minibatches=2", "eval.every=0", "log.progress=false",
              "log.plots=false", "log.tensorboard=false"]  # fmt: skip
    async_ = ["rollout.max_staleness=1", "algorithm.old_logprobs=recompute"]
    for name, extra in (("sync", []), ("async", async_)):
        records = Trainer(load_config(None, [*common, *extra]), tmp_path / name).fit()
        lines = [r for r in records if "train/loss" in r]
        assert [r["step"] for r in lines] == list(range(1, 9))
        assert all(r["moe/router_aux_loss"] > 0.1 * 2 * 0.99 for r in lines)


@pytest.mark.parametrize("implementation", ["auto", "eager", "padded"])
def test_a_run_computes_its_policy_and_kl_reference_experts_as_configured(
    tmp_path, tokenizer, implementation
):
    overrides = [*FAST_MOE, "train.max_steps=1", "algorithm.minibatches=1", "algorithm.kl_coef=0.1",
                 f"model.experts_implementation={implementation}"]  # fmt: skip
    trainer = Trainer(load_config(None, overrides), tmp_path / "run")
    trainer.fit()
    reference = trainer.reference.module
    assert reference is not None  # loaded by the KL term
    for module in (trainer.policy.module, reference):
        chosen = experts_implementation(module)
        if implementation == "auto":  # transformers' own choice, whatever it is
            assert chosen == experts_implementation(build_tiny_model(MOE, tokenizer, seed=0))
        else:
            assert chosen == implementation


def test_an_experts_implementation_this_transformers_lacks_is_one_line(tokenizer):
    model = build_tiny_model(FINE, tokenizer, seed=0)
    with pytest.raises(ValueError, match=r"^model.experts_implementation=nonesuch: "):
        set_experts_implementation(model, "nonesuch")
    dense = torch.nn.Linear(2, 2)
    set_experts_implementation(dense, "nonesuch")  # a dense model is left as it is
    assert experts_implementation(dense) == "auto"


IMPLEMENTATION = ["model.experts_implementation=padded"]


def test_a_moe_family_whose_router_is_not_handled_is_said(tokenizer, tmp_path, capsys):
    """PhiMoE, Llama 4, DBRX... (and DeepSeek-V3, GPT-OSS, Granite-MoE before they were
    handled) trained with no expert churn, unsaid; asked for Routing Replay the line said
    an MoE model had no MoE routers (the MoE audit)."""
    from transformers import PhimoeConfig, PhimoeForCausalLM

    from gspo.distributed import Distributed
    from gspo.models.loading import save_pretrained_atomic
    from gspo.moe import unhandled_router
    from gspo.training.setup import build_policy_model

    phimoe = PhimoeForCausalLM(
        PhimoeConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                     num_local_experts=4, num_experts_per_tok=2)
    )  # fmt: skip
    assert unhandled_router(phimoe) == "PhimoeTopKRouter"
    config = load_config(None, [f"model.path={tmp_path / 'phimoe'}", "moe.routing_replay=true"])
    with pytest.raises(ValueError, match=r"^moe.routing_replay: phimoe is a mixture-of-"
                       r"experts model whose router \(PhimoeTopKRouter\) gspo does not "
                       r"handle \(it handles Qwen3MoeTopKRouter, "):  # fmt: skip
        moe_settings(config, phimoe)
    save_pretrained_atomic(phimoe, tokenizer, tmp_path / "phimoe")
    capsys.readouterr()
    config = load_config(None, [f"model.path={tmp_path / 'phimoe'}", "model.device=cpu"])
    build_policy_model(
        config, tmp_path / "run", torch.device("cpu"), Distributed(), None, torch.float32
    )
    assert capsys.readouterr().err.splitlines()[-1] == (
        "gspo: warning: PhimoeForCausalLM is a mixture-of-experts model whose router "
        "(PhimoeTopKRouter) gspo does not handle: no expert churn (moe/*), Routing Replay "
        "or router loss for it (docs/moe.md lists the families handled)"
    )
    # transformers' own names reach its experts; padded (gspo's) does not, and says so
    set_experts_implementation(phimoe, "eager")
    assert experts_implementation(phimoe) == "eager"
    padded = [f"model.path={tmp_path / 'phimoe'}", "model.device=cpu", *IMPLEMENTATION]
    build_policy_model(
        load_config(None, padded), tmp_path / "run2", torch.device("cpu"), Distributed(), None,
        torch.float32,
    )  # fmt: skip
    assert capsys.readouterr().err.splitlines()[-1] == (
        "gspo: warning: model.experts_implementation=padded does nothing here: "
        "PhimoeForCausalLM has no experts gspo computes that way"
    )
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    # an MoE config whose layers are all dense: no router, nothing to say (the reviewer's)
    all_dense = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, mlp_only_layers=[0, 1],
    )  # fmt: skip
    assert unhandled_router(Qwen3MoeForCausalLM(all_dense)) is None
    # handled and dense models: nothing to say
    assert unhandled_router(build_tiny_model(MOE, tokenizer, seed=0)) is None
    dense = TinyModelSpec(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64)
    assert unhandled_router(build_tiny_model(dense, tokenizer, seed=0)) is None


def adapters_that_matter(trainer: Trainer) -> None:
    """LoRA's lora_B starts at 0 (the adapters change nothing, dropout or not): drawn."""
    with torch.no_grad():
        for name, p in trainer.policy.module.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(0))


@pytest.mark.slow
def test_expert_churn_under_lora_dropout_is_the_weights_change_only(tmp_path, varied_reward):
    """With LoRA dropout the churn's forward drew its own dropout masks, while pi_old's
    routing was recorded under the update's (Policy.same_dropout): adapters whose inputs
    were dropped otherwise routed tokens elsewhere, logged as churn that no weight change
    made. At a learning rate that moves no router, the churn is 0."""
    overrides = [
        *FAST_MOE, varied_reward, "model.lora.r=4", "model.lora.dropout=0.5",
        "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]", "optim.lr=1e-12",
    ]  # fmt: skip
    trainer = Trainer(load_config(None, overrides), tmp_path / "run")
    adapters_that_matter(trainer)
    lines = trainer.rl_step(0)
    assert len(lines) == 4  # (FAST_MOE's 4 minibatches)
    assert [line["moe/expert_change_fraction"] for _, line in lines] == [0.0] * 4


@pytest.mark.slow
def test_lora_dropout_and_the_churn_hook_leave_the_global_generator_alone(tmp_path, varied_reward):
    """The dropout masks' seeding (Policy.same_dropout) reseeded torch's global generator
    in the loop: around pi_old's recompute, each update's forward and the churn hook's,
    so a user's code (a reward drawing from torch) and the model's other draws got a
    stream the run chose. Now the generator's state is the same after each hook, and
    after a whole rollout batch, as before; the churn measured or not, the updates are
    the same, bit for bit."""
    from gspo.training.hooks import ExpertChurn

    common = [
        *FAST_MOE, varied_reward, "model.lora.r=4", "model.lora.dropout=0.5",
        "model.lora.target_modules=[q_proj,v_proj]",
    ]  # fmt: skip
    runs = {}
    for churn in (True, False):
        config = load_config(None, [*common, f"moe.measure_churn={churn}"])
        trainer = Trainer(config, tmp_path / f"churn{churn}")
        hooks = [h for h in trainer.update_stage.hooks if isinstance(h, ExpertChurn)]
        assert len(hooks) == int(churn)
        same: list[bool] = []
        for hook in hooks:
            measure = hook.after_update

            def after_update(*args, measure=measure, same=same):
                state = torch.get_rng_state()
                out = measure(*args)
                same.append(torch.equal(state, torch.get_rng_state()))
                return out

            hook.after_update = after_update
        torch.manual_seed(1234)
        state, drawn = torch.get_rng_state(), torch.rand(3)
        torch.set_rng_state(state)
        runs[churn] = [line for _, line in trainer.rl_step(0)]
        assert torch.equal(torch.rand(3), drawn)
        assert same == [True] * 4 * int(churn)
    assert "moe/expert_change_fraction" in runs[True][0]
    for on, off in zip(runs[True], runs[False], strict=True):
        for key in ("train/loss", "train/grad_norm", "train/ratio_max", "train/clip_fraction"):
            assert on[key] == off[key], key


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "skipped"),
    [
        (["model.lora.dropout=0.3"], "model.lora.dropout"),
        (["model.lora.dropout=0", "moe.routing_replay=true"], "moe.routing_replay"),
        (["model.lora.dropout=0"], None),
    ],
)
def test_gradient_cosines_are_the_runs_or_say_why_not(tmp_path, varied_reward, extra, skipped):
    """One on-policy minibatch: the run's ratios are all 1, so the whole batch's gradient
    with the run's ratios is its ratio-1 gradient (cosine 1). The halves' forwards drew
    dropout masks of their own and read 0.30; under Routing Replay they did not replay the
    run's routing. Such dumps now hold no cosines but the reason."""
    overrides = [
        *FAST_MOE, varied_reward, "algorithm.minibatches=1", "log.ratio_dump_every=1",
        "model.lora.r=4", "model.lora.target_modules=[q_proj,v_proj]", *extra,
    ]  # fmt: skip
    trainer = Trainer(load_config(None, overrides), tmp_path / "run")
    adapters_that_matter(trainer)
    trainer.rl_step(0)
    dump = torch.load(tmp_path / "run" / "ratios" / "rollout-000000.pt")
    assert dump["token_log_ratio"].abs().max() < 1e-5  # (on-policy: the run's ratios are 1)
    if skipped is None:
        assert "gradient_noise_skipped" not in dump
        assert dump["cosine_full_to_on_policy"].item() == pytest.approx(1.0, abs=1e-5)
    else:
        assert skipped in dump["gradient_noise_skipped"]
        assert not any(key.startswith("cosine_") for key in dump)


@pytest.mark.slow
def test_routing_replay_with_activation_checkpointing(tmp_path, varied_reward):
    """Refused before: the replay ended with the forward, so the backward's recompute of
    each checkpointed layer routed anew (torch's CheckpointError once the routers moved).
    The replay now lasts through the backward: the same losses and gradient norms as
    without checkpointing, minibatch for minibatch, while the routers do move (lr 3e-2)."""
    common = [*FAST_MOE, varied_reward, "moe.routing_replay=true", "algorithm.level=token"]
    runs = {}
    for on in (False, True):
        config = load_config(None, [*common, f"model.activation_checkpointing={on}"])
        runs[on] = [line for _, line in Trainer(config, tmp_path / f"ckpt{on}").rl_step(0)]
    assert len(runs[True]) == 4
    for plain, checkpointed in zip(runs[False], runs[True], strict=True):
        for key in ("train/loss", "train/grad_norm", "moe/expert_change_fraction"):
            assert checkpointed[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-7), key
    assert max(line["moe/expert_change_fraction"] for line in runs[True]) > 0


def _router_forwards() -> dict[str, str]:
    """Each top-k router class of the installed transformers and its ``forward``'s code
    (read from the sources, nothing imported)."""
    import ast
    from pathlib import Path

    import transformers

    forwards = {}
    for path in Path(transformers.__file__).parent.glob("models/*/modeling_*.py"):
        text = path.read_text()
        if "Router" not in text:
            continue
        for node in ast.parse(text).body:
            if isinstance(node, ast.ClassDef) and node.name.lower().endswith("topkrouter"):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == "forward":
                        forwards[node.name] = ast.unparse(item)
    return forwards


def test_every_router_that_runs_a_handled_routers_code_is_handled():
    """transformers copies a router into each new family (Mellum's and Qwen4-Exp's run
    Qwen3-MoE's forward line for line): such a copy went unhandled (no churn, no replay,
    a warning) until named here."""
    forwards = _router_forwards()
    handled = {name: forwards[name] for name in [*ROUTERS, *SCORED_ROUTERS] if name in forwards}
    assert "Qwen3MoeTopKRouter" in handled
    copies = sorted(
        name for name, code in forwards.items()
        if name not in handled and code in handled.values()
    )  # fmt: skip
    assert copies == []
