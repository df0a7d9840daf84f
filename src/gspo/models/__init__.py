"""Models and tokenizers: the tiny built-in ones (:mod:`.builtin`), loading any local HF
causal LM (:mod:`.loading`), completion log-probs (:mod:`.logprobs`, packed as
:mod:`.layout` lays them out) and the CPU's linear
kernels (:mod:`.kernels`). A built-in tiny Qwen3 and a user's Qwen3-8B take the same path."""

from gspo.models.builtin import TinyModelSpec, build_char_tokenizer, build_tiny_model
from gspo.models.kernels import HEAD_CHUNK_BYTES, LOGPROB_CHUNK, head_chunk
from gspo.models.layout import HostCopy, layout_cost, pack_layout, to_device
from gspo.models.loading import (
    MODEL_FINGERPRINT,
    MODEL_POINTER,
    disable_dropout,
    is_model_file,
    length_dependent_rope,
    load_model,
    model_context,
    model_files,
    model_fingerprint,
    resolve_dtype,
    save_pretrained,
    save_pretrained_atomic,
)
from gspo.models.logprobs import (
    CompletionLogprobs,
    WithEntropy,
    completion_logprobs,
    head_logits,
    logprobs_from_hidden,
    packed_completion_logprobs,
    plain_lm_head,
    position_ids_from_mask,
    token_logprobs_from_logits,
)
