"""patching(): activation patching sweeps, exact and first-order (attribution patching)."""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._errors import NeverCalledWarning, name_list
from .._hooks import HookSet, eager_model, training_mode
from .._select import Where, select
from .._tree import describe, map_tensors, tensors
from ._heads import find_heads
from ._result import Patching
from ._values import Inputs, Key, attach, batch_size, inputs, run, stack

__all__ = ["patching"]

Metric = Callable[[Any], torch.Tensor]

# Tokens per batched forward when batch_size is not given: copies x N x T stays near this.
_TOKENS_PER_FORWARD = 4096
# A row whose every patched metric is this close to the corrupted one (relative to the
# clean - corrupted difference) did not move the metric.
_NO_EFFECT = 1e-5


def patching(
    model: nn.Module,
    clean: Any,
    corrupted: Any,
    where: Where,
    metric: Metric,
    positions: bool | Sequence[int] = True,
    heads: Any = False,
    method: str = "exact",
    *,
    forward_kwargs: Mapping[str, Any] | None = None,
    batch_size: int | None = None,
    progress: bool | None = None,
) -> Patching:
    """Activation patching: how much of ``metric`` each site's clean value restores.

    For each chosen module (and each position when ``positions``; each attention head when
    ``heads``), run ``corrupted`` with that one value replaced by its value on ``clean``
    and keep ``metric(output)``. A module's value is its output (the first tensor of a
    tuple: a block's hidden states), laid out ``[N, T, ...]``; a head's value is its slice
    of the input of the attention's output projection, split by the number of heads.

    Args:
        model: Any module; a Hugging Face model as loaded. It runs in eval mode (its own
            modes are put back), and is left as it was: no hook, no ``.grad`` touched.
        clean: The clean input: a tensor, a tuple of positional inputs, or a dict of keyword
            inputs (a tokenizer's output).
        corrupted: The corrupted input, of the same form and length.
        where: Which modules: any *where* (``"transformer.h.*"``). With ``heads``, the
            attention modules (``"transformer.h.*.attn"``).
        metric: ``output -> scalar tensor``, e.g. a logit difference at the last position.
        positions: ``True``: one entry per position (dimension 1 of the values); ``False``:
            the whole value at once; a list of positions: those only.
        heads: ``False``; ``True`` finds each module's output projection (the one submodule
            named ``c_proj``, ``o_proj``, ``out_proj``, ``dense`` or ``o``, else its last
            ``nn.Linear``) and the head count (the config's ``num_attention_heads``,
            ``n_head`` or ``num_heads``); or give the projection's name (``"o_proj"``), the
            count (``8``) or both (``("o_proj", 8)``).
        method: ``"exact"`` (one patched run per site, batched) or ``"attribution"``: the
            first-order estimate ``(A_clean - A_corrupted) . d metric / dA``, from one clean
            forward and one corrupted forward and backward; parameters get no ``.grad``.
        forward_kwargs: Keyword inputs passed to both runs (``attention_mask``, T5's
            ``decoder_input_ids``).
        batch_size: Patched runs per forward (copies of ``corrupted`` stacked along the
            batch dimension, one site per copy); default: about 4,096 tokens per forward.
            Models whose batch is not the first dimension run one by one, found by
            themselves.
        progress: Show a progress bar (tqdm, if installed); default: on a terminal, for
            sweeps of more than one forward.

    Returns:
        A :class:`Patching`: a tensor ``[modules, (positions), (heads)]`` with ``.sites``
        naming its rows and ``.clean`` / ``.corrupted`` the unpatched metrics.

    Raises:
        SelectionError: If ``where`` matches nothing.
        ValueError: If clean and corrupted values differ in shape, a position is out of
            range, or the heads cannot be found (the message lists ``heads=`` options).
        TypeError: If ``metric`` does not return a scalar tensor, or (attribution) one that
            does not depend on the model's output.

    Warns:
        NeverCalledWarning: A chosen module (or its projection) that the forward never
            reached (its row is NaN); a row whose patches never moved the metric though its
            clean and corrupted values differ, or (attribution) which no gradient of the
            metric reached: the metric does not depend on it.
    """
    if method not in ("exact", "attribution"):
        raise ValueError(f"patching: method must be 'exact' or 'attribution', got {method!r}")
    if not callable(metric):
        raise TypeError(f"patching: metric must be callable (output -> scalar), got {metric!r}")
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"patching: batch_size must be a positive int, got {batch_size!r}")
    model = eager_model(model, "patching")
    targets = _targets(model, where, heads)
    x_clean = inputs(clean, forward_kwargs, "clean")
    x_corrupted = inputs(corrupted, forward_kwargs, "corrupted")
    with training_mode(model, False):
        if method == "exact":
            sweep = _Exact(model, targets, metric, positions, batch_size, progress)
            return sweep.run(x_clean, x_corrupted)
        return _attribution(model, targets, metric, positions, x_clean, x_corrupted)


