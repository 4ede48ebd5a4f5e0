"""extract_dataset and FeatureStore: rows equal the modules' outputs, resume after a kill gives
the same files without recomputing, other runs are refused, memory and reads stay bounded."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import hookscope as hs
from hookscope import _dataset
from hookscope._dataset import _run, _writer
from hookscope.testing import assert_no_hooks
from models import bert, gpt2

# The job the kill test runs in a subprocess, and the other tests import (same model, same data).
JOB = '''
import os, signal, sys, time
import torch
from torch import nn
import hookscope as hs

torch.set_num_threads(2)


class Counting(nn.Module):
    """Identity that counts forward calls (the model's first layer)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x


class Images(torch.utils.data.Dataset):
    """(image, label) rows, the same for a given index; kills its process at row `kill_at`
    once the ledger lists `wait_for` shards (so the kill comes half-way, deterministically)."""

    def __init__(self, n=64, kill_at=None, ledger=None, wait_for=2, interrupt_at=None):
        self.n, self.kill_at, self.ledger, self.wait_for = n, kill_at, ledger, wait_for
        self.interrupt_at = interrupt_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.interrupt_at:
            raise KeyboardInterrupt
        if i == self.kill_at:
            deadline = time.time() + 20
            while time.time() < deadline:
                if os.path.exists(self.ledger):
                    with open(self.ledger) as f:
                        if f.read().count("\\n") >= self.wait_for:
                            break
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(i)
        return torch.randn(3, 8, 8, generator=g), i % 10


def net():
    torch.manual_seed(0)
    return nn.Sequential(
        Counting(),
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(8, 10), Counting(),
    )


WHERE = ["2", "7"]  # the BatchNorm (before the in-place ReLU) and the pooled features


def run(out, data, **kwargs):
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    model = net()
    store = hs.extract_dataset(model, loader, WHERE, out, shard_rows=16, progress=False, **kwargs)
    return model, store


if __name__ == "__main__":
    out = sys.argv[1]
    run(out, Images(kill_at=int(sys.argv[2]), ledger=os.path.join(out, "rank0.ledger.jsonl")))
'''


@pytest.fixture
def job(tmp_path: Path) -> tuple[Path, dict]:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    return script, runpy.run_path(str(script))


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def per_batch(store_rows: torch.Tensor, inputs: torch.Tensor, fn, batch: int) -> None:
    """Each stored batch equals ``fn`` on that batch, bit for bit."""
    with torch.no_grad():
        for i in range(0, len(inputs), batch):
            assert torch.equal(store_rows[i : i + batch], fn(inputs[i : i + batch]))


# -- rows equal what the modules compute ---------------------------------------------------------


def test_rows_equal_the_cnn_outputs_with_xy_batches_and_mode_restored(job, tmp_path) -> None:
    _, ns = job
    model = ns["net"]()
    model.train()
    model[2].eval()  # a mixed state must come back exactly
    flags = [m.training for m in model.modules()]
    running = model[2].running_mean.clone()
    data = ns["Images"](n=20)
    loader = DataLoader(data, batch_size=8)
    store = hs.extract_dataset(model, loader, ["2", "7"], tmp_path / "out", progress=False)
    assert [m.training for m in model.modules()] == flags
    assert torch.equal(model[2].running_mean, running)
    assert_no_hooks(model)
    assert model[-1].calls == 0  # each forward stopped after the pooled features
    assert len(store) == 20 and store.names == ["2", "7"]
    assert torch.equal(store.index, torch.arange(20))
    assert store["2"].shape == (20, 8, 8, 8) and store["7"].shape == (20, 8)
    x = torch.stack([data[i][0] for i in range(20)])
    model.eval()
    per_batch(store["2"][:], x, model[:3], 8)  # the BatchNorm output, before the in-place ReLU
    per_batch(store["7"][:], x, model[:8], 8)
    assert store.complete


def test_rows_equal_gpt2_blocks_and_bert_layers_with_dict_batches(tmp_path) -> None:
    model = gpt2()
    ids = torch.randint(0, 100, (10, 8))
    store = hs.extract_dataset(
        model,
        DataLoader(ids, batch_size=4),
        ["transformer.h.0", "transformer.h.1.attn"],
        tmp_path / "gpt2",
        progress=False,
    )
    for i in range(0, 10, 4):
        with torch.no_grad():
            hidden = model(ids[i : i + 4], output_hidden_states=True).hidden_states
        assert torch.equal(store["transformer.h.0"][i : i + 4], hidden[1])
        # the attention returns (output, weights): its first tensor is stored
        attn = hs.extract(model, ids[i : i + 4], where="transformer.h.1.attn")
        assert torch.equal(
            store["transformer.h.1.attn"][i : i + 4], attn["transformer.h.1.attn"][0]
        )

    class Texts(Dataset):
        def __len__(self) -> int:
            return 6

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": texts[i], "attention_mask": (texts[i] > 10).long()}

    texts = ids[:6]
    model = bert()
    store = hs.extract_dataset(
        model,
        DataLoader(Texts(), batch_size=4),
        "encoder.layer.0",
        tmp_path / "bert",
        progress=False,
    )
    for i in range(0, 6, 4):
        batch = {"input_ids": texts[i : i + 4], "attention_mask": (texts[i : i + 4] > 10).long()}
        with torch.no_grad():
            hidden = model(**batch, output_hidden_states=True).hidden_states
        assert torch.equal(store["encoder.layer.0"][i : i + 4], hidden[1])


def test_dtype_casts_what_is_stored(job, tmp_path) -> None:
    _, ns = job
    model, store = ns["run"](tmp_path / "out", ns["Images"](n=16), dtype=torch.float16)
    model.eval()
    assert store["7"].dtype == torch.float16 and store["7"][:].dtype == torch.float16
    x = torch.stack([ns["Images"]()[i][0] for i in range(16)])
    per_batch(store["7"][:], x, lambda xb: model[:8](xb).half(), 8)


def test_shuffled_and_distributed_loaders_store_the_data_set_rows(tmp_path) -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh())
    x = torch.randn(30, 4)
    shuffled = DataLoader(x, batch_size=7, shuffle=True)  # unseeded
    store = hs.extract_dataset(model, shuffled, "0", tmp_path / "a", progress=False)
    assert sorted(store.index.tolist()) == list(range(30))
    assert store.index.tolist() != list(range(30))
    per_batch(store["0"][:], x[store.index], model[0], 7)

    sampler = DistributedSampler(x, num_replicas=2, rank=1, shuffle=True, seed=3)
    loader = DataLoader(x, batch_size=4, sampler=sampler, num_workers=2)
    store = hs.extract_dataset(model, loader, "0", tmp_path / "b", progress=False)
    assert store.index.tolist() == list(sampler)
    per_batch(store["0"][:], x[store.index], model[0], 4)


def test_plain_iterables_get_positions(tmp_path) -> None:
    model = nn.Linear(3, 2)
    batches = [torch.randn(4, 3), torch.randn(2, 3)]
    store = hs.extract_dataset(model, batches, "", tmp_path / "a", progress=False)
    assert torch.equal(store.index, torch.arange(6))
    with torch.no_grad():
        assert torch.equal(store[""][4:], model(batches[1]))

    class Moving(DataLoader):
        def __iter__(self):
            return iter(super().__iter__())

    with pytest.warns(hs.HookscopeWarning, match="positions"):
        store = hs.extract_dataset(
            model, Moving(torch.randn(5, 3), batch_size=2), "", tmp_path / "b", progress=False
        )
    assert torch.equal(store.index, torch.arange(5))


def test_outputs_that_alias_the_batch_or_a_buffer_are_copied(tmp_path) -> None:
    class Table(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("table", torch.zeros(4, 3))

        def forward(self, x):
            self.table += x  # a running buffer, returned as is
            return self.table

    def reused():  # a loader that fills one buffer in place
        buffer = torch.empty(4, 3)
        for i in range(3):
            buffer.fill_(i)
            yield buffer

    store = hs.extract_dataset(nn.Identity(), reused(), "", tmp_path / "a", progress=False)
    assert store[""][:, 0].tolist() == [0] * 4 + [1] * 4 + [2] * 4
    store = hs.extract_dataset(Table(), reused(), "", tmp_path / "b", progress=False)
    assert store[""][:, 0].tolist() == [0] * 4 + [1] * 4 + [3] * 4


# -- resume --------------------------------------------------------------------------------------


def test_sigkill_half_way_then_the_same_call_gives_the_same_files_without_recomputing(
    job, tmp_path
) -> None:
    script, ns = job
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    proc = subprocess.run(
        [sys.executable, str(script), str(out), "48"], env=env, capture_output=True, timeout=60
    )
    assert proc.returncode == -9, proc.stderr.decode()
    ledger = [json.loads(line) for line in (out / "rank0.ledger.jsonl").read_text().splitlines()]
    assert [e["batches"] for e in ledger] == [[0, 2], [2, 4]]  # 4 of 8 batches committed

    model, store = ns["run"](out, ns["Images"]())
    assert model[0].calls == 4  # only the 4 batches not committed ran
    fresh = tmp_path / "fresh"
    ns["run"](fresh, ns["Images"]())
    assert files(out) == files(fresh)
    assert len(store) == 64 and store.complete

    model, _ = ns["run"](out, ns["Images"]())  # finished: nothing runs again
    assert model[0].calls == 0
    assert files(out) == files(fresh)


def test_ctrl_c_then_resume_with_an_unseeded_shuffle_keeps_the_first_order(tmp_path) -> None:
    class Rows(Dataset):
        def __init__(self, stop_after: int | None = None) -> None:
            self.stop_after, self.fetched = stop_after, 0

        def __len__(self) -> int:
            return 40

        def __getitem__(self, i: int) -> torch.Tensor:
            if self.fetched == self.stop_after:
                raise KeyboardInterrupt
            self.fetched += 1
            return torch.full((3,), float(i))

    model = nn.Linear(3, 5)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):  # in the 7th batch
        loader = DataLoader(Rows(stop_after=26), batch_size=4, shuffle=True)
        hs.extract_dataset(model, loader, "", out, shard_rows=8, progress=False)
    first = hs.FeatureStore(out)
    assert len(first) == 24 and not first.complete  # the 6 batches computed were committed
    loader = DataLoader(Rows(), batch_size=4, shuffle=True)  # another random order
    store = hs.extract_dataset(model, loader, "", out, shard_rows=8, progress=False)
    assert store.complete and sorted(store.index.tolist()) == list(range(40))
    assert torch.equal(store.index[:24], first.index)
    per_batch(store[""][:], store.index[:, None].float().expand(-1, 3), model, 4)


# -- refusals ------------------------------------------------------------------------------------


def test_another_model_where_dtype_or_data_set_is_refused_and_nothing_overwritten(
    job, tmp_path
) -> None:
    _, ns = job
    out = tmp_path / "out"
    ns["run"](out, ns["Images"](n=24))
    before = files(out)
    loader = DataLoader(ns["Images"](n=24), batch_size=8)

    def refused(match: str, model: nn.Module, where=ns["WHERE"], data=loader, **kw) -> None:
        with pytest.raises(_dataset.FeatureStoreError, match=match) as info:
            hs.extract_dataset(model, data, where, out, shard_rows=16, progress=False, **kw)
        assert isinstance(info.value, (hs.HookscopeError, ValueError))
        assert "pass a new `out`, or delete" in str(info.value)
        assert files(out) == before

    other = ns["net"]()
    with torch.no_grad():
        other[1].weight[0, 0, 0, 0] += 1  # one sampled value of the first conv
    refused("weights differ", other)
    gelu = ns["net"]()
    gelu[5] = nn.GELU()  # no parameter changes, the function does
    refused("model differs", gelu)
    refused("where: the store has", ns["net"](), where=["2", "5"])
    refused("dtype", ns["net"](), dtype=torch.float16)
    refused(
        "dataset_len 24 in the store, 25 now",
        ns["net"](),
        data=DataLoader(ns["Images"](n=25), batch_size=8),
    )

    class Shifted(Dataset):
        def __len__(self) -> int:
            return 24

        def __getitem__(self, i: int):
            x, y = ns["Images"]()[i]
            return x + 1, y

    refused("first batch", ns["net"](), data=DataLoader(Shifted(), batch_size=8))

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(_dataset.FeatureStoreError, match="notes.txt"):
        ns["run"](tmp_path / "mine", ns["Images"](n=8))
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]


def test_modules_must_give_batch_first_rows_of_one_shape(tmp_path) -> None:
    class Transposed(nn.Module):
        def forward(self, x):
            return x.T

    model = nn.Sequential(nn.Linear(3, 4), Transposed())
    with pytest.raises(hs.HookscopeError, match="one row per data-set row"):
        loader = DataLoader(torch.randn(5, 3), batch_size=5)
        hs.extract_dataset(model, loader, "1", tmp_path / "a", progress=False)
    batches = [torch.randn(2, 5, 3), torch.randn(2, 6, 3)]
    with pytest.raises(hs.HookscopeError, match="same shape"):
        hs.extract_dataset(model, batches, "0", tmp_path / "b", progress=False)


# -- memory and reads ----------------------------------------------------------------------------

RSS = """
import resource, sys, torch
from torch import nn
import hookscope as hs
torch.set_num_threads(2)
model = nn.Linear(8, 16384)              # 64 KiB of features per row
x = torch.randn(2048, 8)                 # 128 MiB of features in all
loader = torch.utils.data.DataLoader(x, batch_size=64)   # 4 MiB per batch
with torch.no_grad():
    model(x[:64])
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
store = hs.extract_dataset(model, loader, "", sys.argv[1], buffer_bytes=16 << 20, progress=False)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
print(len(store), store[""].shape[1], grown // 1024)
"""


def test_memory_stays_bounded_when_the_features_exceed_the_budget(tmp_path) -> None:
    # glibc would keep freed 4 MiB blocks in its heap (the peak then measures the allocator, and
    # varies from run to run); a fixed mmap threshold returns them, so RSS is what is held
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    proc = subprocess.run(
        [sys.executable, "-c", RSS, str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    rows, width, grown_mib = map(int, proc.stdout.split())
    assert (rows, width) == (2048, 16384)
    # 16 MiB of buffers, plus the batch being computed and its copy (4 MiB each)
    assert grown_mib < 32, f"peak RSS grew by {grown_mib} MiB for 128 MiB of features"


def test_the_writer_never_holds_more_than_its_budget(tmp_path, monkeypatch) -> None:
    seen = []
    reserve = _writer.Writer.reserve

    def spy(self, nbytes):
        reserve(self, nbytes)
        seen.append(self.pending)

    monkeypatch.setattr(_writer.Writer, "reserve", spy)
    model = nn.Linear(4, 1024)  # 4 KiB per row, 256 KiB per batch
    loader = DataLoader(torch.randn(1024, 4), batch_size=64)
    hs.extract_dataset(
        model, loader, "", tmp_path / "o", buffer_bytes=1 << 20, shard_rows=64, progress=False
    )
    assert len(seen) == 16 and max(seen) <= (1 << 20)


def test_reading_ten_rows_of_a_large_store_loads_only_those_rows(tmp_path, monkeypatch) -> None:
    model = nn.Linear(4, 512)  # 2 KiB per row, 40 MiB in all
    loader = DataLoader(torch.randn(20_000, 4), batch_size=500)
    out = tmp_path / "out"
    hs.extract_dataset(model, loader, "", out, shard_rows=3000, progress=False)

    import safetensors

    asked = []
    real = safetensors.safe_open

    class Spy:
        def __init__(self, handle, key):
            self.handle, self.key = handle, key

        def __getitem__(self, rows):
            asked.append((self.key, rows.stop - rows.start))
            return self.handle.get_slice(self.key)[rows]

    class Opened:
        def __init__(self, *args, **kwargs):
            self.handle = real(*args, **kwargs)

        def get_slice(self, key):
            return Spy(self.handle, key)

    monkeypatch.setattr(safetensors, "safe_open", Opened)
    store = hs.FeatureStore(out)
    assert len(store) == 20_000 and len(store.shards) == 7
    rows = store[""][12_345:12_355]
    assert asked == [("output:", 10)]
    assert rows.untyped_storage().nbytes() == 10 * 512 * 4  # nothing more was read into memory
    with torch.no_grad():
        x = loader.dataset[12_000:12_500]
        assert torch.equal(rows, model(x)[345:355])
    asked.clear()
    across = store[""][2995:3005]  # two shards
    assert asked == [("output:", 5), ("output:", 5)] and across.shape == (10, 512)
    asked.clear()
    picked = store[""][[7, 3, 4, 19_999, 3]]
    assert torch.equal(picked[1], picked[4]) and torch.equal(picked[0], store[""][7])
    assert sorted(n for _, n in asked[:3]) == [1, 1, 2]  # rows 3-4 in one read
    assert torch.equal(store[""][-1], store[""][19_999])
    assert store[""][::5000].shape == (4, 512)


def test_feature_store_errors_and_ranks(tmp_path, monkeypatch) -> None:
    with pytest.raises(_dataset.FeatureStoreError, match="not a hookscope feature store"):
        hs.FeatureStore(tmp_path)
    monkeypatch.setattr(_run, "_rank_and_world", lambda: (1, 2))
    model = nn.Linear(3, 2)
    store = hs.extract_dataset(model, [torch.randn(3, 3)], "", tmp_path / "o", progress=False)
    assert sorted(os.listdir(tmp_path / "o")) == [
        "rank1-000000.safetensors",
        "rank1.ledger.jsonl",
        "rank1.manifest.json",
    ]
    assert len(store) == 3 and not store.complete  # rank 0 has not written yet
    with pytest.raises(KeyError, match=r"it holds \[''\]"):
        store["x"]
    assert "3 rows, incomplete" in repr(store)
