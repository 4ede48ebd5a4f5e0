"""The exceptions and warnings hookscope raises.

Every error says what was wrong, what was expected and what to do. Each one also inherits
the builtin a user would naturally catch (``LookupError`` for a bad name, ``ValueError`` for a
bad replacement), so ``except LookupError`` keeps working.

Below the public classes sit the few pieces the verbs share that are not public: the signal
that ends a forward pass early and the "never ran" message. They live here, at the bottom of
the import graph, so no verb imports another verb's private names.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class HookscopeError(Exception):
    """Base class of every error hookscope raises on purpose."""


class SelectionError(HookscopeError, LookupError):
    """A *where* matched no module, or named one that does not exist."""


class InterventionError(HookscopeError, ValueError):
    """An intervention returned a value of the wrong structure, shape or type."""


class MissingRecordError(HookscopeError, KeyError):
    """A capture has no record for the module asked for."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


class FeatureStoreError(HookscopeError, ValueError):
    """``out`` holds another extraction, or is not a hookscope feature store, or is damaged."""


class CompiledModelError(HookscopeError, RuntimeError):
    """Hooks were asked for on a model that ``torch.compile`` already wrapped."""


class UnsupportedModelError(HookscopeError, TypeError):
    """A model no hook can watch: not an ``nn.Module`` (a plain function), or a TorchScript
    module (``torch.jit.script`` / ``torch.jit.trace``), which runs no Python hook."""


class NonFiniteError(HookscopeError, FloatingPointError):
    """A NaN or Inf appeared; raised by a Monitor with ``on_nonfinite="raise"``.

    Attributes ``module``, ``step`` and ``phase`` (``"forward"`` or ``"backward"``) say where;
    ``op``, ``source`` and ``rank`` are ``None`` where they are not known.
    """

    def __init__(
        self,
        message: str,
        *,
        module: str,
        step: int,
        phase: str | None,
        op: str | None = None,
        source: str | None = None,
        rank: int | None = None,
    ) -> None:
        super().__init__(message)
        self.module = module
        self.step = step
        self.phase = phase
        self.op = op
        self.source = source
        self.rank = rank


class ExplainError(HookscopeError, ValueError):
    """``explain`` was asked for something it cannot do: an unknown method, a module whose
    output is not a float tensor, a target score that does not depend on the module."""


class LayoutError(ExplainError):
    """``explain`` could not tell how to read a module's output as a grid of positions (or
    was told a layout that does not fit it); ``layout=`` says which."""


class TargetError(ExplainError, IndexError):
    """An ``explain`` target that does not fit the model's output: an index out of range, one
    index per sample of the wrong length, or an output with no ``[N, C]`` scores to pick from."""


class HookscopeWarning(UserWarning):
    """Base class of hookscope's warnings."""


class NeverCalledWarning(HookscopeWarning):
    """A module chosen by exact name never ran while hooks were attached."""


class NoGradWarning(HookscopeWarning):
    """Gradients were asked for, but none came.

    The forward pass ran without autograd (under the user's ``torch.no_grad()``, or one in
    the model's own code), or no backward reached the hooks while they were attached.
    """


def missing_extra(module: str, extra: str) -> ImportError:
    """The error for an optional dependency that is not installed."""
    return ImportError(
        f"this feature needs the optional package {module!r}; "
        f"install it with: pip install 'hookscope[{extra}]'"
    )


def did_you_mean(name: str, options: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``options``, or ``""``."""
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# -- shared by the verbs, not public -----------------------------------------------------------
class StopForward(Exception):
    """Raised by a hook after the last module it waits for, to end the forward pass there.

    Not a :class:`HookscopeError`: it never reaches the user, because the verb that raises it
    (``extract``, ``extract_dataset``) suppresses it around the model call.
    """


def name_list(names: list[str], limit: int = 8) -> str:
    """``'a', 'b' and 3 more``: module names for a message, at most ``limit`` of them."""
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def never_ran_message(names: list[str]) -> str:
    """Why chosen modules can have no record, and what to do: one text for every verb."""
    return (
        f"{name_list(names)} never ran while hooks were attached: either the model did not use "
        "it in this forward pass, or its parent calls `.forward(...)` on it directly, which "
        "skips every hook. Call the module itself (`self.block(x)`, not "
        "`self.block.forward(x)`), or choose a module that does run."
    )
