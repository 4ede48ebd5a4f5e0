"""Data-parallel training with a Monitor on every rank: global statistics, one log, one report.

    torchrun --nproc_per_node 2 examples/train_ddp.py   # any launcher that sets RANK etc.
    python examples/train_ddp.py                        # runs that torchrun itself, on the CPU

Every rank builds the same Monitor on its DDP model. Each step, one all_reduce combines the
ranks' figures into what one process would compute on the whole batch; rank 0 writes the log.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import torch.distributed as dist
from torch import nn

import hookscope as hs

LOG_DIR = "runs/ddp"


def train() -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(rank)  # each rank its own shard of the data
    with hs.Monitor(model, every=5, log_dir=LOG_DIR) as mon:  # on every rank
        for _ in range(20):
            x = torch.randn(32, 20, generator=data)
            y = (x[:, 0] > 0).long()
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step(loss=loss)  # the loss is averaged over the ranks
    if rank == 0:
        steps = [r for r in hs.read_log(LOG_DIR) if r["type"] == "step"]
        print(f"{LOG_DIR}: {len(steps)} steps, global over {dist.get_world_size()} ranks")
        print(f"{len(mon.findings)} findings; modules named {sorted(mon.modules)}")
        print(f"report: {hs.report(LOG_DIR)}")


if __name__ == "__main__":
    if "RANK" in os.environ:  # started by torchrun: one of the ranks
        dist.init_process_group("gloo")
        train()
        dist.destroy_process_group()
    else:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        subprocess.run([*torchrun, "--nproc_per_node", "2", __file__], check=True)
        print(f"done: {LOG_DIR}/report.html")
