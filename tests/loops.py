"""Training loops the probe tests run on the CPU: a plain loop and a Lightning fit over the
tiny Llama of the ``finetune`` workload."""

from __future__ import annotations

import torch

from collector.probe.core import StepProbe
from workloads import finetune


def plain_loop(probe: StepProbe, steps: int = 3, accum: int = 2):
    model = finetune.build_model("tiny", 64, None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    probe.watch(model, opt)
    data = finetune.SyntheticTokens(steps * accum, 64, finetune.SHAPES["tiny"]["vocab_size"])
    for step in range(1, steps + 1):
        with probe.step(step):
            for k in range(accum):
                batch = data[(step - 1) * accum + k]
                out = model(input_ids=batch["input_ids"][None], labels=batch["labels"][None])
                out.loss.backward()
            probe.phase("optimizer")
            opt.step()
            opt.zero_grad()
    probe.close()
    return model, opt


def lightning_fit(callback, batches: int, **trainer_kw) -> None:
    """One Lightning epoch of the tiny model over `batches` batches on the CPU, with `callback`."""
    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = finetune.build_model("tiny", 32, None)

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            loss = self.model(input_ids=ids, labels=ids).loss
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    ids = torch.randint(0, finetune.SHAPES["tiny"]["vocab_size"], (batches, 32))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=1)
    trainer_kw.setdefault("logger", False)
    trainer = L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        **trainer_kw,
    )
    trainer.fit(Tiny(), loader)
