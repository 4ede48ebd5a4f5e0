"""Attention heads: the output projection of an attention module and its number of heads.

Found by one generic search, the same on every architecture: the projection is the one
descendant named like an output projection (``c_proj``, ``o_proj``, ``out_proj``,
``dense``, ``o``), else the last ``nn.Linear`` child; the head count is the model config's
(``num_attention_heads``, ``n_head``, ``num_heads``) or the attention module's own.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["HEADS_HELP", "find_heads"]

PROJECTION_NAMES = ("c_proj", "o_proj", "out_proj", "dense", "o")
COUNT_NAMES = ("num_attention_heads", "n_head", "num_heads", "n_heads")

HEADS_HELP = (
    "heads= takes True (found), the projection's name inside each chosen module "
    "(heads='o_proj'), the number of heads (heads=8), or both (heads=('o_proj', 8))"
)


def find_heads(model: nn.Module, name: str, module: nn.Module, heads: Any) -> tuple[str, int]:
    """``(qualified name of the output projection, number of heads)`` for ``name``."""
    proj, count = _parse(heads)
    proj_name = _projection(name, module, proj)
    found = count or _count(model, module)
    if found is None:
        raise ValueError(
            f"patching(heads=...): no head count for {name!r}: neither the model's config nor "
            f"the module has any of {', '.join(COUNT_NAMES)}. {HEADS_HELP}."
        )
    width = _in_features(dict(model.named_modules())[proj_name])
    if width is not None and width % found:
        raise ValueError(
            f"patching(heads=...): {proj_name!r} takes {width} features, which {found} heads "
            f"do not divide. {HEADS_HELP}."
        )
    return proj_name, found


def _parse(heads: Any) -> tuple[str | None, int | None]:
    if heads is True:
        return None, None
    if isinstance(heads, bool):
        raise ValueError(f"patching: heads=False asks for no heads. {HEADS_HELP}.")
    if isinstance(heads, int) and heads > 0:
        return None, heads
    if isinstance(heads, str):
        return heads, None
    if (
        isinstance(heads, tuple)
        and len(heads) == 2
        and isinstance(heads[0], str)
        and isinstance(heads[1], int)
        and not isinstance(heads[1], bool)
        and heads[1] > 0
    ):
        return heads[0], heads[1]
    raise ValueError(f"patching: heads={heads!r} is not understood. {HEADS_HELP}.")


def _projection(name: str, module: nn.Module, proj: str | None) -> str:
    inside = dict(module.named_modules())
    if proj is not None:
        if proj not in inside or proj == "":
            raise ValueError(
                f"patching(heads={proj!r}): {name!r} has no submodule {proj!r}; its "
                f"submodules: {', '.join(repr(n) for n in list(inside)[1:12]) or 'none'}. "
                f"{HEADS_HELP}."
            )
        return _join(name, proj)
    kind = f"{name.rsplit('.', 1)[-1]} {type(module).__name__}".lower()
    if "attn" not in kind and "attention" not in kind:
        raise ValueError(
            f"patching(heads=True): {name!r} ({type(module).__name__}) does not look like an "
            "attention module (neither its name nor its class says attn or attention); choose "
            f"the attention modules, or name the projection. {HEADS_HELP}."
        )
    named = [n for n in inside if n and n.rsplit(".", 1)[-1] in PROJECTION_NAMES]
    if len(named) == 1:
        return _join(name, named[0])
    linear = [n for n, child in module.named_children() if isinstance(child, nn.Linear)]
    if not named and linear:
        return _join(name, linear[-1])
    why = (
        f"several candidates ({', '.join(map(repr, named))}): choose the attention module "
        "itself, not a block around it"
        if named
        else f"no submodule named {', '.join(PROJECTION_NAMES)} and no nn.Linear child"
    )
    raise ValueError(
        f"patching(heads=...): cannot find the attention output projection of {name!r}: "
        f"{why}. {HEADS_HELP}."
    )


def _join(name: str, child: str) -> str:
    return f"{name}.{child}" if name else child


def _count(model: nn.Module, module: nn.Module) -> int | None:
    for owner in (getattr(model, "config", None), module, getattr(module, "config", None)):
        for attr in COUNT_NAMES:
            value = getattr(owner, attr, None) if owner is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _in_features(module: nn.Module) -> int | None:
    """The width the projection splits: ``in_features`` (Linear) or its weight's rows
    (transformers' ``Conv1D``, which stores the weight transposed)."""
    width = getattr(module, "in_features", None)
    if isinstance(width, int):
        return width
    weight = getattr(module, "weight", None)
    return int(weight.shape[0]) if getattr(weight, "dim", lambda: 0)() == 2 else None
