"""A Lightning ``fit``: a causal LM in a ``LightningModule``, bf16 mixed precision, the stepmem
Lightning callback.

    python benchmarks/scripts/lightning_fit.py MODEL_DIR --batch 4 --seq-len 1024
"""

import argparse

import lightning as L
import torch
from transformers import AutoModelForCausalLM

from collector.probe.lightning import StepMemLightningCallback

p = argparse.ArgumentParser()
p.add_argument("model", help="a local folder (config.json and safetensors)")
p.add_argument("--batch", type=int, default=2)
p.add_argument("--seq-len", type=int, default=64)
p.add_argument("--steps", type=int, default=4)
a = p.parse_args()


class CausalLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
        self.model.config.use_cache = False

    def training_step(self, batch: torch.Tensor, i: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-5)


torch.manual_seed(0)
module = CausalLM()
ids = torch.randint(0, module.model.config.vocab_size, (a.steps * a.batch, a.seq_len))
trainer = L.Trainer(
    accelerator="gpu" if torch.cuda.is_available() else "cpu",
    devices=1,
    max_steps=a.steps,
    precision="bf16-mixed",
    logger=False,
    enable_checkpointing=False,
    enable_model_summary=False,
    callbacks=[StepMemLightningCallback()],
)
trainer.fit(module, torch.utils.data.DataLoader(ids, batch_size=a.batch))
