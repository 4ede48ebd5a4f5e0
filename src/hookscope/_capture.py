"""capture(): keep what flows in and out of chosen modules, and the gradients of both."""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ._compat import is_compiling
from ._errors import (
    HookscopeError,
    MissingRecordError,
    NeverCalledWarning,
    NoGradWarning,
    name_list,
    never_ran_message,
)
from ._hooks import (
    POINTS,
    CallClock,
    HookSet,
    alias_grad_inputs,
    alias_grad_outputs,
    break_graph_for,
    close_tap,
    eager_model,
    forward_failed,
    in_backward_recompute,
    is_replaying,
    no_grad_in_model_message,
    open_tap,
    refill,
    tap,
    taps_compile,
)
from ._record import Keeper, Record, version
from ._select import Where, select
from ._tree import tensors

__all__ = ["Capture", "capture"]


def capture(
    model: nn.Module,
    where: Where,
    what: str | Sequence[str] = ("output",),
    keep: str = "last",
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    clone: bool = True,
) -> Capture:
    """Keep the inputs, outputs and gradients of the chosen modules while the block runs.

    Args:
        model: The model to watch. It is left as it was: every hook is removed on exit, also
            when the body raised.
        where: Which modules: a name, glob, regex, module type, predicate, or a list.
        what: Any of ``"input"`` (positional args, and ``.kwargs``), ``"output"``,
            ``"grad_input"``, ``"grad_output"``.
        keep: ``"last"`` keeps the records of the last forward pass (one per call of the module
            in that pass); ``"all"`` keeps every call of every pass.
        device: Move what is kept to this device (``"cpu"`` saves accelerator memory).
        dtype: Cast floating-point values that are kept to this dtype.
        clone: Copy what is kept (the default), so a later in-place change made by the model
            cannot alter it. With ``clone=False`` a changed value raises on read instead.

    Gradients are read with tensor hooks set during the forward pass (never
    ``register_full_backward_hook``), so they work with in-place ops after the module and on
    dict or dataclass outputs. Capturing outputs, inputs and ``grad_output`` changes no bit of
    the model's outputs or gradients. ``grad_input`` gives each positional input a copy of its
    own, laid out in memory like the input (strides and offset: the module runs the same
    kernels, so outputs keep every bit), so that its hook sees only the gradient flowing
    through this module; where an input also feeds other modules, autograd then adds the
    same gradient terms in another order, and parameter gradients may differ in the last
    bits (about 1e-7 relative, as with PyTorch's own full backward hooks).

    Inside a ``torch.compile`` graph (attached before or after compiling, ``fullgraph=True``
    included; torch 2.7+) ``"output"``, ``"input"`` and ``"grad_output"`` are read with no
    graph break and no recompile: the values pass through a tap (a custom op, a copy) that
    hands them to the capture as the graph runs, and whose backward hands over their
    gradients. ``"grad_input"`` still needs a tensor hook: Dynamo breaks the graph at that
    module, and ``fullgraph=True`` refuses it, saying so.

    Modules the model itself runs without autograd get their gradients when the model runs
    them again during backward: reentrant activation checkpointing, and reversible layers
    (Reformer: each layer's attention and feed_forward, not the layer around them). A
    :class:`NoGradWarning` names those left without one, and why.

    Returns:
        A :class:`Capture`: ``cap[name]`` is the module's last :class:`Record`.

    Raises:
        SelectionError: If ``where`` matches nothing.

    Example:
        >>> import torch, hookscope as hs, torch.nn as nn
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
        >>> with hs.capture(model, "0", what=("output", "grad_output")) as cap:
        ...     model(torch.randn(3, 4)).sum().backward()
        >>> cap["0"]
        Record('0', call=0, output=f32[3, 8], grad_output=(f32[3, 8],))
        >>> bool((cap["0"].output < 0).any())   # the value before the in-place ReLU
        True
    """
    return Capture(model, where, what, keep, keeper=Keeper(device, dtype, clone))


