"""A two-process Hugging Face Trainer run on CPU (gloo), for ``test_integrations.py`` (slow).

Run with ``torchrun --nproc_per_node 2 tests/_transformers_ddp.py OUT``. Writes
``OUT/hookscope/`` (the callback's log and report) and, from rank 0, ``OUT/log_history.json``
(what the Trainer logged).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers

import models  # tests/models.py: this script's directory is on sys.path
from hookscope.integrations.transformers import HookscopeCallback


def main(out: Path) -> None:
    torch.manual_seed(0)  # the same data and model on both ranks; the sampler splits the data
    model = models.gpt2(n_embd=32, n_positions=16).train()
    ids = torch.randint(0, 100, (48, 8))
    args = transformers.TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=3,
        logging_steps=1,
        max_grad_norm=0.01,
        learning_rate=1e-3,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=[{"input_ids": row, "labels": row} for row in ids],
        callbacks=[HookscopeCallback(every=1)],
    )
    trainer.train()
    if trainer.is_world_process_zero():
        (out / "log_history.json").write_text(json.dumps(trainer.state.log_history))
    # End as a DDP script should: both ranks done, then the process group torn down (a rank
    # that exits while its peer still holds gloo connections can abort in gloo's destructor).
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
