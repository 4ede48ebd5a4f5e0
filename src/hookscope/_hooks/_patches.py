"""The one owner of everything hookscope replaces in torch or Python.

hookscope runs inside processes it did not write, so a replaced attribute (a torch
function, a method of a torch class) is shared with every other user in the process: two
Monitors, a capture and a Monitor, several threads. :func:`use` is the only way hookscope
replaces one. For each ``(owner, name)``:

- the wrapper is made and installed once, by the first user, under one lock;
- each user holds a reference; the last one to release it puts back exactly the attribute
  that was there (for a method inherited from a base class: deleting ours, so that the
  base's shows through again);
- put back only if ours is still on top: when someone wrapped ours since, theirs stays,
  and ours, which asks its users at each call, only passes calls through while nobody
  uses it (it is taken up again, not wrapped twice, by the next user).

A wrapper must therefore work unchanged whatever its number of users, and do nothing but
call the original when it has none. ``_watch/_boot/sitecustomize.py`` is the documented
exception: it is installed at start-up by ``hookscope watch`` before hookscope can be
imported, for the life of the watched process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["patched", "use"]

_LOCK = threading.RLock()
_MISSING = object()


class _Patch:
    """One replaced attribute, its original and its users."""

    def __init__(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        self.owner, self.name, self.make = owner, name, make
        self.users = 0
        self.original: Any = _MISSING  # the attribute as found: what goes back
        self.wrapper: Any = None

    def acquire(self) -> None:
        self.users += 1
        if self.wrapper is not None:  # installed, or left in someone's chain: taken up again
            return
        self.original = self._own()
        self.wrapper = self.make(getattr(self.owner, self.name))
        setattr(self.owner, self.name, self.wrapper)

    def _own(self) -> Any:
        """The attribute the owner itself holds (``_MISSING`` where a class inherits it);
        for a module or any other object (a config module's setting), its value."""
        if isinstance(self.owner, type):
            return vars(self.owner).get(self.name, _MISSING)
        return getattr(self.owner, self.name)

    def release(self) -> bool:
        """One user fewer; True when the attribute is torch's (or Python's) own again."""
        self.users -= 1
        if self.users > 0:
            return False
        if self._own() is not self.wrapper:
            return False  # wrapped since by someone else: ours stays in their chain, idle
        if self.original is _MISSING:
            delattr(self.owner, self.name)  # inherited: the base's shows through again
        else:
            setattr(self.owner, self.name, self.original)
        self.wrapper, self.original = None, _MISSING
        return True


_PATCHES: dict[tuple[int, str], _Patch] = {}


def use(owner: Any, name: str, make: Callable[[Any], Any]) -> Callable[[], None]:
    """Replace ``owner.name`` by ``make(current)`` while any user holds it.

    Returns the user's release function (idempotent). ``make`` is called only by the first
    user, with the attribute found then; later users of the same ``(owner, name)`` share
    that wrapper whatever ``make`` they pass.
    """
    key = (id(owner), name)
    with _LOCK:
        patch = _PATCHES.get(key)
        if patch is None:
            patch = _PATCHES[key] = _Patch(owner, name, make)
        patch.acquire()
    released = False

    def release() -> None:
        nonlocal released
        with _LOCK:
            if released:
                return
            released = True
            if patch.release() and _PATCHES.get(key) is patch:
                del _PATCHES[key]

    return release


def patched() -> list[tuple[Any, str, int]]:
    """``(owner, name, users)`` of every attribute hookscope holds replaced now."""
    with _LOCK:
        return [(p.owner, p.name, p.users) for p in _PATCHES.values() if p.users > 0]
