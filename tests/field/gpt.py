"""A small GPT trained on a synthetic character stream, in the style of the popular GPT trainers.

The model computes its loss in ``forward`` and returns ``(logits, loss)``; AdamW with a
decay / no-decay split of the parameters; a cosine schedule with a linear warm-up written into
``param_groups`` by hand; gradient accumulation; ``clip_grad_norm_``; checkpoints saved both
as the whole model and as a dict of state dicts.

FIELD_FAULT=div: a division by zero in the attention scores of step 6.
FIELD_FAULT=lr: from step 10 on, the learning rate is 1000 times too large (clipping hides it).
"""

import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FAULT = os.environ.get("FIELD_FAULT", "")


@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 12
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.n_head = config.n_head
        self.poisoned = False  # set by the training loop when the fault is on
        mask = torch.tril(torch.ones(config.block_size, config.block_size))
        self.register_buffer("bias", mask.view(1, 1, config.block_size, config.block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        scale = 0.0 if self.poisoned else math.sqrt(k.size(-1))
        att = (q @ k.transpose(-2, -1)) / scale  # <- fault
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), dtype=torch.long)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        params = {n: p for n, p in self.named_parameters() if p.requires_grad}
        decay = [p for p in params.values() if p.dim() >= 2]
        no_decay = [p for p in params.values() if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


def get_batch(data, batch_size, block_size, generator):
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    x = torch.stack([data[i : i + block_size] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix])
    return x, y


def get_lr(it, learning_rate, warmup_iters, lr_decay_iters, min_lr):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def main():
    torch.manual_seed(1337)
    out_dir = "out-gpt"
    os.makedirs(out_dir, exist_ok=True)
    max_iters, warmup_iters, accum_steps, batch_size = 40, 5, 2, 8
    learning_rate = 3e-3
    config = GPTConfig()
    # A repeating pattern with noise: learnable in a few dozen steps.
    stream = torch.arange(2000) % (config.vocab_size - 1)
    data = torch.where(torch.rand(2000) < 0.1, config.vocab_size - 1, stream)
    gen = torch.Generator().manual_seed(0)
    model = GPT(config)
    optimizer = model.configure_optimizers(0.1, learning_rate, (0.9, 0.95))
    for it in range(max_iters):
        lr = get_lr(it, learning_rate, warmup_iters, max_iters, learning_rate / 10)
        if FAULT == "lr" and it >= 10:
            lr *= 1000  # <- fault
        for group in optimizer.param_groups:
            group["lr"] = lr
        for block in model.transformer.h:
            block.attn.poisoned = FAULT == "div" and it == 6
        for _ in range(accum_steps):
            X, Y = get_batch(data, batch_size, config.block_size, gen)
            _, loss = model(X, Y)
            loss = loss / accum_steps
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if it % 5 == 0:
            print(f"iter {it}: loss {loss.item() * accum_steps:.4f}, lr {lr:.2e}")
        if it > 0 and it % 20 == 0:
            checkpoint = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "iter_num": it,
                "config": config,
            }
            torch.save(checkpoint, os.path.join(out_dir, "ckpt.pt"))
            torch.save(model, os.path.join(out_dir, "model.pt"))
            print(f"saved a checkpoint to {out_dir}")
    loaded = torch.load(os.path.join(out_dir, "model.pt"), weights_only=False)
    print("reloaded", type(loaded).__name__, sum(p.numel() for p in loaded.parameters()))


if __name__ == "__main__":
    main()
