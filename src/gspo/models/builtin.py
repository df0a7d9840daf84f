"""The built-in models: a character tokenizer and random-init transformers causal LMs
(Qwen3, Qwen3-MoE) of a given size, made from configs (no hub download)."""

from __future__ import annotations

import string
from dataclasses import dataclass

import torch

#: Characters of the built-in tokenizer: printable ASCII (one token per character).
CHARSET = string.digits + string.ascii_letters + string.punctuation + " \n"
PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"


@dataclass(frozen=True)
class TinyModelSpec:
    """Size of a built-in model (a real transformers architecture, random init)."""

    architecture: str = "qwen3"
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 768
    max_positions: int = 512
    # MoE only (architecture "qwen3_moe"):
    experts: int = 8
    experts_per_token: int = 2
    expert_intermediate: int = 256
    norm_topk_prob: bool = True


#: The built-in tokenizer's chat template: compact, with tool support. The tools' names
#: head the prompt; a user message is its text, an assistant message its text and
#: ``<eos>``, a tool message ``<tool_response>...</tool_response>``.
CHAR_CHAT_TEMPLATE = (
    "{%- if tools %}{{ 'tools: ' }}{%- for t in tools %}"
    "{{ t.function.name if t.function is defined else t.name }}{{ ' ' if not loop.last }}"
    "{%- endfor %}{{ '\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}{{ m.content + '\\n' }}"
    "{%- elif m.role == 'user' %}{{ m.content }}"
    "{%- elif m.role == 'assistant' %}{{ m.content + '<eos>' }}"
    "{%- elif m.role == 'tool' %}{{ '<tool_response>' + m.content + '</tool_response>' }}"
    "{%- endif %}{%- endfor %}"
)


def build_char_tokenizer(charset: str = CHARSET):
    """A character-level fast tokenizer (``tokenizers`` WordLevel over single characters).

    No BOS is added automatically: prompts are encoded as plain characters and the
    model ends a completion with ``<eos>``. Characters outside ``charset`` become ``<unk>``.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, UNK, *dict.fromkeys(charset)])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # (every character its own piece: "." left runs of newlines whole, as one <unk>)
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        chat_template=CHAR_CHAT_TEMPLATE,
    )


def build_tiny_model(spec: TinyModelSpec, tokenizer, seed: int):
    """A randomly initialised transformers causal LM of the given architecture."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.hidden // spec.heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_theta=10000.0,
    )
    if spec.architecture == "qwen3":
        config = Qwen3Config(intermediate_size=spec.intermediate, **common)
    elif spec.architecture == "qwen3_moe":
        config = Qwen3MoeConfig(
            intermediate_size=spec.intermediate,
            moe_intermediate_size=spec.expert_intermediate,
            num_experts=spec.experts,
            num_experts_per_tok=spec.experts_per_token,
            decoder_sparse_step=1,
            norm_topk_prob=spec.norm_topk_prob,
            **common,
        )
    else:
        raise ValueError(
            f"model.builtin architecture must be 'qwen3' or 'qwen3_moe'; got {spec.architecture!r}"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model
