"""A two-rank Lightning DDP run on CPU, for ``test_integrations.py`` (slow).

Run as a script: Lightning's ``ddp`` launcher starts rank 1 by running this file again.
Writes ``hookscope/`` (the callback's log and report) and ``preclip.rank0.txt`` (the total
gradient norm ``on_before_optimizer_step`` sees on rank 0, one line per optimizer step) under
the directory given as the first argument.
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from torch import nn

from hookscope.integrations.lightning import HookscopeCallback


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class PreClip(L.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if trainer.is_global_zero:
            total = math.sqrt(sum(p.grad.norm().item() ** 2 for p in pl_module.parameters()))
            with self.path.open("a") as f:
                f.write(f"{trainer.global_step} {total!r}\n")


def main(out: Path) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning, module="lightning")
    torch.manual_seed(0)  # the same data on both ranks; the sampler gives each its own rows
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), 10 * torch.randn(64, 1))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=3,
        accumulate_grad_batches=2,
        gradient_clip_val=0.1,
        logger=False,
        default_root_dir=out,
        callbacks=[
            HookscopeCallback(every=1, log_dir=out / "hookscope"),
            PreClip(out / "preclip.rank0.txt"),
        ],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(Regressor(), torch.utils.data.DataLoader(data, batch_size=4))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
