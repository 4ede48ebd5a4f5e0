"""hs.explain_dataset: every sample's map in extract_dataset's resumable store. Rows equal
hs.explain on the same batches (a torchvision-style ResNet with in-place ReLUs and (x, y)
batches, a ViT from a config with dict batches); a stop half-way resumes to the same files
without explaining the committed batches again; another model, where, method, target or
data set is refused; memory stays within the writer's budget; the model is left as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import hookscope as hs
from hookscope._dataset import _run, _writer
from hookscope.testing import assert_no_hooks
from models import ResNet, vit


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def resnet() -> ResNet:
    torch.manual_seed(0)
    return ResNet(width=4, classes=5).eval()


def state(model: nn.Module) -> tuple:
    return (
        [m.training for m in model.modules()],
        {k: v.clone() for k, v in model.state_dict().items()},
        [p.grad for p in model.parameters()],
    )


def same_state(a: tuple, b: tuple) -> bool:
    return (
        a[0] == b[0]
        and a[1].keys() == b[1].keys()
        and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
        and all(x is None and y is None for x, y in zip(a[2], b[2], strict=True))
    )


class Images(Dataset):
    """(image, label) rows, the same for a given index; raises KeyboardInterrupt at row
    ``stop_at`` (a Ctrl-C half-way)."""

    def __init__(self, n: int = 24, stop_at: int | None = None) -> None:
        self.n, self.stop_at = n, stop_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if i == self.stop_at:
            raise KeyboardInterrupt
        g = torch.Generator().manual_seed(i)
        return torch.randn(3, 16, 16, generator=g), i % 5


class Counting(nn.Module):
    """The model with a count of its forward calls."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model, self.calls = model, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.model(x)


# -- rows equal hs.explain on the same batches --------------------------------------------------


def test_maps_equal_explain_on_each_batch_of_a_shuffled_xy_loader(tmp_path: Path) -> None:
    model = resnet()
    model.layer1.train()  # a mixed mode must come back exactly
    before = state(model)
    data = Images(n=20)
    loader = DataLoader(data, batch_size=8, shuffle=True)
    where = ["layer1.1", "layer2"]
    store = hs.explain_dataset(
        model, loader, where, tmp_path / "out", method="gradcam", target="label", progress=False
    )
    assert same_state(before, state(model))
    assert_no_hooks(model)
    assert len(store) == 20 and store.names == ["layer1.1", "layer2", "target", "score"]
    assert sorted(store.index.tolist()) == list(range(20))
    assert store.index.tolist() != list(range(20))  # shuffled: the rows are the data set's
    assert store["layer1.1"].shape == (20, 8, 8) and store["layer2"].shape == (20, 4, 4)
    x = torch.stack([data[i][0] for i in store.index.tolist()])
    y = torch.tensor([data[i][1] for i in store.index.tolist()])
    assert torch.equal(store["target"][:], y)
    for i in range(0, 20, 8):  # the loader's batches, in the stored order
        exp = hs.explain(model, x[i : i + 8], where, "gradcam", target=y[i : i + 8])
        for name in where:
            assert torch.equal(store[name][i : i + 8], exp[name])
        assert torch.equal(store["score"][i : i + 8], exp.score)


