"""A word-level Transformer language model built from ``nn.TransformerEncoder``.

``nn.TransformerEncoderLayer`` (``nn.MultiheadAttention`` inside) with a square causal mask
from ``nn.Transformer.generate_square_subsequent_mask``, sinusoidal positions in a buffer,
Adam with ``StepLR``, ``clip_grad_norm_``, evaluation each epoch under ``torch.no_grad()``.

FIELD_FAULT=nan: the log of negative embeddings in the positional encoding of step 12.
"""

import math
import os
import random

import torch
import torch.nn as nn

FAULT = os.environ.get("FIELD_FAULT", "")

WORDS = {
    "det": ["the", "a"],
    "noun": ["robot", "river", "garden", "engine", "letter"],
    "verb": ["opens", "moves", "finds", "paints"],
}


def make_corpus(n_sentences, seed, vocab):
    rng = random.Random(seed)
    ids = []
    for _ in range(n_sentences):
        sentence = [rng.choice(WORDS[k]) for k in ("det", "noun", "verb", "det", "noun")]
        for word in [*sentence, "<eos>"]:
            ids.append(vocab.setdefault(word, len(vocab)))
    return torch.tensor(ids)


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len=64):
        super().__init__()
        position = torch.arange(max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(1, max_len, d_model)
        pe[0, :, 0::2] = torch.sin(position * div_term)
        pe[0, :, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe)
        self.poisoned = False

    def forward(self, x):
        if self.poisoned:
            x = torch.log(x)  # <- fault
        return x + self.pe[:, : x.size(1)]


class TransformerModel(nn.Module):
    def __init__(self, ntoken, d_model, nhead, d_hid, nlayers, dropout=0.1):
        super().__init__()
        self.pos_encoder = PositionalEncoding(d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead, d_hid, dropout, batch_first=True)
        self.transformer_encoder = nn.TransformerEncoder(layer, nlayers)
        self.embedding = nn.Embedding(ntoken, d_model)
        self.d_model = d_model
        self.linear = nn.Linear(d_model, ntoken)
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        nn.init.zeros_(self.linear.bias)

    def forward(self, src, src_mask):
        src = self.pos_encoder(self.embedding(src) * math.sqrt(self.d_model))
        return self.linear(self.transformer_encoder(src, src_mask, is_causal=True))


def batches(data, batch_size, seq_len):
    n = (len(data) - 1) // seq_len
    x = data[: n * seq_len].view(n, seq_len)
    y = data[1 : n * seq_len + 1].view(n, seq_len)
    return list(zip(x.split(batch_size), y.split(batch_size), strict=True))


def main():
    torch.manual_seed(42)
    vocab = {"<eos>": 0}
    train, valid = make_corpus(500, 0, vocab), make_corpus(60, 1, vocab)
    seq_len = 18
    model = TransformerModel(len(vocab), 32, 2, 64, 2)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.7)
    mask = nn.Transformer.generate_square_subsequent_mask(seq_len)
    step = 0
    for epoch in range(2):
        model.train()
        for x, y in batches(train, 8, seq_len):
            model.pos_encoder.poisoned = FAULT == "nan" and step == 12
            optimizer.zero_grad()
            output = model(x, mask)
            loss = criterion(output.view(-1, len(vocab)), y.reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            if step % 5 == 0:
                print(f"epoch {epoch} step {step}: loss {loss.item():.3f}")
            step += 1
        scheduler.step()
        model.eval()
        with torch.no_grad():
            losses = [
                criterion(model(x, mask).view(-1, len(vocab)), y.reshape(-1)).item()
                for x, y in batches(valid, 8, seq_len)
            ]
        print(f"epoch {epoch}: valid loss {sum(losses) / len(losses):.3f}")


if __name__ == "__main__":
    main()
