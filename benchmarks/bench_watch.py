"""What ``hookscope watch`` costs: a whole training command, watched against bare.

Method: paired, interleaved wall-clock timing of whole commands (fresh processes each time).
Each pair runs ``python train.py`` and ``hookscope watch -- python train.py`` back to back,
alternating which goes first; the ratio is median(watched) / median(bare). The watched time
is split into the child's own share (the same script with the start-up hook's environment
set by hand, no parent: discovery and the Monitor, ``every=10``) and the parent's fixed
share, timed inside each watched run from the script's first and last line: its start-up
before the script (``import hookscope`` imports torch) and ``report.html`` after it.

The script trains a 3-block CNN ((conv3x3-BN-ReLU) x2 + MaxPool per block, 3->16->32->64
channels, linear head) on random 16x3x32x32 batches with SGD for ``--steps`` steps.

Start-up: a process that never steps an optimizer (``python -c pass``, and ``python -c
"import torch"``, the torchrun launcher's and a spawned DataLoader worker's case) with and
without the start-up hook's environment, ``--startup`` alternating pairs.

    python benchmarks/bench_watch.py [--quick] [--model cnn|gpt] [--pairs N] [--steps N] [--startup N]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hookscope._watch import Settings, child_env

TRAIN = """
import os, time
started = time.time()
import torch, torch.nn as nn
torch.manual_seed(0)
torch.set_num_threads({threads})

def block(cin, cout):
    return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
            nn.MaxPool2d(2)]

model = nn.Sequential(*block(3, 16), *block(16, 32), *block(32, 64), nn.Flatten(),
                      nn.Linear(64 * 4 * 4, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
criterion = nn.CrossEntropyLoss()
for step in range({steps}):
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    loss = criterion(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    loss.item()
with open(os.environ["BENCH_TIMES"], "w") as f:
    f.write(f"{{started}} {{time.time()}}")
"""

# --model gpt: a small GPT trained as the common GPT trainers do (loss computed in forward and
# returned with the logits, AdamW, gradient clipping), 60 steps by default.
TRAIN_GPT = """
import os, time
started = time.time()
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
torch.set_num_threads({threads})

class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))

class GPT(nn.Module):
    def __init__(self, vocab=256, d=128, layers=4, heads=4, length=64):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(length, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
    def forward(self, idx, targets=None):
        t = idx.size(1)
        mask = torch.triu(torch.full((t, t), float("-inf")), 1)
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for block in self.blocks:
            x = block(x, mask)
        logits = self.head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss

model = GPT()
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
data = torch.randint(0, 256, (4096,))
for step in range({steps}):
    i = torch.randint(0, len(data) - 65, (8,))
    x = torch.stack([data[j:j + 64] for j in i]); y = torch.stack([data[j + 1:j + 65] for j in i])
    _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); opt.zero_grad(set_to_none=True)
    loss.item()
with open(os.environ["BENCH_TIMES"], "w") as f:
    f.write(f"{{started}} {{time.time()}}")
"""


_PHASES: list[tuple[float, float]] = []  # watched runs: (before the script, after it)


def _run(command: list[str], env: dict[str, str] | None = None) -> float:
    times = Path(tempfile.gettempdir()) / f"bench_watch_{os.getpid()}.txt"
    env = {**(env or os.environ), "BENCH_TIMES": str(times)}
    launched, start = time.time(), time.perf_counter()
    subprocess.run(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True
    )
    wall, ended = time.perf_counter() - start, time.time()
    if "watch" in command and times.exists():
        started, finished = map(float, times.read_text().split())
        _PHASES.append((started - launched, ended - finished))
    times.unlink(missing_ok=True)
    return wall


def _paired(a: tuple, b: tuple, pairs: int) -> tuple[list[float], list[float]]:
    """``pairs`` timings of each of two (command, env) runs, alternating which goes first."""
    ta, tb = [], []
    for i in range(pairs):
        if i % 2:
            tb.append(_run(*b))
            ta.append(_run(*a))
        else:
            ta.append(_run(*a))
            tb.append(_run(*b))
    return ta, tb


def _spread(ts: list[float]) -> str:
    return f"{statistics.median(ts):6.2f} s (min {min(ts):.2f}, max {max(ts):.2f})"


def whole_command(pairs: int, steps: int, threads: int, tmp: Path, model: str = "cnn") -> None:
    script = tmp / "train.py"
    script.write_text((TRAIN_GPT if model == "gpt" else TRAIN).format(steps=steps, threads=threads))
    bare = ([sys.executable, str(script)], None)
    out = tmp / "watch"
    watch = ([sys.executable, "-m", "hookscope", "watch", "--out", str(out), "--", *bare[0]], None)
    child = (bare[0], child_env(os.environ, Settings(str(tmp / "child"))))
    _run(*bare), _run(*watch)  # warm the file cache
    tb, tw = _paired(bare, watch, pairs)
    _, tc = _paired(bare, child, pairs)
    mb, mw, mc = (statistics.median(t) for t in (tb, tw, tc))
    before = statistics.median(p[0] for p in _PHASES)
    after = statistics.median(p[1] for p in _PHASES)
    print(f"\nwhole command: {model.upper()}, {steps} steps, every=10, {pairs} pairs")
    print(f"  bare python train.py          {_spread(tb)}")
    print(
        f"  hookscope watch -- ...        {_spread(tw)}   ratio {mw / mb:.2f}x (+{mw - mb:.2f} s)"
    )
    print(
        f"  child alone (hook + Monitor)  {_spread(tc)}   ratio {mc / mb:.2f}x (+{mc - mb:.2f} s)"
    )
    print(f"  the parent, before the script starts (its own start-up): {before:.2f} s")
    print(f"  the parent, after the script ends (report.html):        {after:.2f} s")


def startup(pairs: int, tmp: Path) -> None:
    env = child_env(os.environ, Settings(str(tmp / "never")))
    print(f"\nstart-up of a process that never steps an optimizer, {pairs} pairs (median)")
    for code in ("pass", "import torch"):
        command = [sys.executable, "-c", code]
        plain, hooked = _paired((command, None), (command, env), pairs)
        mp, mh = statistics.median(plain), statistics.median(hooked)
        print(
            f"  python -c {code!r:16} {mp * 1000:7.1f} ms -> {mh * 1000:7.1f} ms ({(mh - mp) * 1000:+.1f} ms)"
        )
    assert not (tmp / "never").exists(), "a process that never stepped wrote a log"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions, short run")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--model", choices=("cnn", "gpt"), default="cnn")
    parser.add_argument("--steps", type=int, default=None, help="default: 200 (cnn), 60 (gpt)")
    parser.add_argument("--startup", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in the script")
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 60 if args.model == "gpt" else 200
    if args.quick:
        args.pairs, args.steps, args.startup = 2, 30, 4
    print(
        f"torch {torch.__version__}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        whole_command(args.pairs, args.steps, args.threads, Path(tmp), args.model)
        startup(args.startup, Path(tmp))


if __name__ == "__main__":
    main()