def test_dict_batches_of_a_vit_and_a_callable_target(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = vit()
    pixels = torch.randn(6, 3, 32, 32)

    class Pixels(Dataset):
        def __len__(self) -> int:
            return 6

        def __getitem__(self, i: int) -> dict:
            return {"pixel_values": pixels[i]}

    where = "vit.layers.1.layernorm_before"
    loader = DataLoader(Pixels(), batch_size=4)
    store = hs.explain_dataset(model, loader, where, tmp_path / "a", progress=False)
    assert store[where].shape == (6, 4, 4)  # the class token left out, the 4x4 grid read
    for i in range(0, 6, 4):
        exp = hs.explain(model, (), where, forward_kwargs={"pixel_values": pixels[i : i + 4]})
        assert torch.equal(store[where][i : i + 4], exp[where])
        assert torch.equal(store["target"][i : i + 4], exp.target)

    def third(out):
        return out.logits[:, 3]

    store = hs.explain_dataset(
        model, loader, where, tmp_path / "b", method="hirescam", target=third, progress=False
    )
    assert store.names == [where, "score"]  # no index for a callable target
    exp = hs.explain(
        model, (), where, "hirescam", third, forward_kwargs={"pixel_values": pixels[:4]}
    )
    assert torch.equal(store[where][:4], exp[where])
    assert torch.equal(store["score"][:4], exp.score)


def test_attribution_maps_keep_the_module_output_shape(tmp_path: Path) -> None:
    model = resnet()
    data = TensorDataset(torch.randn(6, 3, 16, 16))
    store = hs.explain_dataset(
        model,
        DataLoader(data, batch_size=3),
        "layer2.0.bn2",
        tmp_path / "o",
        method="integrated_gradients",
        target=2,
        steps=8,
        progress=False,
    )
    assert store["layer2.0.bn2"].shape == (6, 8, 4, 4)
    assert store["target"][:].tolist() == [2] * 6
    exp = hs.explain(model, data.tensors[0][3:], "layer2.0.bn2", "integrated_gradients", 2, steps=8)
    assert torch.equal(store["layer2.0.bn2"][3:], exp["layer2.0.bn2"])


# -- resume ------------------------------------------------------------------------------------


def test_stopped_half_way_the_same_call_ends_with_the_same_files(tmp_path: Path) -> None:
    def run(out: Path, data: Dataset) -> tuple[Counting, hs.FeatureStore]:
        model = Counting(resnet())
        loader = DataLoader(data, batch_size=4)
        store = hs.explain_dataset(
            model, loader, "model.layer2", out, target="label", shard_rows=8, progress=False
        )
        return model, store

    out = tmp_path / "stopped"
    with pytest.raises(KeyboardInterrupt):  # loading row 13: batch 3, after shard [0, 2)
        run(out, Images(stop_at=13))
    first = hs.FeatureStore(out)
    assert len(first) == 8 and not first.complete  # one full shard committed, one dropped
    model, store = run(out, Images())
    assert model.calls == 4  # batches 2..5 only: the committed ones are not explained again
    fresh = tmp_path / "fresh"
    run(fresh, Images())
    assert files(out) == files(fresh)
    assert store.complete and len(store) == 24
    model, _ = run(out, Images())  # finished: nothing runs again
    assert model.calls == 0 and files(out) == files(fresh)


# -- refusals ----------------------------------------------------------------------------------


def test_another_model_where_method_target_or_data_set_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    model = resnet()
    loader = DataLoader(Images(n=12), batch_size=4)
    hs.explain_dataset(model, loader, "layer2", out, method="gradcam", progress=False)
    before = files(out)

    def refused(match: str, model=model, where="layer2", data=loader, **kw) -> None:
        with pytest.raises(hs.FeatureStoreError, match=match) as info:
            hs.explain_dataset(model, data, where, out, progress=False, **kw)
        assert str(info.value).startswith("explain_dataset: ")
        assert "pass a new `out`, or delete" in str(info.value)
        assert files(out) == before

    refused("method: the store has 'gradcam', this call has 'layercam'", method="layercam")
    refused("target: the store has None, this call has 3", target=3)
    refused("steps: the store has None, this call has 4", method="gradcam", steps=4)
    refused(r"where: the store has \['layer2'\]", where="layer1")
    other = resnet()
    with torch.no_grad():
        other.conv1.weight[0, 0, 0, 0] += 1
    refused("the model's weights differ", model=other)
    refused("the data set differs", data=DataLoader(Images(n=16), batch_size=4))
    # an extraction's store is not an explanation's, either way round
    with pytest.raises(
        hs.FeatureStoreError, match="method: the store has 'gradcam', this call has None"
    ):
        hs.extract_dataset(model, loader, "layer2", out, progress=False)
    assert files(out) == before
    extracted = tmp_path / "extracted"
    hs.extract_dataset(model, loader, "layer2", extracted, progress=False)
    with pytest.raises(hs.FeatureStoreError, match="method: the store has None"):
        hs.explain_dataset(model, loader, "layer2", extracted, progress=False)
    # and the same call resumes (here: finds it finished) without a complaint
    store = hs.explain_dataset(model, loader, "layer2", out, method="gradcam", progress=False)
    assert len(store) == 12 and files(out) == before


def test_bad_arguments_are_refused_before_out_is_made(tmp_path: Path) -> None:
    model = resnet()
    loader = DataLoader(Images(n=4), batch_size=2)
    out = tmp_path / "never"
    with pytest.raises(hs.ExplainError, match="not an explain method"):
        hs.explain_dataset(model, loader, "layer2", out, method="gradcom", progress=False)
    with pytest.raises(hs.TargetError, match="one index per sample does not fit"):
        hs.explain_dataset(model, loader, "layer2", out, target=[1, 2], progress=False)
    with pytest.raises(hs.TargetError, match="the one text target is 'label'"):
        hs.explain_dataset(model, loader, "layer2", out, target="labels", progress=False)
    with pytest.raises(TypeError, match="'stepz'"):
        hs.explain_dataset(model, loader, "layer2", out, stepz=3, progress=False)
    with pytest.raises(hs.SelectionError):
        hs.explain_dataset(model, loader, "layer9", out, progress=False)
    assert not out.exists()
    with pytest.raises(hs.TargetError, match="second item of an"):  # a batch without labels
        hs.explain_dataset(
            model, DataLoader(torch.randn(4, 3, 16, 16)), "layer2", out, target="label"
        )
    assert_no_hooks(model)


# -- bounded memory, progress --------------------------------------------------------------------


def test_the_writer_holds_at_most_its_budget_and_a_progress_bar_counts_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[int] = []
    reserve = _writer.Writer.reserve

    def spy(self, nbytes):
        reserve(self, nbytes)
        seen.append(self.pending)

    bars: list[dict] = []

    class Bar:
        def __init__(self, **options) -> None:
            self.options, self.n = options, options.get("initial", 0)
            bars.append(self.__dict__)

        def update(self, k: int) -> None:
            self.n += k

        def close(self) -> None:
            self.options["closed"] = True

    monkeypatch.setattr(_writer.Writer, "reserve", spy)
    monkeypatch.setattr(_run, "progress_bar", lambda on, **options: Bar(**options) if on else None)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.Flatten(),
        nn.Linear(16 * 32 * 32, 3),
    )
    loader = DataLoader(torch.randn(64, 1, 32, 32), batch_size=8)  # 32 KiB of maps per batch
    hs.explain_dataset(
        model, loader, "0", tmp_path / "o", method="hirescam", shard_rows=8, buffer_bytes=64 << 10
    )
    assert len(seen) == 8 and max(seen) <= 64 << 10
    (bar,) = bars
    assert bar["n"] == 8 and bar["options"]["total"] == 8 and bar["options"]["closed"]
    assert bar["options"]["desc"] == "explain_dataset o"
