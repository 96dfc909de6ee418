"""An HF ``Trainer`` script with its own arguments and the stepmem callback.

python benchmarks/scripts/hf_trainer.py MODEL_DIR --batch 2 --seq-len 1024 --grad-accum 2
"""

import argparse
import tempfile

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from collector.probe.hf import StepMemCallback

p = argparse.ArgumentParser()
p.add_argument("model", help="a local folder (config.json and safetensors)")
p.add_argument("--batch", type=int, default=2)
p.add_argument("--seq-len", type=int, default=64)
p.add_argument("--grad-accum", type=int, default=2)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--optim", default="adamw_torch")
a = p.parse_args()

torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
model.config.use_cache = False


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return a.steps * a.batch * a.grad_accum

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, model.config.vocab_size, (a.seq_len,))
        return {"input_ids": ids, "labels": ids}


args = TrainingArguments(
    output_dir=tempfile.mkdtemp(prefix="hf-trainer-"),
    per_device_train_batch_size=a.batch,
    gradient_accumulation_steps=a.grad_accum,
    max_steps=a.steps,
    bf16=torch.cuda.is_available(),  # the CPU (a real-tensor check) trains in float32
    gradient_checkpointing=True,
    optim=a.optim,
    learning_rate=1e-5,
    logging_steps=1,
    save_strategy="no",
    report_to=[],
    dataloader_num_workers=0,
)
Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[StepMemCallback()]).train()
