"""A two-headed model with ``OneCycleLR`` that checkpoints and stops cleanly on SIGTERM.

A shared trunk with a classification head and a regression head, their losses summed with
weights; SGD with ``OneCycleLR`` stepped every batch; ``zero_grad(set_to_none=True)``; a SIGTERM
handler that only sets a flag, checked at the end of each step to save a checkpoint and stop
(the preemption pattern of cluster jobs). The script sends itself SIGTERM at step 30, as a
scheduler would, and ends with status 0 after saving.

FIELD_FAULT=lr: from step 12 on, the learning rate is 1000 times what the schedule says.
"""

import os
import signal

import torch
import torch.nn as nn
import torch.nn.functional as F

FAULT = os.environ.get("FIELD_FAULT", "")
stop_requested = False


def request_stop(signum, frame):
    global stop_requested
    stop_requested = True


class MultiTask(nn.Module):
    def __init__(self, n_in=10, hidden=32):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(n_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
        self.cls_head = nn.Linear(hidden, 3)
        self.reg_head = nn.Sequential(nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x):
        h = self.trunk(x)
        return self.cls_head(h), self.reg_head(h).squeeze(-1)


def main():
    signal.signal(signal.SIGTERM, request_stop)
    torch.manual_seed(3)
    x = torch.randn(800, 10)
    w = torch.randn(10, 3)
    y_cls, y_reg = (x @ w).argmax(1), (x[:, :3] ** 2).sum(1)
    model = MultiTask()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=40)
    for step in range(40):
        if FAULT == "lr" and step >= 12:
            for group in optimizer.param_groups:
                group["lr"] *= 1000  # <- fault
        i = step * 32 % len(x)
        logits, value = model(x[i : i + 32])
        loss_cls = F.cross_entropy(logits, y_cls[i : i + 32])
        loss_reg = F.mse_loss(value, y_reg[i : i + 32])
        loss = loss_cls + 0.1 * loss_reg
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        if step % 5 == 0:
            print(f"step {step}: cls {loss_cls.item():.4f}, reg {loss_reg.item():.4f}")
        if step == 30:
            os.kill(os.getpid(), signal.SIGTERM)  # the cluster preempts the job
        if stop_requested:
            torch.save({"step": step, "model": model.state_dict()}, "preempted.pt")
            print(f"SIGTERM: saved a checkpoint at step {step}, exiting")
            return
    print("finished")


if __name__ == "__main__":
    main()
