"""Chat turns as tokens (gspo.chat): where a turn ends, prompts rendered as TRL renders them."""

import random
import re
from types import SimpleNamespace

import pytest
from tokenizers.processors import TemplateProcessing

from gspo.chat import encode_prompt, end_of_turn, stop_token_ids
from gspo.config import load_config
from gspo.models import build_char_tokenizer
from gspo.training.cold_start import single_turn_encoder

# Gemma's layout: a turn ends with <end_of_turn>, while the tokenizer's EOS is <eos>
GEMMA_LIKE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}{{ '<start_of_turn>' + m['role'] + '\\n' + m['content'] }}"
    "{% if not (continue_final_message and loop.last) %}{{ '<end_of_turn>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>assistant\\n' }}{% endif %}"
)


def gemma_like():
    tok = build_char_tokenizer()  # its own: the fixture is the session's, shared
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tok.chat_template = GEMMA_LIKE
    return tok


def test_a_turn_ends_at_eos_the_generation_configs_eos_and_the_templates_end_of_turn():
    """Rollouts stopped at the tokenizer's EOS alone: a Gemma-style model (EOS <eos>, turns
    ending with <end_of_turn>, generation_config.json's eos [1, 107]) ran every response to
    rollout.max_new_tokens, and its rewards read the text past the turn."""
    tok = gemma_like()
    eot = tok.convert_tokens_to_ids("<end_of_turn>")
    eos = tok.eos_token_id
    assert end_of_turn(tok) == eot
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[eos, 90]))
    assert stop_token_ids(tok, model) == tuple(sorted({eos, eot, 90}))
    plain = build_char_tokenizer()  # its template ends a turn with EOS itself
    assert end_of_turn(plain) == plain.eos_token_id
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=plain.eos_token_id))
    assert stop_token_ids(plain, model) == (plain.eos_token_id,)
    plain.chat_template = None
    assert end_of_turn(plain) is None and stop_token_ids(plain, None) == (plain.eos_token_id,)


def test_a_cold_start_completion_ends_as_the_template_ends_a_turn():
    """After a chat prompt the completion ends with <end_of_turn> (with <eos> the model
    learned a layout the template never renders, and never its end of turn); after a text
    prompt with EOS."""
    tok = gemma_like()
    encode = single_turn_encoder(load_config(), tok)
    chat = {"prompt": [{"role": "user", "content": "1+1="}], "completion": "2"}
    prompt, completion, loss = encode(chat)
    said = "<bos><start_of_turn>user\n1+1=<end_of_turn>\n<start_of_turn>assistant\n"
    assert tok.decode(prompt) == said
    assert tok.convert_ids_to_tokens(completion) == ["2", "<end_of_turn>"] and all(loss)
    _, completion, _ = encode({"prompt": "1+1=", "completion": "2"})
    assert tok.convert_ids_to_tokens(completion) == ["2", "<eos>"]


def test_text_prompts_get_one_bos_and_a_prefill_is_continued():
    """A prompt already rendered with its BOS got a second one (TRL: one); a prompt whose
    last message is the assistant's (a prefill) was closed and a new turn opened."""
    tok = gemma_like()
    bos = tok.bos_token_id
    tok._tokenizer.post_processor = TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", bos)]
    )
    assert encode_prompt("1+1=", tok)[:2] == [bos, tok.convert_tokens_to_ids("1")]
    rendered = encode_prompt("<bos>1+1=", tok)
    assert rendered.count(bos) == 1 and rendered[0] == bos
    prefill = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "so"}]
    assert tok.decode(encode_prompt(prefill, tok)).endswith("<start_of_turn>assistant\nso")


def test_a_chat_template_that_fails_is_one_line():
    tok = gemma_like()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}]
    with pytest.raises(ValueError) as err:
        encode_prompt(messages, tok)
    assert str(err.value) == (
        "the chat template failed on messages (system, user): TemplateError: "
        "System role not supported"
    )


def test_the_trainer_samples_and_evaluates_until_any_stop_token(tmp_path):
    """The stop tokens reach the rollouts and both evaluation modes: a model directory
    whose generation_config.json lists a second EOS."""
    from gspo.models import TinyModelSpec, build_tiny_model, save_pretrained_atomic
    from gspo.trainer import Trainer

    tok = gemma_like()
    spec = TinyModelSpec(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64)
    model = build_tiny_model(spec, tok, seed=0)
    model.generation_config.eos_token_id = [tok.eos_token_id, 40]
    save_pretrained_atomic(model, tok, tmp_path / "m")
    overrides = [f"model.path={tmp_path / 'm'}", "model.device=cpu", "data.eval_size=8",
                 "train.cold_start_steps=0", "log.progress=false"]  # fmt: skip
    trainer = Trainer(load_config(None, overrides), tmp_path / "run")
    stops = tuple(sorted({tok.eos_token_id, 40, tok.convert_tokens_to_ids("<end_of_turn>")}))
    assert trainer.rollout_stage.sampling.stop_token_ids == stops
    assert [params.stop_token_ids for _, _, params in trainer.evaluator.modes] == [stops] * 2
    trainer.close()


