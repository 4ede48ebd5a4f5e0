"""Sampled statistics: the sample spreads over the whole tensor, and estimates stay close."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from hookscope._stats import (
    MOMENTS,
    SAT_MARGIN,
    Rows,
    Sampler,
    dead_fraction,
    finite_flag,
    moments,
    row_extremes,
    row_moments,
    squared_norms,
)


def test_sample_none_reads_every_element() -> None:
    t = torch.randn(3, 5, 7)
    assert torch.equal(Sampler(None)(t), t.reshape(-1))
    assert torch.equal(Sampler(1000)(t), t.reshape(-1))  # smaller than the sample


@pytest.mark.parametrize("shape", [(16, 32, 64, 64), (8, 128, 256), (64, 2048), (4, 3, 1024)])
def test_sample_is_bounded_and_walks_over_every_row_column_and_channel(shape) -> None:
    t = torch.arange(torch.Size(shape).numel()).reshape(shape)
    picked = Sampler(4096)(t)
    assert picked.numel() <= 4096
    index = torch.stack(torch.unravel_index(picked, shape), 1)
    for dim, size in enumerate(shape):
        if size <= 64:  # small dims: every value is visited
            assert index[:, dim].unique().numel() == size, dim
        else:
            assert index[:, dim].unique().numel() >= min(size, picked.numel()) // 4, dim


def test_sample_reads_through_strides_without_reordering() -> None:
    base = torch.randn(32, 64, 128)
    view = base.transpose(1, 2)[:, ::2]  # non-contiguous
    sampler = Sampler(500)
    positions = sampler(torch.arange(view.numel()).reshape(view.shape))
    assert torch.equal(sampler(view), view.reshape(-1)[positions])


def test_moments_equal_plain_torch() -> None:
    x = torch.randn(1000).clamp(-0.5, 2).relu()
    s = dict(zip(MOMENTS, moments(x, (0.0, 1.0)).tolist(), strict=True))
    assert s["sum"] == pytest.approx(x.sum().item(), rel=1e-5)
    assert s["sumsq"] == pytest.approx(x.square().sum().item(), rel=1e-5)
    assert s["zeros"] == (x == 0).sum().item()
    assert s["sat"] == ((x <= 1e-3) | (x >= 1 - 1e-3)).sum().item()
    assert s["n"] == 1000 and s["nan"] == 0 and s["inf"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_row_statistics_of_padded_samples_equal_each_sample_alone(dtype) -> None:
    xs = [torch.randn(n, dtype=dtype).clamp(-0.5, 2).relu() for n in (300, 1000, 7, 1000)]
    xs[1][[3, 50]] = torch.tensor([float("nan"), float("inf")], dtype=dtype)
    xs[2][:] = torch.linspace(0.5, 0.9, 7, dtype=dtype)  # positive: padding is not its min
    bounds = [(0.0, 1.0), None, (0.0, 1.0), None]
    x, mask, n = Rows().pad(xs)
    assert x.shape == (4, 1000) and mask.sum(1).tolist() == [300, 1000, 7, 1000]
    nan = torch.tensor(float("nan"), dtype=dtype)
    lo = torch.stack([nan if b is None else torch.tensor(b[0] + SAT_MARGIN) for b in bounds])
    hi = torch.stack([nan if b is None else torch.tensor(b[1] - SAT_MARGIN) for b in bounds])
    rows = row_moments(x, mask, n, (lo.to(dtype)[:, None], hi.to(dtype)[:, None]))
    extremes = row_extremes(x, mask)
    for i, (sample, b) in enumerate(zip(xs, bounds, strict=True)):
        torch.testing.assert_close(rows[i], moments(sample, b), equal_nan=True)
        expected = torch.stack(torch.aminmax(sample)).float()
        torch.testing.assert_close(extremes[i], expected, equal_nan=True)


def test_padded_rows_equal_pad_sequence_and_reuse_their_index() -> None:
    rows = Rows()
    for value in (0.0, -1.0):
        xs = [torch.randn(n) for n in (5, 1, 9, 3)]
        want = torch.nn.utils.rnn.pad_sequence(xs, batch_first=True, padding_value=value)
        assert torch.equal(rows.padded(xs, value), want)
    assert len([k for k in rows._cache if k[0] == "padded"]) == 1  # one index per layout


def test_dead_unit_estimate_from_positions_matches_the_exact_fraction() -> None:
    x = torch.randn(64, 256, 16, 16)
    x[:, :64] = -x[:, :64].abs()  # a quarter of the channels always off
    sampler = Sampler(4096)
    units = sampler.units(x)
    assert units.shape[1] == 256 and units.shape[0] >= 64
    assert dead_fraction(units, 0.7).item() == pytest.approx(0.25, abs=0.01)


def watched(model, x, **kw):
    with hs.Monitor(model, every=1, **kw) as mon:
        model(x).sum().backward()
        mon.step()
    return mon.records[1]


def test_exact_statistics_with_sample_none_equal_plain_torch() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 30 * 30, 10))
    x = torch.randn(4, 3, 32, 32)
    record = watched(model, x, sample=None)
    out = model[1](model[0](x)).detach()
    act = record["act"]["1"]
    assert act["mean"] == pytest.approx(out.mean().item(), rel=1e-5)
    assert act["std"] == pytest.approx(out.std(unbiased=False).item(), rel=1e-4)
    assert (act["min"], act["max"]) == (out.min().item(), out.max().item())
    assert act["zero_frac"] == pytest.approx((out == 0).float().mean().item())
    assert act["numel"] == act["sampled"] == out.numel()
    grad = torch.autograd.grad(model(x).sum(), model[3].weight)[0]
    assert record["param"]["3.weight"]["grad_norm"] == pytest.approx(grad.norm().item(), rel=1e-5)


def test_sampled_mean_and_std_are_close_to_exact_on_large_activations() -> None:
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 8))
    x = torch.randn(512, 256) * 3 + 1
    exact = watched(model, x, sample=None)
    sampled = watched(model, x)
    for name in ("0", "1"):
        e, s = exact["act"][name], sampled["act"][name]
        assert s["sampled"] <= 4096 < s["numel"] == e["numel"]
        assert s["mean"] == pytest.approx(e["mean"], abs=0.05 * e["std"])
        assert s["std"] == pytest.approx(e["std"], rel=0.05)
        g_e, g_s = exact["grad"][name], sampled["grad"][name]
        assert g_s["norm"] == pytest.approx(g_e["norm"], rel=0.05)


def test_a_single_nan_anywhere_in_a_large_tensor_is_still_found() -> None:
    class Poison(nn.Module):
        def forward(self, x):
            x = x.clone()
            x[37, 901] = float("nan")  # one element in 512 x 1024
            return x

    model = nn.Sequential(nn.Linear(16, 1024), Poison(), nn.Linear(1024, 2))
    with hs.Monitor(model, every=None, sample=64) as mon:
        model(torch.randn(512, 16))
        mon.step()
    assert [(f.kind, f.module, f.phase) for f in mon.findings] == [("nonfinite", "1", "forward")]


@pytest.mark.parametrize("rows", [64, 256], ids=["small", "large"])  # around SMALL_FLAG
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_finite_flag_is_0_or_nan_and_never_overflows(dtype: torch.dtype, rows: int) -> None:
    largest = torch.finfo(dtype).max
    x = torch.full((rows, 513), largest, dtype=dtype)
    x[::2] = -largest  # every value finite, the range from min to max twice the largest
    assert finite_flag(x).item() == 0 and finite_flag(x).dtype == torch.float32
    for bad in (math.nan, math.inf, -math.inf):
        y = x.clone()
        y[rows - 1, 512] = bad  # the last element
        assert math.isnan(finite_flag(y).item())
    assert finite_flag(torch.ones(0, dtype=dtype)).item() == 0


def test_the_finite_flag_of_other_tensors() -> None:
    assert finite_flag(torch.arange(10)).item() == 0  # integers are finite
    z = torch.ones(4, dtype=torch.complex64)
    assert finite_flag(z).item() == 0
    z[2] = complex(0, math.inf)
    assert math.isnan(finite_flag(z).item())
    assert math.isnan(finite_flag(torch.tensor(math.nan)).item())  # a 0-d tensor


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_squared_norms_are_each_tensors_squared_l2_norm_in_one_vector(dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=gen).to(dtype) for shape in [(64, 32), (7,), (3, 3, 5)]]
    tensors[1] *= 300  # bfloat16 squares past its precision: accumulated in float32
    got = squared_norms(tensors)
    want = [t.double().square().sum().item() for t in tensors]
    assert got.dtype == torch.float32 and got.tolist() == pytest.approx(want, rel=1e-5)
    other = torch.float32 if dtype == torch.float64 else torch.float64
    assert squared_norms([tensors[0], tensors[0].to(other)]) is None  # two dtypes: norms()
    assert squared_norms([]) is None
