"""QLoRA as people write it: a 4-bit NF4 base (double quantisation) from a local folder,
peft LoRA adapters on every projection, an 8-bit (paged) AdamW on the adapters, a plain loop
with the probe's lines. ``stepmem estimate --script`` runs it unchanged; so does the H200."""

import argparse

import bitsandbytes as bnb
import torch
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from collector.probe.core import StepProbe

p = argparse.ArgumentParser()
p.add_argument("model", help="a local folder (config.json and safetensors)")
p.add_argument("--seq-len", type=int, default=64)
p.add_argument("--batch", type=int, default=2)
p.add_argument("--rank", type=int, default=16)
p.add_argument("--steps", type=int, default=4)
p.add_argument(
    "--optim", choices=("paged_adamw_8bit", "adamw_8bit", "adamw_torch"), default="paged_adamw_8bit"
)
a = p.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
quant = BitsAndBytesConfig(
    load_in_4bit=True,
    bnb_4bit_quant_type="nf4",
    bnb_4bit_use_double_quant=True,
    bnb_4bit_compute_dtype=torch.bfloat16,
)
model = AutoModelForCausalLM.from_pretrained(
    a.model, quantization_config=quant, dtype=torch.bfloat16, device_map={"": device}
)
model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
lora = LoraConfig(
    r=a.rank,
    lora_alpha=2 * a.rank,
    lora_dropout=0.05,
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    task_type="CAUSAL_LM",
)
model = get_peft_model(model, lora)
params = [p for p in model.parameters() if p.requires_grad]
if a.optim == "paged_adamw_8bit":
    opt = bnb.optim.PagedAdamW8bit(params, lr=2e-4)
elif a.optim == "adamw_8bit":
    opt = bnb.optim.AdamW8bit(params, lr=2e-4)
else:
    opt = torch.optim.AdamW(params, lr=2e-4)
probe = StepProbe().watch(model, opt)
vocab = model.config.vocab_size
for i in range(a.steps):
    ids = torch.randint(0, vocab, (a.batch, a.seq_len), device=device)
    with probe.step(i):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        probe.phase("optimizer")
        opt.step()
        opt.zero_grad(set_to_none=True)
    print(f"step {i}: loss {loss.item():.3f}")
probe.close()
