"""A script that compiles its model: ``model = torch.compile(model)`` before training.

A small residual MLP regressor, compiled with the ``aot_eager`` backend (TorchDynamo and
AOTAutograd, as with the default backend, without Inductor's C++ build: a cold Inductor
compile takes some 20 s on a CPU here), trained with Adam and ``OneCycleLR``, and
``optimizer.zero_grad(set_to_none=True)``; the compiled wrapper's ``state_dict`` saved.

FIELD_FAULT=nan: the log of a negative number in the forward pass of step 6.
"""

import os

import torch
import torch.nn as nn

FAULT = os.environ.get("FIELD_FAULT", "")


class ResidualMLP(nn.Module):
    def __init__(self, dim=16, depth=3):
        super().__init__()
        self.inp = nn.Linear(4, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.SiLU()) for _ in range(depth)
        )
        self.out = nn.Linear(dim, 1)
        self.poisoned = False

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        if self.poisoned:
            h = torch.log(h - 100.0)  # <- fault
        return self.out(h).squeeze(-1)


def main():
    torch.manual_seed(0)
    x = torch.rand(512, 4) * 2 - 1
    y = torch.sin(3 * x[:, 0]) * x[:, 1] + x[:, 2] ** 2 - 0.5 * x[:, 3]
    model = ResidualMLP()
    model = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    steps = 30
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=steps)
    for step in range(steps):
        model.poisoned = FAULT == "nan" and step == 6
        i = step * 64 % len(x)
        pred = model(x[i : i + 64])
        loss = nn.functional.mse_loss(pred, y[i : i + 64])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        if step % 5 == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    torch.save(model.state_dict(), "compiled.pt")
    print("saved", len(torch.load("compiled.pt")), "tensors")


if __name__ == "__main__":
    main()