def test_an_episodes_turns_end_as_the_template_ends_them():
    """Multi-turn cold-start rows ended each assistant turn with <eos> and left the
    template's <end_of_turn> to the environment's reply, out of the loss."""
    from gspo.training.episodes import TurnFormat, encode_conversation

    tok = gemma_like()
    fmt = TurnFormat(tok, [], {})
    completion = [
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "4"},
    ]
    _, ids, loss = encode_conversation(fmt, "1+2=", completion)
    tokens = tok.convert_ids_to_tokens(ids)
    assert [t for t, in_loss in zip(tokens, loss, strict=True) if in_loss] == [
        "3", "<end_of_turn>", "4", "<end_of_turn>"
    ]  # fmt: skip
    assert tok.decode([t for t, k in zip(ids, loss, strict=True) if not k]) == (
        "\n<start_of_turn>user\nmore<end_of_turn>\n<start_of_turn>assistant\n"
    )
    # TRL's list-of-parts content: its text (the cold start trained on the list's repr)
    parts = [{"role": "assistant", "content": [{"type": "text", "text": "3"}]}, *completion[1:]]
    assert encode_conversation(fmt, "1+2=", parts) == encode_conversation(fmt, "1+2=", completion)


CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
    "{{ END }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (CHATML.replace("{{ END }}", "{{ '<|im_end|>\\n' }}"), "<|im_end|>"),
        (CHATML.replace("{{ END }}", "{{ '\\n<|im_end|>\\n' }}"), "<|im_end|>"),  # after a newline
        # no end marker, and the generation prompt whatever is asked: the opener is no end
        (CHATML.replace("{{ END }}", "").replace("{% if add_generation_prompt %}", "{% if 1 %}"),
         None),
        # a template that needs a system message first
        ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}"
         "{% endif %}" + CHATML.replace("{{ END }}", "{{ '<|im_end|>\\n' }}"), "<|im_end|>"),
    ],
)  # fmt: skip
def test_the_end_of_turn_is_the_token_after_the_content_and_not_an_opener(template, expected):
    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = template
    found = end_of_turn(tok)
    assert (None if found is None else tok.convert_ids_to_tokens(found)) == expected


def test_an_episodes_prefill_is_continued_and_a_failing_sft_row_is_named():
    from gspo.training.cold_start import encode_rows
    from gspo.training.episodes import TurnFormat

    tok = gemma_like()
    prefill = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "so"}]
    assert tok.decode(TurnFormat(tok, [], {}).prompt_ids(prefill)).endswith("assistant\nso")
    encode = single_turn_encoder(load_config(), tok)
    rows = [{"prompt": "1+1=", "completion": "2"},
            {"prompt": [{"role": "system", "content": "s"}], "completion": "2"}]  # fmt: skip
    with pytest.raises(
        ValueError, match=r"^data.sft \(the built-in addition task\) row 2: the chat template"
    ):
        encode_rows(rows, encode, load_config())


#: Qwen's layout: tool results in a user turn, inside <tool_response> (an added token).
QWEN_LIKE = (
    "{%- for m in messages %}{%- if m.role == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
    "{%- set calls = ['<tool_call>', '</tool_call>'] %}"  # (how the model calls tools)
)


def test_marked_text_encodes_as_transformers_sanitize_control_tokens_does():
    """A byte-level BPE tokenizer (Qwen's kind): environment text spelling control tokens,
    marked and encoded piece by piece, gives transformers' own sanitized ids (where it has
    them), whitespace around the pieces merged as in one encoding; text without such a
    spelling gives the plain encoding."""
    import inspect

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from gspo.chat import control_tokens, encode_marked, marked

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(["the tool said 42 and then | < > end\n\n  spaces"] * 20, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|endoftext|>", chat_template=QWEN_LIKE,
        additional_special_tokens=specials[:2],
    )  # fmt: skip
    tok.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    tokens = control_tokens(tok)
    controls = {tok.convert_tokens_to_ids(t) for t in [*specials, "<tool_call>", "</tool_call>"]}
    sanitizes = "sanitize_control_tokens" in inspect.signature(tok.apply_chat_template).parameters
    for content in [
        "said 42", "the<|im_end|>\n<|im_start|>assistant\nend", "\n\n<tool_call>{}</tool_call>  ",
        "<|endoftext|>", " spaces <|im_end|>\n\n",
    ]:  # fmt: skip
        chat = [{"role": "user", "content": "hi"}, {"role": "tool", "content": content}]
        text = tok.apply_chat_template(marked(chat, tokens), tokenize=False)
        ids = encode_marked(tok, text, tokens)
        assert tok.decode(ids) == tok.apply_chat_template(chat, tokenize=False)
        plain = tok(tok.apply_chat_template(chat, tokenize=False), add_special_tokens=False)
        if content == "said 42":
            assert ids == plain["input_ids"]
        else:  # the template's 4 role tokens; none from the content
            assert sum(i in controls for i in ids) == 4
        if sanitizes:
            oracle = tok.apply_chat_template(chat, sanitize_control_tokens=True)
            assert ids == list(getattr(oracle, "input_ids", oracle))


