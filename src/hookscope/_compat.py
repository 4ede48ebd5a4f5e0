"""The one home of code that depends on the torch release.

Which releases run what, as tested (``ci/torch-matrix.sh``; README, "Supported torch
versions"): capture, intervene, extract and summary from :data:`EAGER_FLOOR`; the Monitor
(and ``watch`` and the integrations that build one) from :data:`MONITOR_FLOOR`, refused
before that with an error that says so. Everything else in the package calls torch's
public API of :data:`EAGER_FLOOR` or asks here.
"""

from __future__ import annotations

import contextlib
import sys
import typing
from collections.abc import Callable
from typing import Any

import torch

from ._errors import HookscopeError

__all__ = [
    "EAGER_FLOOR",
    "MONITOR_FLOOR",
    "TORCH",
    "autocast_dtype",
    "custom_op",
    "force_eager",
    "is_compiling",
    "release",
    "require",
    "skip_frame",
]


def release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string: ``"2.9.1+cu128"`` -> ``(2, 9)``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


TORCH = release(torch.__version__)
EAGER_FLOOR = (2, 4)  # capture / intervene / extract / summary: hooks, with_kwargs, always_call
MONITOR_FLOOR = (2, 7)  # Dynamo's frame-skip API (_FrameAction), set_stance, custom_op

_FEATURE_FLOORS = {"hs.Monitor": MONITOR_FLOOR}


def require(feature: str, floor: tuple[int, int] | None = None) -> None:
    """Raise a :class:`HookscopeError` naming the release ``feature`` needs, if this torch
    is older (``floor``: the feature's own, by default the one registered for it)."""
    need = floor or _FEATURE_FLOORS.get(feature, EAGER_FLOOR)
    if need <= TORCH:
        return
    want = ".".join(map(str, need))
    eager = ".".join(map(str, EAGER_FLOOR))
    raise HookscopeError(
        f"{feature} needs torch>={want} (this is {torch.__version__}): upgrade torch"
        + (
            f", or use capture/intervene/extract, which work on {eager}+."
            if TORCH >= EAGER_FLOOR
            else "."
        )
    )


def _dynamo_is_compiling() -> bool:  # torch < 2.3 had it in Dynamo only
    dynamo = sys.modules.get("torch._dynamo")
    return dynamo is not None and bool(dynamo.is_compiling())


#: ``torch.compiler.is_compiling`` itself where it exists (Dynamo knows that function and
#: answers True inside a trace with no graph break), read once: every hook asks it.
is_compiling: Callable[[], bool] = getattr(torch.compiler, "is_compiling", _dynamo_is_compiling)


def skip_frame(code: Any) -> None:
    """Have Dynamo run frames of ``code`` eagerly (and look at the frames they call) rather
    than compile them: ``torch._dynamo.eval_frame.skip_code``, without importing Dynamo
    (1.3 s). torch 2.7 replaced the C ``skip_code`` by per-code frame strategies."""
    try:
        from torch._C._dynamo import eval_frame
    except ImportError:  # a build without Dynamo: nothing is compiled
        return
    action = getattr(eval_frame, "_FrameAction", None)
    if action is not None:
        strategy = eval_frame._FrameExecStrategy(action.SKIP, action.DEFAULT)
        eval_frame.set_code_exec_strategy(code, strategy)
    elif hasattr(eval_frame, "skip_code"):  # torch < 2.7
        eval_frame.skip_code(code)


def force_eager() -> contextlib.AbstractContextManager[None]:
    """Every compiled function runs eagerly inside: ``set_stance("force_eager")`` (torch
    2.6+; the Monitor, which needs it, needs 2.7). Before 2.6 torch has no way to do so,
    and code compiled before the block runs compiled: hookscope's own passes (``extract``)
    then see what the compiled graph lets hooks see."""
    if "torch._dynamo" not in sys.modules:  # nothing was ever compiled
        return contextlib.nullcontext()
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def custom_op(
    name: str, *, mutates_args: tuple[str, ...] = (), python_side_effects: bool = False
) -> Callable[..., Any]:
    """``torch.library.custom_op`` for a function in a module with
    ``from __future__ import annotations``: torch 2.4 infers the op's schema from the
    annotations as objects and refuses strings, so they are resolved first.

    ``python_side_effects``: the op calls back into Python at run time, which a CUDA graph
    replay would skip: tagged ``cudagraph_unsafe`` (torch 2.9+), Inductor leaves it out of
    its CUDA graphs (``mode="reduce-overhead"``)."""
    unsafe = getattr(torch.Tag, "cudagraph_unsafe", None) if python_side_effects else None
    tags = {} if unsafe is None else {"tags": (unsafe,)}

    def define(fn: Callable[..., Any]) -> Any:
        fn.__annotations__ = typing.get_type_hints(fn)
        return torch.library.custom_op(name, mutates_args=mutates_args, **tags)(fn)

    return define


def autocast_dtype(device: str) -> torch.dtype | None:
    """The dtype autocast casts to on ``device`` (a device type) now, or None where autocast
    is off there or does not know the device type."""
    try:
        if not torch.is_autocast_enabled(device):
            return None
        return torch.get_autocast_dtype(device)
    except RuntimeError:  # a device type autocast does not know
        return None
