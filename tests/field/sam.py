"""Sharpness-aware minimisation (SAM) on scikit-learn's digits: two forward-backward passes
per step.

A ``SAM`` optimizer class of the script's own, a ``torch.optim.Optimizer`` subclass that
wraps a base SGD sharing its ``param_groups``, used the two-pass way: ``first_step`` moves
the weights in place to the worst point within ``rho`` (outside any optimizer step), the
second pass's gradients are taken there, and ``second_step`` puts the weights back
(``p.data = old``) and steps the base optimizer. BatchNorm's running statistics are frozen
during the second pass by setting ``momentum = 0`` and restored after; ``nn.ReLU(inplace=True)``.

FIELD_FAULT=nan: the log of a negative number in the forward passes of step 7.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits

FAULT = os.environ.get("FIELD_FAULT", "")


class SAM(torch.optim.Optimizer):
    def __init__(self, params, base_optimizer, rho=0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        grads = [
            p.grad for group in self.param_groups for p in group["params"] if p.grad is not None
        ]
        grad_norm = torch.norm(torch.stack([g.norm(2) for g in grads]), 2)
        for group in self.param_groups:
            scale = group["rho"] / (grad_norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old"] = p.data.clone()
                p.add_(p.grad * scale)  # climb to the sharpest point nearby
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad=False):
        for group in self.param_groups:
            for p in group["params"]:
                if "old" in self.state[p]:
                    p.data = self.state[p]["old"]  # back to where we were
        self.base_optimizer.step()  # the update, with the sharp point's gradients
        if zero_grad:
            self.zero_grad()

    def step(self, closure=None):
        raise RuntimeError("SAM is used through first_step and second_step")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(inplace=True),
        )
        self.head = nn.Linear(32 * 4 * 4, 10)
        self.poisoned = False

    def forward(self, x):
        x = torch.flatten(self.body(x), 1)
        if self.poisoned:
            x = torch.log(x - 1.0)  # <- fault
        return self.head(x)


def set_bn_momentum(model, momentum):
    """SAM's second pass must not count as a second batch in BatchNorm's running statistics."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.backup_momentum = getattr(m, "backup_momentum", m.momentum)
            m.momentum = m.backup_momentum if momentum is None else momentum


def main():
    torch.manual_seed(5)
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    model = Net()
    optimizer = SAM(model.parameters(), torch.optim.SGD, rho=0.05, lr=0.05, momentum=0.9)
    for step in range(30):
        i = step * 48 % 1500
        xb, yb = x[i : i + 48], y[i : i + 48]
        model.poisoned = FAULT == "nan" and step == 7
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.first_step(zero_grad=True)
        set_bn_momentum(model, 0.0)
        F.cross_entropy(model(xb), yb).backward()
        set_bn_momentum(model, None)
        optimizer.second_step(zero_grad=True)
        if step % 5 == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    model.eval()
    with torch.no_grad():
        accuracy = (model(x[1500:]).argmax(1) == y[1500:]).float().mean().item()
    print(f"held-out accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