# -- what is patched -------------------------------------------------------------------------
@dataclass(frozen=True)
class _Target:
    name: str  # the chosen module
    hooked: str  # whose value is patched: the module, or its attention output projection
    heads: int | None  # number of heads (the projection's input is split by it)


def _targets(model: nn.Module, where: Where, heads: Any) -> list[_Target]:
    chosen = select(model, where)
    if heads is False or heads is None:
        return [_Target(name, name, None) for name in chosen]
    found = []
    for name, module in chosen.items():
        proj, count = find_heads(model, name, module, heads)
        found.append(_Target(name, proj, count))
    return found


def _hooked(targets: list[_Target]) -> dict[str, bool]:
    """The hooked modules, each with whether its input (not its output) is the value."""
    return {t.hooked: t.heads is not None for t in targets}


def _record(
    model: nn.Module, targets: list[_Target], x: Inputs, metric: Metric
) -> tuple[dict[Key, torch.Tensor], torch.Tensor, Any]:
    """One unpatched run: every target's value (copied when the hook runs), the metric,
    and the output."""
    values: dict[Key, torch.Tensor] = {}

    def keep(key: Key, value: torch.Tensor) -> None:
        values[key] = value.detach().clone()

    with HookSet("patching") as hooks, torch.no_grad():
        attach(hooks, model, _hooked(targets), keep)
        output = run(model, x)
        score = _scalar(metric(output), requires_grad=False)
    return values, score, output


def _scalar(value: Any, *, requires_grad: bool) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise TypeError(
            f"patching: metric must return a scalar tensor (e.g. a logit difference), got "
            f"{describe(value)}"
        )
    if requires_grad and not value.requires_grad:
        raise TypeError(
            "patching(method='attribution'): the metric does not depend on the model's output "
            "(its result has no gradient): compute it from the output with torch operations, "
            "without .item(), .detach() or torch.no_grad()"
        )
    return value.reshape(())


# -- rows, positions and sites ---------------------------------------------------------------
@dataclass
class _Rows:
    """The rows of the result: one per call of each target (or one, NaN, if never called)."""

    keys: list[Key | None]  # None: the target never ran
    labels: list[str]
    heads: list[int | None]
    positions: tuple[int, ...] | None
    n_heads: int | None