class Capture:
    """Records of the chosen modules, by qualified name. Made by :func:`capture`."""

    def __init__(
        self,
        model: nn.Module,
        where: Where,
        what: str | Sequence[str],
        keep: str,
        *,
        keeper: Keeper,
    ) -> None:
        what = (what,) if isinstance(what, str) else tuple(what)
        for point in what:
            if point not in POINTS:
                raise ValueError(f"what: unknown point {point!r}; choose from {', '.join(POINTS)}")
        if keep not in ("last", "all"):
            raise ValueError(f"keep must be 'last' or 'all', got {keep!r}")
        model = eager_model(model, "capture")  # compiled already: traced again, with a warning
        self.names: tuple[str, ...] = tuple(select(model, where))
        self.what, self.keep = what, keep
        self._keeper = keeper
        self._named = _exact_names(where, self.names)
        self._records: dict[str, list[Record]] = {name: [] for name in self.names}
        # pre-hook -> hook, one list per module from the start: a compiled graph guards on
        # this dict's length, which a defaultdict would change at each new module's call
        self._open: dict[str, list[Record | None]] = {name: [] for name in self.names}
        # Records of forward passes run without autograd that asked for gradients: a reentrant
        # checkpoint or a reversible layer re-runs them with autograd during backward, and
        # the gradients come then. _in_model: those whose autograd the model itself turned
        # off; _rerun: names re-run with autograd during backward.
        self._no_grad: dict[tuple[str, int, int], Record] = {}
        self._in_model: set[tuple[str, int, int]] = set()
        self._rerun: set[str] = set()
        self._hooks = HookSet("capture")
        self._grads_seen = False
        self._tapped = False  # a compiled graph tapped outputs whose gradients are asked
        with self._hooks.attaching():
            self._attach(model)

    # -- hooks -----------------------------------------------------------------------------
    def _attach(self, model: nn.Module) -> None:
        self._clock = CallClock(self._hooks, model)
        modules = dict(model.named_modules())
        self._grads = "grad_input" in self.what or "grad_output" in self.what
        self._uses_pre = "input" in self.what or self._grads
        # Inside a compiled graph: the values and output gradients pass through a tap, and
        # the records are made when the graph runs (_hooks/_taps.py). grad_input needs a
        # tensor hook: the graph breaks there and the hooks run as they do eagerly.
        self._in_graph = taps_compile() and "grad_input" not in self.what
        self._slots: dict[tuple[str, str, bool], int] = {}
        if self._in_graph:
            ref = weakref.ref(self)  # the registry is the process's, the capture is not
            for name in self.names:
                if "input" in self.what:
                    self._slots[name, "input", True] = open_tap(
                        functools.partial(_ran, ref, "_inputs_ran", name)
                    )
                if "output" not in self.what and "grad_output" not in self.what:
                    continue
                for grad in (True, False):
                    values = functools.partial(_ran, ref, "_outputs_ran", name, grad)
                    grads = (
                        functools.partial(_ran, ref, "_tap_grad", name)
                        if grad and "grad_output" in self.what
                        else None
                    )
                    self._slots[name, "output", grad] = open_tap(values, grads)
            self._hooks.on_remove(self._close_taps)
        for name in self.names:
            module = modules[name]
            if self._uses_pre:
                self._hooks.forward_pre(module, functools.partial(self._pre, name))
            self._hooks.forward(module, functools.partial(self._post, name), always_call=True)

    # -- inside a compiled graph: taps, and records made as the graph runs -----------------
    def _tap_inputs(self, name: str, args: tuple, kwargs: dict) -> Any:
        slot = self._slots.get((name, "input", True))
        return None if slot is None else tap((args, kwargs), slot)

    def _tap_outputs(self, name: str, output: Any) -> Any:
        slot = self._slots.get((name, "output", torch.is_grad_enabled()))
        return None if slot is None else tap(output, slot)

    def _inputs_ran(self, name: str, form: int, found: list[torch.Tensor]) -> None:
        if is_replaying():
            return
        record = Record(name, self._clock.next(name), self._clock.pass_)
        record.input, record.kwargs = refill(form, [self._graph_kept(t) for t in found])
        if (name, "output", True) in self._slots:
            self._open[name].append(record)  # its outputs complete it
        else:
            self._store(name, record)

    def _outputs_ran(self, name: str, grad: bool, form: int, found: list[torch.Tensor]) -> None:
        if is_replaying():
            return
        opened = self._open[name]
        record = (
            opened.pop()
            if "input" in self.what and opened
            else Record(name, self._clock.next(name), self._clock.pass_)
        )
        if "output" in self.what:
            record.output = refill(form, [self._graph_kept(t) for t in found])
        self._store(name, record)
        if "grad_output" not in self.what:
            return
        if grad:
            record._grad_out = [None] * len(found)
            self._tapped = True
        else:
            key = (name, record._pass, record.call)
            self._no_grad[key] = record
            if self._clock.root_grad:
                self._in_model.add(key)

    def _graph_kept(self, t: torch.Tensor) -> torch.Tensor:
        """A value from a compiled graph's buffer, which Inductor may reuse: always copied."""
        kept = self._keeper.tensor(t)
        return kept.clone() if kept.data_ptr() == t.data_ptr() else kept

    def _pre(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if self._in_graph and is_compiling():
            return self._tap_inputs(name, args, kwargs)
        if is_replaying():  # hookscope re-running a step: not a pass of the user's
            return None
        if in_backward_recompute():
            # A checkpoint or reversible layer re-runs forward: never a new record. If the
            # first run had no autograd, this run carries the gradients: attach them.
            original = None
            if torch.is_grad_enabled():
                self._rerun.add(name)
                original = self._clock.original(name, args)
            key = (name, *original) if original else None
            record = self._no_grad.pop(key, None) if key else None
            self._in_model.discard(key)
            self._open[name].append(record)
            return self._hook_grad_inputs(record, module, args, kwargs) if record else None
        record = Record(name, self._clock.next(name, args), self._clock.pass_)
        self._open[name].append(record)
        if "input" in self.what:
            record.input = self._keeper.value(args, name)
            record.kwargs = self._keeper.value(kwargs, name)
        if self._grads and not torch.is_grad_enabled():
            key = (name, record._pass, record.call)
            self._no_grad[key] = record
            if self._clock.root_grad:
                self._in_model.add(key)
            return None
        return self._hook_grad_inputs(record, module, args, kwargs)

    def _hook_grad_inputs(
        self, record: Record, module: nn.Module, args: tuple, kwargs: dict
    ) -> Any:
        if "grad_input" not in self.what:
            return None
        break_graph_for(f"capture of the gradients of {record.name!r}", "capture")
        record._grad_in = [None] * len(args)
        # a reader: after an edit's copy, its hooks (the gradient as every edit left it)
        new, hooked = alias_grad_inputs(args, module, read=True)
        for i, t in hooked.items():
            self._hooks.tensor(t, functools.partial(self._store_grad, record, "_grad_in", i))
        return None if new is args else (new, kwargs)

    def _post(self, name: str, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if self._in_graph and is_compiling():
            return self._tap_outputs(name, output)
        if is_replaying():
            return None
        record = self._open[name].pop() if self._uses_pre and self._open[name] else None
        if forward_failed(output):
            return None
        if in_backward_recompute():
            return (
                self._hook_grad_outputs(record, output, args, kwargs)
                if record is not None
                else None
            )
        if record is None:
            record = Record(name, self._clock.next(name, args), self._clock.pass_)
        if "output" in self.what:
            record.output = self._keeper.value(output, name)
        self._store(name, record)
        if "grad_output" in self.what and torch.is_grad_enabled():
            return self._hook_grad_outputs(record, output, args, kwargs)
        return None

    def _hook_grad_outputs(self, record: Record, output: Any, args: tuple, kwargs: dict) -> Any:
        if "grad_output" not in self.what:
            return None
        break_graph_for(f"capture of the gradients of {record.name!r}", "capture")
        new, aliases = alias_grad_outputs(output, args, kwargs)
        record._grad_out = [None] * len(tensors(output))
        for i, t in enumerate(aliases):
            if t is not None:
                self._hooks.tensor(t, functools.partial(self._store_grad, record, "_grad_out", i))
        return None if new is output else new

    def _tap_grad(self, name: str, index: int, grad: torch.Tensor) -> None:
        """A gradient from a compiled graph, for output ``index`` of ``name``: it goes to the
        latest record of ``name`` still without one there. Backward runs a pass's calls last
        first, so a module called twice gets each call's gradient, as the eager hooks do."""
        for record in reversed(self._records[name]):
            slots = record._grad_out
            if slots is not None and index < len(slots) and slots[index] is None:
                slots[index] = self._graph_kept(grad)
                self._grads_seen = True
                return

    def _close_taps(self) -> None:
        for slot in self._slots.values():
            close_tap(slot)
        self._slots.clear()

    def _store_grad(self, record: Record, slot: str, index: int, grad: torch.Tensor) -> None:
        getattr(record, slot)[index] = self._keeper.tensor(grad)
        self._grads_seen = True

    def _store(self, name: str, record: Record) -> None:
        records = self._records[name]
        if (
            self.keep == "last"
            and records
            and (records[-1]._pass != record._pass or self._clock.pass_ == 0)
        ):
            records.clear()
        records.append(record)

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Remove every hook this capture added. The records stay readable."""
        self._hooks.remove()
        for calls in self._open.values():
            calls.clear()

    def __enter__(self) -> Capture:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        waiting = self._waiting()
        hooked = len(self._hooks._tensor_handles) > 0 or self._tapped
        unreached = hooked and not self._grads_seen
        self.close()
        self._no_grad.clear()
        self._in_model.clear()
        if exc_type is not None:
            return
        for message in waiting:
            warnings.warn(message, NoGradWarning, stacklevel=2)
        if not waiting and unreached:
            warnings.warn(
                "capture asked for gradients, but no gradient reached its hooks before the "
                "`with` block ended, so none was recorded. Call loss.backward() inside the "
                "block (the hooks are removed when it ends).",
                NoGradWarning,
                stacklevel=2,
            )
        never = [name for name in self._named if not self._records[name]]
        if never:
            warnings.warn(never_ran_message(never), NeverCalledWarning, stacklevel=2)

    def _waiting(self) -> list[str]:
        """Why gradients asked for never came, one message per cause."""
        user, model, unmatched = set(), set(), set()
        for key in self._no_grad:
            name = key[0]
            if key not in self._in_model:
                user.add(name)
            else:
                (unmatched if name in self._rerun else model).add(name)
        asked = "capture asked for gradients of"
        messages = []
        if user:
            messages.append(
                f"{asked} {name_list(sorted(user))}, but the forward pass ran under "
                "torch.no_grad() or torch.inference_mode(), so no gradient was recorded. Run "
                "the forward pass with autograd enabled and call backward() inside the `with` "
                "block, or capture only 'input'/'output'."
            )
        if model:
            messages.append(
                no_grad_in_model_message(
                    asked,
                    "no gradient was recorded",
                    "capture only 'input'/'output' of these",
                    name_list(sorted(model)),
                )
            )
        if unmatched:
            messages.append(
                f"{asked} {name_list(sorted(unmatched))}: the model ran them with autograd off "
                "and again during backward(), but they are called more than once per forward "
                "pass and hookscope could not tell which call each re-run repeats, so it "
                "recorded no gradient for them rather than a possibly wrong one. Capture the "
                "gradients of modules called once per pass, or only 'input'/'output' of these."
            )
        return messages

    # -- reading ---------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Record:
        return self.all(name)[-1]

    def all(self, name: str) -> list[Record]:
        """Every record kept for ``name``, in call order."""
        if name not in self._records:
            import difflib

            close = difflib.get_close_matches(name, self.names, n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise MissingRecordError(
                f"{name!r} is not one of the {len(self.names)} captured modules.{hint}"
            )
        records = self._records[name]
        if not records:
            raise MissingRecordError(never_ran_message([name]))
        if not self._keeper.clone:
            for record in records:
                _check_unchanged(record)
        return list(records)

    @property
    def missing(self) -> list[str]:
        """Chosen modules that never ran while the hooks were attached."""
        return [name for name, records in self._records.items() if not records]

    def __contains__(self, name: object) -> bool:
        return bool(self._records.get(name))  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[str]:
        return (name for name, records in self._records.items() if records)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def keys(self) -> list[str]:
        return list(self)

    def items(self) -> list[tuple[str, Record]]:
        return [(name, self[name]) for name in self]

    def __repr__(self) -> str:
        lines = [f"Capture({len(self)} of {len(self.names)} modules, what={list(self.what)})"]
        for name in self:
            for record in self._records[name]:
                lines.append(f"  {record!r}")
        if self.missing:
            lines.append(f"  never ran: {name_list(self.missing)}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        from ._notebook import capture_html
        from ._tree import describe

        return capture_html(self, describe)


def _ran(ref: weakref.ref[Capture], method: str, *args: Any) -> None:
    """A tap's callback, by a weak reference to its capture (kept in the process's registry)."""
    capture = ref()
    if capture is not None:
        getattr(capture, method)(*args)


def _exact_names(where: Where, names: tuple[str, ...]) -> list[str]:
    """The names a user spelled out exactly (warn if those never run; globs stay quiet)."""
    items = (
        [where] if isinstance(where, str) else (where if isinstance(where, (list, tuple)) else [])
    )
    return [item for item in items if isinstance(item, str) and item in names]


def _check_unchanged(record: Record) -> None:
    """With ``clone=False``, refuse to hand out a value the model changed in place later."""
    for value in (record.input, record.kwargs, record.output):
        for t in tensors(value):
            if version(t) != getattr(t, "_hs_version", version(t)):
                raise HookscopeError(
                    f"the captured value of {record.name!r} (call {record.call}) was changed in "
                    "place by the model after the hook ran (e.g. by nn.ReLU(inplace=True)), so "
                    "it no longer holds what the module returned. Capture with clone=True (the "
                    "default) to keep a copy."
                )
