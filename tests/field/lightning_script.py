"""A Lightning script: a ``LightningModule`` trained by ``Trainer.fit``.

``training_step`` returns the loss and calls ``self.log``; ``configure_optimizers`` returns an
Adam optimizer with a ``StepLR`` scheduler; ``validation_step`` on a held-out loader; the
``Trainer`` on the CPU, with ``max_steps``, no logger, no checkpoints, no progress bar.
Lightning runs forward and backward inside ``optimizer.step(closure)``.

FIELD_FAULT=nan: the log of a negative number in the forward pass of step 9.
"""

import os

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

FAULT = os.environ.get("FIELD_FAULT", "")


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 3))
        self.poisoned = False

    def forward(self, x):
        z = self.l1(x)
        if self.poisoned:
            z = torch.log(z - 50.0)  # <- fault
        return z


class LitAutoEncoder(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.decoder = nn.Sequential(nn.Linear(3, 32), nn.ReLU(), nn.Linear(32, 12))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        self.encoder.poisoned = FAULT == "nan" and self.global_step == 9
        x_hat = self.decoder(self.encoder(x))
        loss = F.mse_loss(x_hat, x)
        self.log("train_loss", loss)
        if self.global_step % 5 == 0:
            print(f"step {self.global_step}: loss {loss.item():.4f}")
        return loss

    def validation_step(self, batch, batch_idx):
        (x,) = batch
        self.log("val_loss", F.mse_loss(self.decoder(self.encoder(x)), x))

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=3e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


def main():
    L.seed_everything(7, verbose=False)
    basis = torch.randn(3, 12)
    data = torch.randn(320, 3) @ basis + 0.05 * torch.randn(320, 12)
    train = DataLoader(TensorDataset(data[:256]), batch_size=16, shuffle=True)
    val = DataLoader(TensorDataset(data[256:]), batch_size=64)
    model = LitAutoEncoder()
    trainer = L.Trainer(
        max_steps=30,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1,
    )
    trainer.fit(model, train, val)
    print(f"finished at step {trainer.global_step}")


if __name__ == "__main__":
    main()
