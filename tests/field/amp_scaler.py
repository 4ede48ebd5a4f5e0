"""A GradScaler that is really enabled on the CPU, with autocast to bfloat16.

``torch.amp.GradScaler("cpu")`` scales the loss, finds non-finite gradients when it unscales,
skips those optimizer steps (``optimizer.step()`` is then never called) and lowers its scale;
``scaler.unscale_`` before ``clip_grad_value_``; the scale printed with the loss.

FIELD_FAULT=nan: the log of a negative number inside the autocast region at step 8 (the
scaler skips that step's update).
"""

import os

import torch
import torch.nn as nn

FAULT = os.environ.get("FIELD_FAULT", "")


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(1, 8, 5, padding=2)
        self.conv2 = nn.Conv1d(8, 8, 5, padding=2)
        self.pool = nn.AdaptiveAvgPool1d(4)
        self.fc = nn.Linear(32, 3)
        self.poisoned = False

    def forward(self, x):
        h = torch.relu(self.conv1(x))
        h = torch.relu(self.conv2(h))
        if self.poisoned:
            h = torch.log(h - 1e3)  # <- fault
        return self.fc(self.pool(h).flatten(1))


def make_signals(n, length=32, seed=0):
    """Three classes of noisy waves: sine, square and sawtooth."""
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(0, 4 * torch.pi, length)
    y = torch.randint(3, (n,), generator=g)
    waves = torch.stack([torch.sin(t), torch.sign(torch.sin(t)), (t % torch.pi) / torch.pi])
    return (waves[y] + 0.3 * torch.randn(n, length, generator=g)).unsqueeze(1), y


def main():
    torch.manual_seed(0)
    x_all, y_all = make_signals(640)
    model = ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    criterion = nn.CrossEntropyLoss()
    for step in range(40):
        model.poisoned = FAULT == "nan" and step == 8
        i = step * 32 % len(x_all)
        x, y = x_all[i : i + 32], y_all[i : i + 32]
        optimizer.zero_grad()
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            loss = criterion(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_value_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        if step % 5 == 0 or step == 8:
            print(f"step {step}: loss {loss.item():.4f}, scale {scaler.get_scale():.0f}")
    print("done")


if __name__ == "__main__":
    main()