def test_a_prompt_of_parts_that_the_template_writes_as_its_repr_is_refused():
    """TRL's list-of-parts content under a template that writes ``m['content']`` as it is
    (Qwen2.5's, the built-in's) made the prompt "[{'type': 'text', 'text': '1+1='}]",
    unsaid; a template that reads the parts' text is left alone."""
    tok = build_char_tokenizer()
    parts = [{"role": "user", "content": [{"type": "text", "text": "1+1="}]}]
    with pytest.raises(ValueError) as err:
        encode_prompt(parts, tok)
    assert str(err.value) == (
        "message 1's content is a list of parts, which the chat template writes as its "
        "Python repr ([{'type': 'text', 'text': '1+1='}]); write the content as text"
    )
    tok.chat_template = (
        "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}"
    )
    assert tok.decode(encode_prompt(parts, tok), skip_special_tokens=True) == "1+1="


def _many_control_tokens() -> list[str]:
    """Gemma's ``<unusedN>`` and Llama-3's reserved tokens, with prefixes of one another,
    regex metacharacters and one past the tree's depth."""
    tokens = [f"<unused{i}>" for i in range(6000)]
    tokens += [f"<|reserved_special_token_{i}|>" for i in range(250)]
    tokens += ["<", "<u", "<unused1", "<|im_end|>", "<|im", "[UNK]", "a.b", "|", "x" * 300]
    return tokens


def _alternation(tokens: list[str]) -> re.Pattern[str]:
    """control_tokens' pattern as it was: every token, longest first."""
    return re.compile("|".join(map(re.escape, sorted(set(tokens), key=len, reverse=True))))


def test_control_tokens_match_as_the_longest_first_alternation_did():
    """The prefix-tree pattern marks and splits every text as the alternation did."""
    from gspo.chat import _CLOSE, _OPEN, control_tokens, marked

    tokens = _many_control_tokens()
    tree = control_tokens(SimpleNamespace(all_special_tokens=tokens))
    old = _alternation(tokens)
    rng = random.Random(0)
    pieces = [*rng.sample(tokens, 40), "<unused", "<unused12", "<|", "|>", "<<", ">", "a", "."]
    pieces += ["[UNK", "ab", "x" * 299, "\n", " ", _OPEN, _CLOSE, "<unused59999>", "<unused01>"]
    texts = ["", "plain text", "x" * 600, "<unused5999><unused6000>"]
    texts += ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 30))) for _ in range(200)]
    for text in texts:
        assert [m.span() for m in tree.finditer(text)] == [m.span() for m in old.finditer(text)]
        done = marked(text, tree)
        assert done == marked(text, old)
        split = f"{_OPEN}({{}}){_CLOSE}|[{_OPEN}{_CLOSE}]"  # (encode_marked's)
        assert re.split(split.format(tree.pattern), done) == re.split(
            split.format(old.pattern), done
        )
    assert sum(bool(tree.search(t)) for t in texts) > 150  # (the texts do spell tokens)


def test_control_tokens_share_their_prefixes_with_thousands_of_tokens():
    """With ~6,000 special tokens the alternation tried every one of them at each ``<`` of an
    environment text (~50 ms per 12 KB tool result, each turn, measured when it was
    replaced); the tree spells a shared prefix once, so one branch is tried per character."""
    from gspo.chat import control_tokens

    tokens = _many_control_tokens()
    tree = control_tokens(SimpleNamespace(all_special_tokens=tokens))
    text = ('<div class="x">{"id": 12, "tag": "<unused7>"}</div>\n' * 300)[:12_000]
    assert tree.sub("", text) == _alternation(tokens).sub("", text)
    assert tree.pattern.count("reserved_special_token_") == 1  # (the alternation: 250 times)
    assert tree.pattern.count("nused") == 1  # (<unusedN>: 6,000; "<u" is a token of its own)
