"""Choosing modules: ``select(model, where)``.

A *where* is a qualified name, a glob over dotted names (``*`` inside one segment, ``**``
across segments), a compiled regex (full match), an ``nn.Module`` subclass, a predicate
``(name, module) -> bool``, or a list of those (their union). ``""`` is the root module; no
glob matches the root.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Union

from torch import nn

from ._errors import SelectionError
from ._inputs import check_chosen, check_model

__all__ = ["Where", "select"]

Where = Union[str, "re.Pattern[str]", type, Callable[[str, nn.Module], bool], Sequence["Where"]]

_GLOB_CHARS = frozenset("*?[")


def select(model: nn.Module, where: Where) -> dict[str, nn.Module]:
    """Resolve ``where`` into ``{qualified name: module}``, in ``named_modules()`` order.

    Args:
        model: The model whose modules are chosen from.
        where: A name, glob, ``re.Pattern``, module type, predicate ``(name, module) -> bool``,
            or a list of these (their union).

    Returns:
        The chosen modules by qualified name, in the order ``model.named_modules()`` gives.

    Raises:
        SelectionError: If nothing matched, or an exact name in a list does not exist. The
            message names the closest real names.
        TypeError: If ``where`` is none of the accepted forms.
        UnsupportedModelError: If ``model`` is no ``nn.Module``, or a chosen module is
            TorchScript (it runs no Python hook).

    Example:
        >>> import hookscope as hs, torch.nn as nn
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> list(hs.select(model, nn.Linear))
        ['0', '2']
        >>> list(hs.select(model, "*"))
        ['0', '1', '2']
    """
    check_model(model)
    modules = dict(model.named_modules())
    wanted = _match(modules, where, model)
    if not wanted:
        raise SelectionError(_nothing_matched(model, modules, where))
    chosen = {name: module for name, module in modules.items() if name in wanted}
    check_chosen(chosen)
    return chosen


def _match(modules: dict[str, nn.Module], where: Where, model: nn.Module) -> set[str]:
    if isinstance(where, str):
        if where in modules:
            return {where}
        if _GLOB_CHARS & set(where):
            pattern = _glob_regex(where)
            return {name for name in modules if name and pattern.fullmatch(name)}
        return set()
    if isinstance(where, re.Pattern):
        return {name for name in modules if where.fullmatch(name)}
    if isinstance(where, type):
        if not issubclass(where, nn.Module):
            raise TypeError(f"where: a type must be an nn.Module subclass, got {where.__name__}")
        return {name for name, module in modules.items() if isinstance(module, where)}
    if callable(where):
        return {name for name, module in modules.items() if where(name, module)}
    if isinstance(where, Sequence) and not isinstance(where, (bytes, bytearray)):
        found: set[str] = set()
        for item in where:
            matched = _match(modules, item, model)
            if not matched and isinstance(item, str) and not (_GLOB_CHARS & set(item)):
                raise SelectionError(_nothing_matched(model, modules, item))
            found |= matched
        return found
    raise TypeError(
        "where must be a module name or glob (str), a re.Pattern, an nn.Module subclass, "
        f"a callable (name, module) -> bool, or a list of these; got {type(where).__name__}"
    )


@functools.lru_cache(maxsize=256)
def _glob_regex(glob: str) -> re.Pattern[str]:
    """Translate a dotted glob: ``*``/``?``/``[...]`` inside a segment, ``**`` across them."""
    parts = glob.split(".")
    out: list[str] = []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part == "**":
            # "a.**.b" matches a.b and a.x.y.b; "**.b" matches b at any depth; "a.**" and "**"
            # match one or more segments.
            out.append(r"[^.]+(?:\.[^.]+)*" if last else r"(?:[^.]+\.)*")
            continue
        out.append(_segment_regex(part) + ("" if last else r"\."))
    return re.compile("".join(out))


def _segment_regex(segment: str) -> str:
    out, i = [], 0
    while i < len(segment):
        c = segment[i]
        if c == "*":
            out.append(r"[^.]*")
        elif c == "?":
            out.append(r"[^.]")
        elif c == "[" and "]" in segment[i + 1 :]:
            end = segment.index("]", i + 1)
            body = segment[i + 1 : end]
            body = "^" + body[1:] if body.startswith("!") else body
            out.append(f"[{body}]")
            i = end
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def _nothing_matched(model: nn.Module, modules: dict[str, nn.Module], where: Where) -> str:
    import difflib

    names = [name for name in modules if name]
    kind = type(model).__name__
    if isinstance(where, str):
        close = difflib.get_close_matches(where, names, n=3, cutoff=0.5)
        if not close and (_GLOB_CHARS & set(where)):
            literal = where.replace("**", "").replace("*", "").strip(".")
            close = [name for name in names if literal and literal in name][:3]
        head = (
            f"No module named {where!r} in {kind}"
            if not (_GLOB_CHARS & set(where))
            else (
                f"The glob {where!r} matched no module of {kind} (globs never match the root; "
                "'*' stays inside one dotted segment, '**' crosses segments)"
            )
        )
    else:
        close, head = [], f"{_describe_where(where)} matched no module of {kind}"
    lines = [head + "."]
    if close:
        lines.append("Did you mean " + ", ".join(repr(c) for c in close) + "?")
    lines.append(
        f"Hint: the model has {len(names)} named modules, e.g. "
        + ", ".join(repr(n) for n in names[:6])
        + "; `[name for name, _ in model.named_modules()]` lists them all."
    )
    return "\n".join(lines)


def _describe_where(where: Where) -> str:
    if isinstance(where, re.Pattern):
        return f"The pattern re.compile({where.pattern!r})"
    if isinstance(where, type):
        return f"The type {where.__name__}"
    if callable(where):
        return f"The predicate {getattr(where, '__name__', repr(where))}"
    return f"The selection {where!r}"
