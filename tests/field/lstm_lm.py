"""A word-level LSTM language model, trained the way the classic language-model examples do.

A corpus of generated sentences tokenised into a dictionary; batchify into columns; truncated
backpropagation through time with the hidden state detached between chunks; tied encoder and
decoder weights; ``clip_grad_norm_``; plain SGD by hand (``p.data.add_(p.grad, alpha=-lr)``),
no ``torch.optim``; the learning rate divided by 4 when the validation loss stops improving.

FIELD_FAULT=nan: the log of a negative number in the forward pass of step 9.
"""

import math
import os
import random

import torch
import torch.nn as nn

FAULT = os.environ.get("FIELD_FAULT", "")

NOUNS = ["cat", "dog", "bird", "child", "farmer", "teacher"]
VERBS = ["sees", "likes", "follows", "feeds", "helps"]
ADJECTIVES = ["small", "old", "happy", "quiet"]


def generate_text(n_sentences, rng):
    lines = []
    for _ in range(n_sentences):
        words = ["the", rng.choice(ADJECTIVES), rng.choice(NOUNS), rng.choice(VERBS)]
        words += ["the", rng.choice(NOUNS)]
        lines.append(" ".join(words) + " .")
    return lines


class Dictionary:
    def __init__(self):
        self.word2idx = {}
        self.idx2word = []

    def add_word(self, word):
        if word not in self.word2idx:
            self.idx2word.append(word)
            self.word2idx[word] = len(self.idx2word) - 1
        return self.word2idx[word]

    def __len__(self):
        return len(self.idx2word)


class Corpus:
    def __init__(self, seed=0):
        rng = random.Random(seed)
        self.dictionary = Dictionary()
        self.train = self.tokenize(generate_text(400, rng))
        self.valid = self.tokenize(generate_text(60, rng))

    def tokenize(self, lines):
        ids = []
        for line in lines:
            for word in [*line.split(), "<eos>"]:
                ids.append(self.dictionary.add_word(word))
        return torch.tensor(ids, dtype=torch.long)


class RNNModel(nn.Module):
    def __init__(self, ntoken, ninp, nhid, nlayers, dropout=0.2):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout if nlayers > 1 else 0.0)
        self.decoder = nn.Linear(nhid, ntoken)
        self.decoder.weight = self.encoder.weight  # tied: needs nhid == ninp
        self.nhid, self.nlayers = nhid, nlayers
        self.poisoned = False
        self.init_weights()

    def init_weights(self):
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        if self.poisoned:
            output = torch.log(output - 1.0)  # <- fault
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.decoder.out_features)
        return nn.functional.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        shape = (self.nlayers, bsz, self.nhid)
        return (weight.new_zeros(shape), weight.new_zeros(shape))


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    return data[: nbatch * bsz].view(bsz, -1).t().contiguous()


def get_batch(source, i, bptt):
    seq_len = min(bptt, len(source) - 1 - i)
    return source[i : i + seq_len], source[i + 1 : i + 1 + seq_len].reshape(-1)


def repackage_hidden(h):
    """Detach the hidden state from the history of the previous chunk."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def evaluate(model, data, criterion, bptt, bsz):
    model.eval()
    total, hidden = 0.0, model.init_hidden(bsz)
    with torch.no_grad():
        for i in range(0, data.size(0) - 1, bptt):
            x, y = get_batch(data, i, bptt)
            output, hidden = model(x, hidden)
            total += len(x) * criterion(output, y).item()
    return total / (len(data) - 1)


def main():
    torch.manual_seed(1111)
    corpus = Corpus()
    bsz, bptt, lr, clip = 10, 12, 4.0, 1.0
    train_data, val_data = batchify(corpus.train, bsz), batchify(corpus.valid, bsz)
    model = RNNModel(len(corpus.dictionary), 24, 24, 1)
    criterion = nn.NLLLoss()
    best_val, step = None, 0
    for epoch in range(1, 3):
        model.train()
        hidden = model.init_hidden(bsz)
        for batch, i in enumerate(range(0, train_data.size(0) - 1, bptt)):
            data, targets = get_batch(train_data, i, bptt)
            hidden = repackage_hidden(hidden)
            model.poisoned = FAULT == "nan" and step == 9
            model.zero_grad()
            output, hidden = model(data, hidden)
            loss = criterion(output, targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
            if batch % 8 == 0:
                print(f"epoch {epoch} batch {batch}: loss {loss.item():.3f}")
            step += 1
        val_loss = evaluate(model, val_data, criterion, bptt, bsz)
        print(f"end of epoch {epoch}: valid loss {val_loss:.3f}, ppl {math.exp(val_loss):.2f}")
        if best_val is None or val_loss < best_val:
            best_val = val_loss
        else:
            lr /= 4.0
    print(f"{step} steps")


if __name__ == "__main__":
    main()