def _rows(
    targets: list[_Target],
    clean: dict[Key, torch.Tensor],
    corrupted: dict[Key, torch.Tensor],
    positions: bool | Sequence[int],
) -> _Rows:
    keys: list[Key | None] = []
    labels, heads = [], []
    never = []
    for target in targets:
        calls = sorted(call for hooked, call in clean if hooked == target.hooked)
        if not calls:
            never.append(target.name if target.hooked == target.name else target.hooked)
            calls_or_none: list[int | None] = [None]
        else:
            calls_or_none = list(calls)
        for call in calls_or_none:
            key = None if call is None else (target.hooked, call)
            keys.append(key)
            labels.append(
                target.name if len(calls_or_none) == 1 else f"{target.name} (call {call})"
            )
            heads.append(target.heads)
    if never:
        warnings.warn(
            f"patching: {name_list(never)} never ran in the clean forward pass; their rows are "
            "NaN. Choose modules the model runs on this input.",
            NeverCalledWarning,
            stacklevel=4,
        )
    for key in keys:
        if key is None:
            continue
        a, b = clean[key], corrupted.get(key)
        if b is None or a.shape != b.shape:
            got = "never ran" if b is None else f"is {describe(b)}"
            raise ValueError(
                f"patching: {_label(key)} is {describe(a)} on the clean input but {got} on "
                "the corrupted one; patching needs clean and corrupted inputs of the same "
                "shape (pad them to one length)"
            )
    counts = {h for h in heads if h}
    return _Rows(keys, labels, heads, _positions(keys, clean, positions), max(counts, default=None))


def _label(key: Key) -> str:
    return repr(key[0]) if key[1] == 0 else f"{key[0]!r} (call {key[1]})"


def _positions(
    keys: list[Key | None], clean: dict[Key, torch.Tensor], positions: bool | Sequence[int]
) -> tuple[int, ...] | None:
    if positions is False or positions is None:
        return None
    lengths = {}
    for key in keys:
        if key is not None:
            value = clean[key]
            if value.dim() < 2:
                raise ValueError(
                    f"patching: {_label(key)} is {describe(value)}, with no position dimension "
                    "(values are read as [N, T, ...]); pass positions=False"
                )
            lengths[key] = value.shape[1]
    if not lengths:
        return None
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"{_label(k)}: {t}" for k, t in list(lengths.items())[:6])
        raise ValueError(
            f"patching(positions=...): the chosen modules have different lengths ({shown}); "
            "sweep each length in its own call (T5: the encoder's blocks, then the decoder's)"
        )
    length = next(iter(lengths.values()))
    if positions is True:
        return tuple(range(length))
    if isinstance(positions, torch.Tensor):
        positions = positions.tolist()
    chosen = []
    for p in positions:
        if not isinstance(p, int) or isinstance(p, bool) or not -length <= p < length:
            raise ValueError(
                f"patching: position {p!r} is out of range: the values have {length} positions "
                f"(0 to {length - 1}, or negative from the end)"
            )
        chosen.append(p % length)
    return tuple(chosen)


@dataclass(frozen=True)
class _Site:
    row: int
    position: int | None
    head: int | None


def _sites(rows: _Rows) -> list[_Site]:
    found = []
    for row, key in enumerate(rows.keys):
        if key is None:
            continue
        for position in rows.positions if rows.positions is not None else (None,):
            heads = range(rows.heads[row]) if rows.heads[row] else (None,)
            found.extend(_Site(row, position, head) for head in heads)
    return found


def _result(rows: _Rows, entries: dict[_Site, float | torch.Tensor], **meta: Any) -> Patching:
    shape = [len(rows.keys)]
    dims = ["module"]
    if rows.positions is not None:
        shape.append(len(rows.positions))
        dims.append("position")
    if rows.n_heads:
        shape.append(rows.n_heads)
        dims.append("head")
    data = torch.full(shape, math.nan, dtype=torch.float32)
    index = {p: i for i, p in enumerate(rows.positions or ())}
    for site, value in entries.items():
        at: list[int] = [site.row]
        if site.position is not None:
            at.append(index[site.position])
        if site.head is not None:
            at.append(site.head)
        data[tuple(at)] = float(value)
    return Patching(
        data, sites=tuple(rows.labels), dims=tuple(dims), positions=rows.positions, **meta
    )


# -- exact patching --------------------------------------------------------------------------
class _NotBatchable(Exception):
    """The batch is not the first dimension of this model's values or outputs."""


