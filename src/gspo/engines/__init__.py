"""Rollout engines: sample G responses per prompt and return them as a :class:`RolloutBatch`.

:mod:`.batch` holds what every engine takes and returns, :mod:`.torch_engine` samples the
training module itself through :mod:`.decoding`'s KV-cache decoders, and
:mod:`.vllm_engine` (imported only when built) runs vLLM colocated.
"""

from gspo.engines.batch import RolloutBatch, RolloutEngine, SamplingParams, pad_batch
from gspo.engines.sampling import sample_next
from gspo.engines.torch_engine import TorchEngine
