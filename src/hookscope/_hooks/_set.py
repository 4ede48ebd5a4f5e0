"""The one place that registers and removes torch hooks.

Every verb (capture, extract, intervene, Monitor, summary) asks a :class:`HookSet` for its
hooks and never calls ``register_*_hook`` itself. A HookSet owns the handles it creates,
removes exactly those (hooks put on the model by the user or other libraries are never
touched), can be removed more than once, and is a context manager whose exit runs also when
the body raised, ``KeyboardInterrupt`` included.

Saving or copying a hooked model (``torch.save(model, f)``, ``pickle.dumps``,
``copy.deepcopy``) leaves hookscope's hooks out: while any HookSet holds module hooks,
``nn.Module.__getstate__`` (and the ``__getstate__`` of a module class that has its own,
``nn.LSTM``'s) is wrapped so that a module's pickled state lacks exactly the hook ids
hookscope registered. The copy carries no hookscope hook and nothing that refers to
hookscope (a checkpoint loads where hookscope is not installed), the original stays hooked,
and the user's and other libraries' hooks travel as they always did.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.optim import optimizer as _optimizer
from torch.utils.hooks import RemovableHandle

from ._patches import use

__all__ = ["HookSet", "live_handle_sets", "live_handles", "training_mode"]

# Every HookSet that still holds handles; assert_no_hooks(only_hookscope=True) reads it.
_LIVE: weakref.WeakSet[HookSet] = weakref.WeakSet()

# Tensor hooks die with their tensor; prune dead handles once this many piled up, and then
# at twice what survived: registration stays O(1) amortised however many are alive at once
# (an LSTMCell unrolled over 1,000 steps hooks several thousand outputs per backward).
_PRUNE_AT = 4096

# Keys of always-called forward hooks, one per role in a HookSet (HookSet._always_called).
_ROLE_KEYS = itertools.count(-1, -1)

# Ids (``RemovableHandle.id``: unique in the process, or a role key unique to its HookSet) of
# the hooks live HookSets put into the hook dicts of modules: what a module's pickled state
# leaves out.
_MODULE_HOOK_IDS: set[int] = set()


class HookSet:
    """Every torch hook one hookscope object added. Removing the set removes them all.

    Forward hooks are registered ``with_kwargs=True``: pre-hooks are called as
    ``fn(module, args, kwargs)`` and may return ``(args, kwargs)``; forward hooks as
    ``fn(module, args, kwargs, output)`` and may return a new output.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._handles: list[RemovableHandle] = []
        self._tensor_handles: list[RemovableHandle] = []
        self._prune_at = _PRUNE_AT
        self._roles: dict[Any, int] = {}  # always-called hooks: their key, by role
        # Ids of the hooks this set put on modules; forgotten also when the set is collected
        # without remove() (its modules went with it).
        self._module_ids: set[int] = set()
        # What this set holds replaced in torch (_patches.use), by what: released with it.
        self._patches: dict[Any, Callable[[], None]] = {}
        self._on_remove: list[Callable[[], None]] = []
        # Module hooks switched on and off together (``grouped``, ``switch``), by name
        self._groups: dict[str, _Group] = {}
        self._group: _Group | None = None  # where module hooks registered now go
        self._places: dict[int, tuple[dict, list[Any], list[int]]] = {}  # (_Group)
        self._besides: nn.Module | None = None  # whose hooks stay out of it
        weakref.finalize(self, _forget_module_hooks, self._module_ids, self._patches)
        _LIVE.add(self)

    # -- modules ---------------------------------------------------------------------------
    def forward_pre(
        self, module: nn.Module, fn: Callable[..., Any], *, prepend: bool = False
    ) -> None:
        handle = module.register_forward_pre_hook(fn, with_kwargs=True, prepend=prepend)
        self._keep_module_hook(handle, module)

    def forward(
        self,
        module: nn.Module,
        fn: Callable[..., Any],
        *,
        always_call: bool = False,
        prepend: bool = False,
    ) -> None:
        """``prepend``: run before the hooks already there (an edit, seen by every reader)."""
        if always_call:
            handle = self._always_called(module, fn)
            if prepend:
                module._forward_hooks.move_to_end(handle.id, last=False)
        else:
            handle = module.register_forward_hook(fn, with_kwargs=True, prepend=prepend)
        self._keep_module_hook(handle, module)

    def _always_called(self, module: nn.Module, fn: Callable[..., Any]) -> RemovableHandle:
        """``register_forward_hook(fn, with_kwargs=True, always_call=True)``, keyed by the
        hook's role in this set (its function's code) rather than by a fresh id.

        ``torch.compile`` guards on the keys of a module's always-called hooks: with a fresh
        id per module, each of N identical blocks compiled one by one would compile again.
        One key for the same hook on every module keeps them one graph. (Keys are negative:
        torch's own ids count up from 0.)
        """
        role = _code_of(fn)
        key = self._roles.get(role) if role is not None else None
        if key is None and role is not None:
            key = self._roles[role] = next(_ROLE_KEYS)
        if key is None or key in module._forward_hooks:  # twice on one module: a fresh id
            return module.register_forward_hook(fn, with_kwargs=True, always_call=True)
        extra = [module._forward_hooks_with_kwargs, module._forward_hooks_always_called]
        handle = RemovableHandle(module._forward_hooks, extra_dict=extra)
        handle.id = key
        module._forward_hooks[key] = fn
        for marks in extra:
            marks[key] = True
        return handle

    def _keep_module_hook(self, handle: RemovableHandle, module: nn.Module) -> None:
        if self._group is not None and module is not self._besides:
            self._group.add(handle)
        self._module_ids.add(handle.id)
        _MODULE_HOOK_IDS.add(handle.id)
        # The __getstate__ that pickling ``module`` calls leaves our hooks out
        owner = next(c for c in type(module).__mro__ if "__getstate__" in vars(c))
        if issubclass(owner, nn.Module):
            self.patch(owner, "__getstate__", _without_hooks)
        self._keep(handle)

    # -- groups: module hooks that are on only when needed -----------------------------------
    @contextlib.contextmanager
    def grouped(self, name: str, *, besides: nn.Module | None = None) -> Iterator[None]:
        """Module hooks registered in the block belong to the group ``name``, which
        :meth:`switch` takes off the modules and puts back at once; those on ``besides``
        (the module whose hooks switch the group, which must not change its own hooks while
        torch runs them) stay out of it."""
        kept = self._group, self._besides
        group = self._groups.get(name)
        if group is None:
            group = self._groups[name] = _Group(self._places)
        self._group = group
        self._besides = besides
        try:
            yield
        finally:
            self._group, self._besides = kept

    def switch(self, name: str, on: bool) -> None:
        """Put the hooks of group ``name`` on their modules, or take them off: a module
        whose hooks are all off is called by torch without any hook dispatch at all. Each
        comes back under its own key, in its place among the module's other hooks."""
        group = self._groups.get(name)
        if group is not None and group.on != on:
            group.put_back() if on else group.take_off()

    def is_on(self, name: str) -> bool:
        group = self._groups.get(name)
        return group is None or group.on

    # -- torch's own functions -------------------------------------------------------------
    def patch(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        """Hold ``owner.name`` replaced by ``make(original)`` (shared with every other user:
        ``_patches.use``) until this set is removed."""
        if (owner, name) not in self._patches:
            self._patches[owner, name] = use(owner, name, make)

    # -- tensors and parameters ------------------------------------------------------------
    def tensor(self, t: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
        """``t.register_hook(fn)``; the caller checks ``t.requires_grad`` first."""
        handles = self._tensor_handles
        handles.append(t.register_hook(fn))
        if len(handles) >= self._prune_at:
            self._tensor_handles = handles = [h for h in handles if _alive(h)]
            self._prune_at = max(_PRUNE_AT, 2 * len(handles))

    # -- optimizers ------------------------------------------------------------------------
    def optimizer_step_pre(self, opt: torch.optim.Optimizer, fn: Callable[..., Any]) -> None:
        self._keep(opt.register_step_pre_hook(fn))

    def optimizer_step_post(self, opt: torch.optim.Optimizer, fn: Callable[..., Any]) -> None:
        self._keep(opt.register_step_post_hook(fn))

    def optimizer_step_pre_global(self, fn: Callable[..., Any]) -> None:
        """A pre-hook on every optimizer's ``step()`` in the process (torch's global hooks)."""
        self._keep(_optimizer.register_optimizer_step_pre_hook(fn))

    def optimizer_step_post_global(self, fn: Callable[..., Any]) -> None:
        """A post-hook on every optimizer's ``step()`` in the process."""
        self._keep(_optimizer.register_optimizer_step_post_hook(fn))

    # -- lifetime --------------------------------------------------------------------------
    @contextlib.contextmanager
    def attaching(self) -> Iterator[HookSet]:
        """Attach in the block: if it raises (a selection that matches nothing, a model the
        verb refuses), every hook the set holds is removed before the error goes on, and
        the model is as it was."""
        try:
            yield self
        except BaseException:
            self.remove()
            raise

    def on_remove(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` when the set is removed (what a hook holds that must not outlive it)."""
        self._on_remove.append(fn)

    def _keep(self, handle: RemovableHandle) -> None:
        self._handles.append(handle)

    def handles(self) -> list[RemovableHandle]:
        return [*self._handles, *self._tensor_handles]

    def remove(self) -> None:
        """Remove every hook this set added. Safe to call more than once."""
        for group in self._groups.values():
            group.forget()
        self._groups.clear()
        self._places.clear()
        while self._tensor_handles:
            self._tensor_handles.pop().remove()
        while self._handles:
            self._handles.pop().remove()
        self._prune_at = _PRUNE_AT
        _forget_module_hooks(self._module_ids, self._patches)
        while self._on_remove:
            self._on_remove.pop()()

    def __len__(self) -> int:
        return len(self._handles) + sum(_alive(h) for h in self._tensor_handles)

    def __enter__(self) -> HookSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"HookSet(owner={self.owner!r}, {len(self)} hooks)"


class _Group:
    """Module hooks taken off and put back together, each under its own key and in its
    place among the other hooks of its module (``HookSet.switch``). ``places`` is shared by
    a set's groups: each hook dict's order from before any group took a hook off it."""

    __slots__ = ("_away", "_handles", "_places", "on")

    def __init__(self, places: dict[int, tuple[dict, list[Any], list[int]]]) -> None:
        self.on = True
        self._handles: list[RemovableHandle] = []
        self._away: list[tuple[dict, int, Any]] = []  # (hook dict, key, value) while off
        # id(hook dict) -> (the dict, its keys in order, [how many of ours are off it])
        self._places = places

    def add(self, handle: RemovableHandle) -> None:
        self._handles.append(handle)
        if not self.on:  # registered while the group is off: off at once
            self._take_off([handle])

    def take_off(self) -> None:
        self.on = False
        self._take_off(self._handles)

    def _take_off(self, handles: list[RemovableHandle]) -> None:
        places = self._places
        for handle in handles:
            for ref in (handle.hooks_dict_ref, *handle.extra_dict_ref):
                hooks = ref()
                if hooks is None or handle.id not in hooks:
                    continue
                place = places.get(id(hooks))
                if place is None:
                    place = places[id(hooks)] = (hooks, list(hooks), [0])
                place[2][0] += 1
                self._away.append((hooks, handle.id, hooks.pop(handle.id)))

    def put_back(self) -> None:
        self.on = True
        away, self._away = self._away, []
        touched: dict[int, list] = {}  # id(hook dict): [the dict, how many came back to it]
        for hooks, key, value in away:
            hooks[key] = value
            entry = touched.get(id(hooks))
            if entry is None:
                touched[id(hooks)] = [hooks, 1]
            else:
                entry[1] += 1
        for key, (hooks, back) in touched.items():
            _, before, off = self._places[key]
            off[0] -= back
            now = list(hooks)
            if now == before:  # each back in its place already (the usual)
                order = now
            else:
                was = set(before)
                order = [k for k in before if k in hooks] + [k for k in now if k not in was]
            if now != order:  # back at the end: into their places
                items = [(k, hooks[k]) for k in order]
                hooks.clear()
                hooks.update(items)
            if not off[0]:  # all of ours are back: the next take-off sees the dict anew
                del self._places[key]

    def forget(self) -> None:
        """The set is removed: what is off stays off."""
        self._away, self._handles = [], []


def _code_of(fn: Callable[..., Any]) -> Any:
    """The code object behind a hook (through ``functools.partial`` and bound methods)."""
    fn = getattr(fn, "func", fn)
    return getattr(getattr(fn, "__func__", fn), "__code__", None)


def _alive(handle: RemovableHandle) -> bool:
    hooks = handle.hooks_dict_ref()
    return hooks is not None and handle.id in hooks


# -- pickling and copying: hooked modules travel without hookscope's hooks ---------------------


def _forget_module_hooks(ids: set[int], patches: dict[Any, Callable[[], None]]) -> None:
    """The hooks ``ids`` are gone: stop leaving them out, and let go of what their set held
    replaced (torch's ``__getstate__`` is back once no HookSet holds module hooks)."""
    _MODULE_HOOK_IDS.difference_update(ids)
    ids.clear()
    while patches:
        patches.popitem()[1]()


def _without_hooks(getstate: Callable[[nn.Module], dict[str, Any]]) -> Callable[..., Any]:
    """``getstate`` (``nn.Module.__getstate__``, or a module class's own), less the hooks
    live HookSets registered on the module.

    The state is a shallow copy of ``__dict__``: a hook dict that holds one of ours is
    replaced in the copy by a filtered one (the module itself keeps its hooks); every other
    entry, and the state of a module we never hooked, is what ``getstate`` returns.
    """

    def __getstate__(self: nn.Module) -> dict[str, Any]:
        state = getstate(self)
        ours = _MODULE_HOOK_IDS
        if ours and isinstance(state, dict):
            for key, value in list(state.items()):
                if "hooks" in key and isinstance(value, dict) and not ours.isdisjoint(value):
                    state[key] = type(value)((k, v) for k, v in value.items() if k not in ours)
        return state

    __getstate__.__qualname__ = getattr(getstate, "__qualname__", "__getstate__")
    __getstate__.__wrapped__ = getstate  # type: ignore[attr-defined]
    return __getstate__


def live_handles() -> list[RemovableHandle]:
    """Handles of every HookSet that has not been removed yet."""
    return [h for handles in live_handle_sets() for h in handles]


def live_handle_sets() -> list[list[RemovableHandle]]:
    """The live handles of each HookSet that has not been removed yet, one list per set."""
    return [[h for h in hs.handles() if _alive(h)] for hs in list(_LIVE)]


@contextlib.contextmanager
def training_mode(model: nn.Module, mode: bool) -> Iterator[None]:
    """Set ``model.train(mode)`` for the block, then restore every submodule's own flag."""
    before = [(module, module.training) for module in model.modules()]
    model.train(mode)
    try:
        yield
    finally:
        for module, flag in before:
            module.training = flag
