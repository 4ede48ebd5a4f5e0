"""A Hugging Face ``Trainer`` script: a custom head on a GPT-2 body built from a config.

A tiny ``GPT2Model`` from a ``GPT2Config`` (random weights, nothing downloaded) under a
classification head written here, whose ``forward`` returns ``{"loss": ..., "logits": ...}``;
a ``torch.utils.data.Dataset`` of dicts; ``TrainingArguments`` with ``max_steps``,
``report_to=[]``, no saving; the Trainer's own printer replaced by a ``TrainerCallback`` that
prints the loss (the Trainer's prints its run time, which changes between runs).

FIELD_FAULT=nan: the log of a negative number in the head's forward pass at step 10.
"""

import os

import torch
import torch.nn as nn
from torch.utils.data import Dataset
from transformers import (
    GPT2Config,
    GPT2Model,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

FAULT = os.environ.get("FIELD_FAULT", "")


class SortedDataset(Dataset):
    """Token sequences, labelled 1 when they are sorted and 0 when shuffled."""

    def __init__(self, n, length=12, vocab=50, seed=0):
        g = torch.Generator().manual_seed(seed)
        seqs = torch.randint(1, vocab, (n, length), generator=g).sort(dim=1).values
        self.labels = torch.randint(2, (n,), generator=g)
        for i in range(n):
            if self.labels[i] == 0:
                seqs[i] = seqs[i][torch.randperm(length, generator=g)]
        self.seqs = seqs

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.seqs[i], "labels": self.labels[i]}


class GPT2Classifier(nn.Module):
    def __init__(self, config, num_labels=2):
        super().__init__()
        self.transformer = GPT2Model(config)
        self.dropout = nn.Dropout(0.1)
        self.score = nn.Linear(config.n_embd, num_labels)
        self.poisoned = False

    def forward(self, input_ids, labels=None):
        hidden = self.transformer(input_ids=input_ids).last_hidden_state
        pooled = self.dropout(hidden.mean(dim=1))
        if self.poisoned:
            pooled = torch.log(pooled - 100.0)  # <- fault
        logits = self.score(pooled)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits, labels)
        return {"loss": loss, "logits": logits}


class LossPrinter(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            print(f"step {state.global_step}: loss {logs['loss']:.4f}")


class Fault(TrainerCallback):
    def on_step_begin(self, args, state, control, model=None, **kwargs):
        model.poisoned = FAULT == "nan" and state.global_step == 10


def main():
    config = GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        vocab_size=50,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = GPT2Classifier(config)
    args = TrainingArguments(
        output_dir="hf-out",
        max_steps=25,
        per_device_train_batch_size=16,
        learning_rate=1e-3,
        warmup_steps=3,
        logging_steps=5,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=SortedDataset(512),
        callbacks=[LossPrinter(), Fault()],
    )
    trainer.remove_callback(PrinterCallback)
    result = trainer.train()
    print(f"trained {result.global_step} steps")


if __name__ == "__main__":
    main()
