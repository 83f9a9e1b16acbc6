"""The baseline: a plain TRL GRPOTrainer script with the same settings as a job spec, and nothing of ours
around it (no checkpoint store, no manifests, no signal handling, no MLflow). Prints HF's train metrics.

The same precision as the trainer on this node (bf16 mixed precision on a CPU with native bf16, float32
elsewhere): a user would set it. Everything else the spec leaves unset stays at TRL's default, gradient
checkpointing included: what such a script gets, and one of the step's cuts (bench.step_profile) undoes.

    python bench/plain_trl.py --spec job.json
"""

import argparse
import json

import torch
from datasets import load_dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from grpo_pipeline.trainer.precision import node_default_bf16
from grpo_pipeline.trainer.rewards import correct_answer, number_only
from grpo_pipeline.trainer.spec import JobSpec


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    spec = JobSpec.read(parser.parse_args().spec)

    tokenizer = AutoTokenizer.from_pretrained(spec.model_path)
    model = AutoModelForCausalLM.from_pretrained(spec.model_path, dtype="float32")
    grpo = {"bf16": node_default_bf16()} | spec.train.grpo
    args = GRPOConfig(
        output_dir=spec.work_dir,
        save_steps=spec.train.checkpoint_every,
        save_total_limit=spec.train.keep_checkpoints,
        report_to=[],
        use_cpu=grpo["bf16"] and not torch.cuda.is_available(),  # transformers' bf16 without a GPU needs it
        **grpo,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[correct_answer, number_only],
        args=args,
        train_dataset=load_dataset("json", data_files=spec.train_file, split="train"),
        processing_class=tokenizer,
        peft_config=LoraConfig(task_type="CAUSAL_LM", **spec.train.lora),
    )
    output = trainer.train()
    trainer.save_model(spec.adapter_dir)  # after train(): not in train_runtime; the pipeline's stages read it
    print(json.dumps({"metrics": output.metrics}))


if __name__ == "__main__":
    main()
