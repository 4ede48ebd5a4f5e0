"""Mixed precision with gradient accumulation, written to run on a GPU or, as here, a CPU.

``torch.autocast`` (bfloat16 on the CPU) around the forward and the loss; a
``torch.amp.GradScaler`` that is only enabled on CUDA (so a no-op here, the way device-agnostic
scripts create it); the loss divided by the accumulation count; ``scaler.unscale_`` before
``clip_grad_norm_``; ``scaler.step`` / ``scaler.update``; ``zero_grad(set_to_none=True)``.

FIELD_FAULT=nan: the log of a negative number inside the autocast region at step 8.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

FAULT = os.environ.get("FIELD_FAULT", "")
device = "cuda" if torch.cuda.is_available() else "cpu"
amp_dtype = torch.float16 if device == "cuda" else torch.bfloat16


class Classifier(nn.Module):
    def __init__(self, n_in=20, n_hidden=64, n_classes=5):
        super().__init__()
        self.fc1 = nn.Linear(n_in, n_hidden)
        self.fc2 = nn.Linear(n_hidden, n_hidden)
        self.head = nn.Linear(n_hidden, n_classes)
        self.poisoned = False

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        h = F.gelu(self.fc2(h)) + h
        if self.poisoned:
            h = torch.log(h - 10.0)  # <- fault
        return self.head(h)


def make_data(n, n_in=20, n_classes=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(n_classes, n_in, generator=g) * 2
    y = torch.randint(n_classes, (n,), generator=g)
    return centers[y] + torch.randn(n, n_in, generator=g), y


def main():
    torch.manual_seed(0)
    x_all, y_all = make_data(1024)
    model = Classifier().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scaler = torch.amp.GradScaler(device, enabled=device == "cuda")
    accum, micro = 4, 16
    for step in range(30):
        model.poisoned = FAULT == "nan" and step == 8
        for k in range(accum):
            i = (step * accum + k) * micro % len(x_all)
            x, y = x_all[i : i + micro].to(device), y_all[i : i + micro].to(device)
            with torch.autocast(device_type=device, dtype=amp_dtype):
                logits = model(x)
                loss = F.cross_entropy(logits, y) / accum
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if step % 5 == 0:
            print(f"step {step}: loss {loss.item() * accum:.4f}, grad norm {grad_norm.item():.4f}")
    print("done")


if __name__ == "__main__":
    main()
