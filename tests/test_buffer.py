"""StepBuffer: a step's device values combined by their rule, moved to the host in one transfer.

The oracle is plain torch: the same tensors stacked and reduced with ``sum``, ``amin`` and
``amax``.
"""

from __future__ import annotations

import pytest
import torch

from hookscope._monitor._step._buffer import StepBuffer

RULES = {"sum": lambda s: s.sum(0), "min": lambda s: s.amin(0), "max": lambda s: s.amax(0)}


def count_transfers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every ``Tensor.tolist()`` call from now on (the one way a value reaches the host)."""
    calls: list[int] = []
    tolist = torch.Tensor.tolist

    def counted(self: torch.Tensor) -> object:
        calls.append(self.numel())
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    return calls


def test_one_transfer_combines_every_rule_as_plain_torch_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gen = torch.Generator().manual_seed(0)
    shapes = {"scalar": (), "vector": (5,), "matrix": (2, 3)}
    added: dict[tuple[str, str], list[torch.Tensor]] = {}
    buf = StepBuffer()
    for _ in range(3):  # three calls of each module, say
        for rule in RULES:
            for kind, shape in shapes.items():
                value = torch.randn(shape, generator=gen, dtype=torch.float32)
                added.setdefault((rule, kind), []).append(value)
                buf.add((rule, kind), value, rule)
    buf.add("flag", torch.tensor(True), "max")  # a non-finite flag: bool, combined as max
    buf.add("flag", torch.tensor(False), "max")
    assert buf.pending() == len(RULES) * len(shapes) + 1
    calls = count_transfers(monkeypatch)
    host = buf.to_host()
    assert len(calls) == 1  # one device-to-host transfer for every key
    for (rule, kind), values in added.items():
        want = RULES[rule](torch.stack(values)).reshape(-1).double().tolist()
        assert host[(rule, kind)] == pytest.approx(want, rel=1e-6), (rule, kind)
    assert host["flag"] == [1.0]
    assert buf.pending() == 0


def test_a_key_added_after_a_transfer_is_combined_on_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first, second = torch.tensor([1.0, -2.0, 3.0]), torch.tensor([-4.0, 5.0, 0.5])
    buf = StepBuffer()
    for rule in RULES:
        buf.add(rule, first, rule)
    early = dict(buf.to_host())
    calls = count_transfers(monkeypatch)
    for rule in RULES:
        buf.add(rule, second, rule)
    host = buf.to_host()
    assert len(calls) == 1  # only what is new travels
    for rule, reduce in RULES.items():
        assert early[rule] == first.double().tolist()
        assert host[rule] == reduce(torch.stack([first, second])).double().tolist()


def test_only_moves_the_keys_it_accepts_and_set_replaces() -> None:
    buf = StepBuffer()
    buf.add(("act", "a"), torch.tensor(2.0))
    buf.add(("grad", "a"), torch.tensor(3.0))
    host = buf.to_host(only=lambda key: key[0] == "act")
    assert host == {("act", "a"): [2.0]} and buf.pending_keys() == [("grad", "a")]
    buf.set(("act", "a"), torch.tensor(7.0))  # replaces the moved value, not combined
    assert buf.to_host() == {("act", "a"): [7.0], ("grad", "a"): [3.0]}


def test_values_leave_the_graph_and_mixed_dtypes_arrive_as_floats() -> None:
    w = torch.tensor([0.5, 1.5], requires_grad=True)
    buf = StepBuffer()
    buf.add("norm", (w * 2).norm())
    buf.add("count", torch.tensor(3, dtype=torch.int64))
    buf.add("half", torch.tensor([0.25, 4.0], dtype=torch.bfloat16), "max")
    assert not buf.value("norm").requires_grad
    host = buf.to_host()
    assert host["norm"] == pytest.approx([(w.detach() * 2).norm().item()])
    assert host["count"] == [3.0] and host["half"] == [0.25, 4.0]


@pytest.mark.parametrize("rule", list(RULES))
def test_rows_travel_as_one_tensor_and_combine_as_keys_added_one_by_one(
    rule, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stacked pass's rows (one per module) under their keys: the same host values as
    adding each row alone, whether a key comes again before the transfer (a second pass),
    after it, or is asked for alone."""
    gen = torch.Generator().manual_seed(0)
    names = [("act", n) for n in "abcd"]
    first, second, third = (torch.randn(4, 3, generator=gen) for _ in range(3))
    alone = StepBuffer()
    for rows in (first, second):
        for key, row in zip(names, rows, strict=True):
            alone.add(key, row, rule)
    buf = StepBuffer()
    buf.add_rows(names, first, rule)
    assert buf.pending() == 4 and names[2] in buf
    buf = StepBuffer()
    buf.add_rows(names, first, rule)
    buf.add_rows(names[1:3], second[1:3], rule)  # two keys waiting already: combined
    buf.add_rows([names[0], names[3]], second[[0, 3]], rule)
    calls = count_transfers(monkeypatch)
    host = buf.to_host()
    assert len(calls) == 1
    assert host == alone.to_host()
    reduce = RULES[rule]
    buf.add_rows(names, third, rule)  # after a transfer: combined on the host
    later = buf.to_host()
    for i, key in enumerate(names):
        want = reduce(torch.stack([first[i], second[i], third[i]])).double().tolist()
        assert later[key] == pytest.approx(want, rel=1e-6), key
    buf.add_rows(names, first, rule)
    assert torch.equal(buf.value(names[1]), first[1])  # asked alone: split into keys
    assert buf.pending_keys() == names


def test_set_rows_replaces_what_waits_and_what_moved() -> None:
    buf = StepBuffer()
    keys = [("bn", "a"), ("bn", "b")]
    buf.add(keys[0], torch.tensor([9.0, 9.0]))
    buf.set_rows(keys, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert buf.to_host() == {keys[0]: [1.0, 2.0], keys[1]: [3.0, 4.0]}
    buf.set_rows(keys, torch.tensor([[5.0, 6.0], [7.0, 8.0]]))
    assert buf.to_host() == {keys[0]: [5.0, 6.0], keys[1]: [7.0, 8.0]}
    with pytest.raises(ValueError, match="3 keys for 2 rows"):
        buf.add_rows([*keys, ("bn", "c")], torch.zeros(2, 2))