class _Exact:
    def __init__(
        self,
        model: nn.Module,
        targets: list[_Target],
        metric: Metric,
        positions: bool | Sequence[int],
        batch: int | None,
        progress: bool | None,
    ) -> None:
        self.model, self.targets, self.metric = model, targets, metric
        self.positions, self.batch, self.progress = positions, batch, progress
        self.plan: dict[Key, tuple[tuple, torch.Tensor]] = {}
        self.copies = 1

    def run(self, x_clean: Inputs, x_corrupted: Inputs) -> Patching:
        clean, clean_score, _ = _record(self.model, self.targets, x_clean, self.metric)
        corrupted, corrupted_score, output = _record(
            self.model, self.targets, x_corrupted, self.metric
        )
        rows = _rows(self.targets, clean, corrupted, self.positions)
        sites = _sites(rows)
        self.clean, self.rows = clean, rows
        self.corrupted_score, self.corrupted_output = corrupted_score, output
        n = batch_size(x_corrupted)
        per = self._per_forward(n, clean, len(sites))
        try:
            entries = self._sweep(x_corrupted, sites, per, n)
        except _NotBatchable:
            entries = self._sweep(x_corrupted, sites, 1, n)
        result = _result(
            rows, entries, clean=clean_score, corrupted=corrupted_score, method="exact"
        )
        _check_effects(result, rows, clean, corrupted, clean_score, corrupted_score)
        return result

    def _per_forward(self, n: int | None, clean: dict[Key, torch.Tensor], count: int) -> int:
        if n is None or any(v.dim() == 0 or v.shape[0] != n for v in clean.values()):
            return 1  # the batch is not the first dimension of everything: one by one
        if self.batch is not None:
            return self.batch
        length = max((v.shape[1] for v in clean.values() if v.dim() > 1), default=1)
        return max(1, min(count, _TOKENS_PER_FORWARD // max(1, n * length)))

    def _sweep(
        self, x: Inputs, sites: list[_Site], per: int, n: int | None
    ) -> dict[_Site, torch.Tensor]:
        entries: dict[_Site, torch.Tensor] = {}
        chunks = [sites[i : i + per] for i in range(0, len(sites), per)]
        with (
            HookSet("patching") as hooks,
            torch.no_grad(),
            _bar(self.progress, len(sites), len(chunks)) as bar,
        ):
            attach(hooks, self.model, _hooked(self.targets), self._patch)
            for i, chunk in enumerate(chunks):
                verify = per > 1 and i == 0  # one unpatched copy: is the batch really dim 0?
                scores = self._forward(x, chunk, n, verify)
                entries.update(zip(chunk, scores, strict=True))
                bar(len(chunk))
        return entries

    def _forward(
        self, x: Inputs, chunk: list[_Site], n: int | None, verify: bool
    ) -> list[torch.Tensor]:
        copies = len(chunk) + verify
        self._plan(chunk, n or 1, copies)
        try:
            output = run(self.model, stack(x, copies) if copies > 1 else x)
        finally:
            self.plan = {}
        if copies == 1:
            return [_scalar(self.metric(output), requires_grad=False)]
        assert n is not None
        scores = [
            _scalar(
                self.metric(_slice(output, self.corrupted_output, j, n, copies)),
                requires_grad=False,
            )
            for j in range(copies)
        ]
        if verify and not _close(scores[-1], self.corrupted_score, self.corrupted_score):
            raise _NotBatchable
        return scores[: len(chunk)]

    def _plan(self, chunk: list[_Site], n: int, copies: int) -> None:
        """For each patched value: the index of what to replace in the stacked run, and the
        clean values that replace it."""
        self.copies = copies
        grouped: dict[Key, list[tuple[int, _Site]]] = defaultdict(list)
        for j, site in enumerate(chunk):
            key = self.rows.keys[site.row]
            assert key is not None
            grouped[key].append((j, site))
        for key, items in grouped.items():
            clean = self.clean[key]
            site = items[0][1]
            heads = self.rows.heads[site.row]
            if len(items) == 1:  # one site: slices and ints, no index tensors to build
                j = items[0][0]
                rows: Any = slice(j * n, (j + 1) * n)
                pos: Any = site.position
                head: Any = site.head
                samples: Any = slice(None)
            else:
                device = clean.device
                copy = torch.tensor([j for j, _ in items], device=device)
                samples = torch.arange(n, device=device)
                rows = (copy[:, None] * n + samples).flatten()
                samples = samples.repeat(len(items))
                pos = head = None
                if site.position is not None:
                    pos = torch.tensor([s.position for _, s in items], device=device)
                    pos = pos.repeat_interleave(n)
                if site.head is not None:
                    head = torch.tensor([s.head for _, s in items], device=device)
                    head = head.repeat_interleave(n)
            source = _index(clean, heads, samples, pos, head)
            self.plan[key] = ((heads, rows, pos, head), source)

    def _patch(self, key: Key, value: torch.Tensor) -> torch.Tensor | None:
        planned = self.plan.get(key)
        if planned is None:
            return None
        (heads, rows, pos, head), source = planned
        expected = self.clean[key].shape
        if value.shape[1:] != expected[1:] or value.shape[0] != expected[0] * self.copies:
            if self.copies > 1:
                raise _NotBatchable
            raise ValueError(
                f"patching: {_label(key)} is {describe(value)} in the patched run but was "
                f"{describe(self.clean[key])} in the clean one"
            )
        new = value.clone()
        view = new.unflatten(-1, (heads, -1)) if heads else new
        view[_where(rows, pos, head)] = source.to(new.dtype)
        return new


def _where(
    rows: torch.Tensor | slice, pos: torch.Tensor | int | None, head: torch.Tensor | int | None
) -> tuple:
    """The index of the patched entries: tensors (several sites) or a slice and ints (one)."""
    index: tuple = (rows,)
    if pos is not None:
        index += (pos,)
    if head is not None:
        index += (Ellipsis, head, slice(None))
    return index


def _index(
    value: torch.Tensor,
    heads: int | None,
    samples: torch.Tensor | slice,
    pos: torch.Tensor | int | None,
    head: torch.Tensor | int | None,
) -> torch.Tensor:
    view = value.unflatten(-1, (heads, -1)) if heads else value
    return view[_where(samples, pos, head)]


def _slice(output: Any, corrupted: Any, j: int, n: int, copies: int) -> Any:
    """The j-th copy's share of a stacked run's output."""
    got, want = tensors(output), tensors(corrupted)
    if len(got) != len(want):
        raise _NotBatchable
    for a, b in zip(got, want, strict=True):
        if b.dim() == 0 or b.shape[0] != n or a.shape != (n * copies, *b.shape[1:]):
            raise _NotBatchable
    return map_tensors(lambda t: t[j * n : (j + 1) * n], output)


def _close(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> bool:
    tol = 1e-4 * (float(abs(scale)) + 1e-3)
    return abs(float(a) - float(b)) <= tol


class _bar:
    """A tqdm progress bar (if installed) as a context manager; calling it advances it."""

    def __init__(self, progress: bool | None, total: int, forwards: int) -> None:
        self.bar = None
        if progress is False or (progress is None and forwards < 2):
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return
        self.bar = tqdm(
            total=total, desc="patching", unit="site", disable=None if progress is None else False
        )

    def __enter__(self) -> Callable[[int], None]:
        return self.bar.update if self.bar is not None else lambda _: None

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()


def _check_effects(
    result: Patching,
    rows: _Rows,
    clean: dict[Key, torch.Tensor],
    corrupted: dict[Key, torch.Tensor],
    clean_score: torch.Tensor,
    corrupted_score: torch.Tensor,
) -> None:
    """Warn about rows whose patches never moved the metric though their values differ."""
    gap = float(abs(clean_score - corrupted_score))
    if gap == 0:
        warnings.warn(
            f"patching: the clean and corrupted inputs give the same metric ({float(clean_score):.6g}"
            "): there is no difference for patching to restore. Check the inputs and the metric.",
            NeverCalledWarning,
            stacklevel=4,
        )
        return
    flat = result.as_tensor().reshape(len(rows.keys), -1)
    still = []
    for row, key in enumerate(rows.keys):
        if key is None or torch.equal(clean[key], corrupted[key]):
            continue
        moved = (flat[row] - float(corrupted_score)).abs().max()
        if float(moved) <= _NO_EFFECT * gap:
            still.append(rows.labels[row])
    if still:
        warnings.warn(
            f"patching: patching {name_list(still)} never moved the metric, though their clean "
            "and corrupted values differ: the metric does not depend on them (does it read "
            "the output these modules feed?)",
            NeverCalledWarning,
            stacklevel=4,
        )


# -- attribution patching --------------------------------------------------------------------
def _attribution(
    model: nn.Module,
    targets: list[_Target],
    metric: Metric,
    positions: bool | Sequence[int],
    x_clean: Inputs,
    x_corrupted: Inputs,
) -> Patching:
    clean, clean_score, _ = _record(model, targets, x_clean, metric)
    leaves: dict[Key, torch.Tensor] = {}

    def keep(key: Key, value: torch.Tensor) -> torch.Tensor:
        leaf = value if value.requires_grad else value.detach().requires_grad_()
        leaves[key] = leaf
        return leaf.clone()  # the model goes on with a copy: an in-place op cannot reach it

    with HookSet("patching") as hooks, torch.enable_grad():
        attach(hooks, model, _hooked(targets), keep)
        output = run(model, x_corrupted)
    score = _scalar(metric(output), requires_grad=True)
    corrupted = {key: leaf.detach() for key, leaf in leaves.items()}
    rows = _rows(targets, clean, corrupted, positions)
    used = [key for key in rows.keys if key is not None]
    grads = dict(
        zip(
            used,
            torch.autograd.grad(score, [leaves[k] for k in used], allow_unused=True),
            strict=True,
        )
    )
    entries: dict[_Site, torch.Tensor] = {}
    missed = []
    sites_by_row: dict[int, list[_Site]] = defaultdict(list)
    for site in _sites(rows):
        sites_by_row[site.row].append(site)
    for row, key in enumerate(rows.keys):
        if key is None:
            continue
        grad = grads[key]
        if grad is None or not bool(grad.any()):  # the metric does not depend on it
            missed.append(rows.labels[row])
            grad = torch.zeros_like(clean[key])
        per = _per_site(clean[key] - corrupted[key], grad, rows.heads[row], rows.positions)
        index = {p: i for i, p in enumerate(rows.positions or ())}
        for site in sites_by_row[row]:
            at = (index[site.position],) if site.position is not None else ()
            at += (site.head,) if site.head is not None else ()
            entries[site] = per[at]
    if missed:
        warnings.warn(
            f"patching(method='attribution'): no gradient of the metric reached "
            f"{name_list(missed)} (none, or zeros everywhere; their rows are 0): the metric "
            "does not depend on them",
            NeverCalledWarning,
            stacklevel=3,
        )
    return _result(rows, entries, clean=clean_score, corrupted=score.detach(), method="attribution")


def _per_site(
    diff: torch.Tensor,
    grad: torch.Tensor,
    heads: int | None,
    positions: tuple[int, ...] | None,
) -> torch.Tensor:
    """``diff . grad`` summed over everything but the position (dim 1) and the head:
    ``[P, H]``, ``[P]``, ``[H]`` or a scalar."""
    product = (diff.float() * grad.float()).detach()
    if heads:
        product = product.unflatten(-1, (heads, -1)).sum(-1)  # [N, T, ..., H]
    keep = ([1] if positions is not None else []) + ([product.dim() - 1] if heads else [])
    summed = product.sum(dim=[d for d in range(product.dim()) if d not in keep])
    return summed[list(positions)] if positions is not None else summed
