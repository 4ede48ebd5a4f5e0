"""The modules' own Python attributes, which a replay of a step must start from and leave as
they were: a count of calls kept by a module (``self.calls += 1``), a list it appends to.

The tape reads the attributes rebound between steps (:func:`own_state`, shallow, by
identity) before each step for the few modules that have them; a replay reads every
module's, containers' contents included (:class:`PythonState`), on the step it runs only.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["MISSING", "PythonState", "own_state", "restore_state"]

MISSING = object()
# The attributes torch itself gives every module (parameters, buffers, children, hooks)
_MODULE_KEYS = frozenset(vars(nn.Module()))


def own_state(modules: list[nn.Module]) -> list[tuple[nn.Module, dict[str, Any]]]:
    """Each module's own Python attributes (a shallow copy of its ``__dict__`` without
    torch's): a count of its calls, a flag the loop sets."""
    return [(m, {k: v for k, v in vars(m).items() if k not in _MODULE_KEYS}) for m in modules]


def restore_state(state: list[tuple[nn.Module, dict[str, Any]]]) -> None:
    """Put back the attributes ``state`` holds that were rebound since (by identity)."""
    for module, attrs in state:
        own = vars(module)
        for k, v in attrs.items():
            if own.get(k, MISSING) is not v:
                own[k] = v


class PythonState:
    """Every module's own attributes and the contents of its lists, dicts and sets, read
    now; :meth:`restore` puts back what changed since and says where."""

    def __init__(self, model: nn.Module) -> None:
        self._names = {id(m): n for n, m in model.named_modules()}
        self._state = own_state(list(model.modules()))
        self._contents = {
            id(v): _contents(v)
            for _, attrs in self._state
            for v in attrs.values()
            if isinstance(v, (list, dict, set))
        }

    def restore(self) -> list[tuple[str, list[str]]]:
        """Put the attributes back; the modules (by name) and attributes that had changed."""
        moved = []
        for module, attrs in self._state:
            own, keys = vars(module), []
            for k, v in attrs.items():
                now = own.get(k, MISSING)
                if now is not v:
                    own[k] = v
                    if not _equal_scalars(now, v):  # a count rewound to the same number
                        keys.append(k)
                elif id(v) in self._contents and self._moved(v):
                    _put_back(v, self._contents[id(v)])
                    keys.append(k)
            if keys:
                moved.append((self._names.get(id(module), "?"), keys))
        return moved

    def _moved(self, v: Any) -> bool:
        keyed = isinstance(v, dict)
        saved = self._contents[id(v)]
        return _signature(_contents(v), keyed) != _signature(saved, keyed)


def _equal_scalars(a: Any, b: Any) -> bool:
    return type(a) is type(b) and type(a) in (int, float, bool, str) and a == b


def _contents(v: Any) -> tuple[Any, ...]:
    """What a container holds: its items (with their keys), compared by identity (its
    items may be tensors)."""
    if isinstance(v, dict):
        return tuple(v.items())
    return tuple(v)


def _signature(items: tuple[Any, ...], keyed: bool) -> tuple[Any, ...]:
    return tuple((k, id(x)) for k, x in items) if keyed else tuple(id(x) for x in items)


def _put_back(v: Any, saved: tuple[Any, ...]) -> None:
    if isinstance(v, (dict, set)):
        v.clear()
        v.update(saved)
    else:
        v[:] = list(saved)
