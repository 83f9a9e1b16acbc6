"""The baseline: a plain TRL GRPOTrainer script with the same settings as a job spec, and nothing of ours
around it (no checkpoint store, no manifests, no signal handling, no MLflow). Prints HF's train metrics.

    python bench/plain_trl.py --spec job.json
"""

import argparse
import json

from datasets import load_dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from grpo_pipeline.trainer.rewards import correct_answer, number_only
from grpo_pipeline.trainer.spec import JobSpec


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    spec = JobSpec.read(parser.parse_args().spec)

    tokenizer = AutoTokenizer.from_pretrained(spec.model_path)
    model = AutoModelForCausalLM.from_pretrained(spec.model_path, dtype="float32")
    args = GRPOConfig(
        output_dir=spec.work_dir,
        save_steps=spec.train.checkpoint_every,
        save_total_limit=spec.train.keep_checkpoints,
        bf16=False,
        report_to=[],
        **spec.train.grpo,
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
