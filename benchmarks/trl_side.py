"""TRL's side of ``vs_trl.py``: GRPOTrainer running GSPO on the reference workload.

GSPO in TRL is ``importance_sampling_level="sequence"`` with ``loss_type="grpo"``. Run as a
separate process: ``python benchmarks/trl_side.py WORKLOAD_DIR OUTPUT_DIR [STEPS [MAX_NEW_TOKENS
[LR [DEVICE [LORA_RANK]]]]]`` (defaults 32, 32, 1e-4, cpu, 0: the reference schedule; on
``cuda``, bf16; a LoRA rank > 0 trains adapters through TRL's ``peft_config``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

START = time.perf_counter()


def main(
    workload: Path,
    output: Path,
    max_steps: int = 32,
    max_new_tokens: int = 32,
    learning_rate: float = 1e-4,
    device: str = "cpu",
    lora: int = 0,
) -> None:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(Path(__file__).parent))
    from workload import dense

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(workload / "model")
    model = AutoModelForCausalLM.from_pretrained(workload / "model", dtype=torch.float32)
    data = load_dataset("json", data_files=str(workload / "train.jsonl"), split="train")
    args = GRPOConfig(
        output_dir=str(output),
        importance_sampling_level="sequence",
        loss_type="grpo",
        epsilon=3e-4,
        epsilon_high=4e-4,
        beta=0.0,
        num_generations=8,
        per_device_train_batch_size=32,  # one minibatch = 32 completions
        steps_per_generation=4,  # 4 minibatches per rollout batch of 16 prompts x 8
        max_completion_length=max_new_tokens,
        temperature=1.0,
        max_steps=max_steps,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        adam_beta2=0.99,
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=device == "cpu",
        bf16=device != "cpu",
        seed=0,
        disable_tqdm=True,
    )
    peft_config = None
    if lora > 0:  # LoRA as gspo's model.lora.r: all linear layers but the head, alpha 32
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=lora, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"
        )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=dense,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    train_start = time.perf_counter()
    trainer.train()
    result = {
        "train_seconds": time.perf_counter() - train_start,
        "process_seconds_to_end": time.perf_counter() - START,
        "log_history": trainer.state.log_history,
    }
    (output / "trl_result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    extra = sys.argv[3:]
    main(
        Path(sys.argv[1]),
        Path(sys.argv[2]),
        int(extra[0]) if len(extra) > 0 else 32,
        int(extra[1]) if len(extra) > 1 else 32,
        float(extra[2]) if len(extra) > 2 else 1e-4,
        extra[3] if len(extra) > 3 else "cpu",
        int(extra[4]) if len(extra) > 4 else 0,
    )
