"""An exponential moving average of the weights kept in a deep copy of the model.

The EMA model is made with ``copy.deepcopy(model)`` after the optimizer exists (as EMA helpers
do), set to eval mode with gradients off, and updated after every step with ``lerp_`` under
``torch.no_grad()``; both models are saved whole with ``torch.save(model, path)``, loaded back
and evaluated.

FIELD_FAULT=nan: the log of a negative number in the forward pass of step 11.
"""

import copy
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

FAULT = os.environ.get("FIELD_FAULT", "")


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 2)
        )
        self.poisoned = False

    def forward(self, x):
        if self.poisoned:
            x = torch.log(x - 10.0)  # <- fault
        return self.net(x)


class ModelEma:
    def __init__(self, model, decay=0.9):
        self.module = copy.deepcopy(model)
        self.module.eval()
        for p in self.module.parameters():
            p.requires_grad_(False)
        self.decay = decay

    @torch.no_grad()
    def update(self, model):
        for ema_v, v in zip(
            self.module.state_dict().values(), model.state_dict().values(), strict=True
        ):
            if ema_v.is_floating_point():
                ema_v.lerp_(v, 1.0 - self.decay)


def two_moons(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(n, generator=g) * torch.pi
    y = torch.randint(2, (n,), generator=g)
    x = torch.stack([torch.cos(t) + y, torch.sin(t) * (1 - 2 * y) + 0.5 * y], dim=1)
    return x + 0.1 * torch.randn(n, 2, generator=g), y


def accuracy(model, x, y):
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def main():
    torch.manual_seed(0)
    x, y = two_moons(512)
    x_val, y_val = two_moons(256, seed=1)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9, nesterov=True)
    ema = ModelEma(model)
    for step in range(40):
        model.poisoned = FAULT == "nan" and step == 11
        i = step * 64 % len(x)
        loss = F.cross_entropy(model(x[i : i + 64]), y[i : i + 64])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ema.update(model)
        if step % 8 == 0:
            print(
                f"step {step}: loss {loss.item():.4f}, ema acc {accuracy(ema.module, x_val, y_val):.3f}"
            )
    torch.save(model, "model.pt")
    torch.save(ema.module, "model_ema.pt")
    for name in ("model.pt", "model_ema.pt"):
        loaded = torch.load(name, weights_only=False)
        print(f"{name}: val acc {accuracy(loaded, x_val, y_val):.3f}")


if __name__ == "__main__":
    main()
