"""logit_lens(): each module's hidden states read through the model's final norm and unembedding."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .._errors import name_list
from .._hooks import HookSet, eager_model, training_mode
from .._select import Where, select
from ._result import LogitLens
from ._values import Key, attach, inputs, run

__all__ = ["logit_lens"]

# Names of a causal LM's final norm, a child of its base model (GPT-2 ln_f; Llama, Mistral,
# Qwen2, Gemma norm; GPT-NeoX and T5 final_layer_norm; Phi final_layernorm).
NORM_NAMES = ("ln_f", "norm", "final_layer_norm", "final_layernorm", "final_norm", "norm_f")


def logit_lens(
    model: nn.Module,
    tokens: Any,
    where: Where,
    *,
    norm: nn.Module | str | Callable[[torch.Tensor], torch.Tensor] | None = None,
    unembed: nn.Module | str | Callable[[torch.Tensor], torch.Tensor] | None = None,
    forward_kwargs: Mapping[str, Any] | None = None,
) -> LogitLens:
    """Log-probabilities of the next token read from each chosen module's output.

    Each module's output (its first tensor: a block's hidden states) is put through the
    model's final norm and its unembedding, then ``log_softmax``.

    Args:
        model: A causal language model (Hugging Face, as loaded) or any model, with
            ``norm=`` and ``unembed=`` given. It runs once, in eval mode, without autograd.
        tokens: The input: token ids, a tuple of positional inputs or a dict of keyword
            inputs.
        where: Which modules (``"transformer.h.*"``).
        norm: The final norm: a module, its qualified name, or a function; by default the
            child of ``model.base_model`` named ``ln_f``, ``norm``, ``final_layer_norm``,
            ``final_layernorm`` (or ``final_norm``, ``norm_f``).
        unembed: The unembedding: a module, its name, or a function; by default
            ``model.get_output_embeddings()``.
        forward_kwargs: Keyword inputs passed to the model.

    Returns:
        A :class:`LogitLens`: a tensor ``[modules, N, T, vocab]`` of log-probabilities with
        ``.sites`` naming its rows and ``.top(k)``.

    Raises:
        ValueError: If the final norm or the unembedding cannot be found (the message names
            ``norm=`` / ``unembed=``).
    """
    model = eager_model(model, "logit_lens")
    norm_fn = _norm(model, norm)
    unembed_fn = _unembed(model, unembed)
    names = list(select(model, where))
    x = inputs(tokens, forward_kwargs, "tokens")
    values: dict[Key, torch.Tensor] = {}

    def keep(key: Key, value: torch.Tensor) -> None:
        values[key] = value.detach().clone()

    with training_mode(model, False), torch.no_grad():
        with HookSet("logit_lens") as hooks:
            attach(hooks, model, dict.fromkeys(names, False), keep)
            run(model, x)
        never = [n for n in names if (n, 0) not in values]
        if never:
            raise ValueError(
                f"logit_lens: {name_list(never)} never ran on these tokens; choose modules the "
                "forward pass reaches"
            )
        rows, labels = [], []
        for name in names:
            calls = sorted(c for n, c in values if n == name)
            for call in calls:
                hidden = values[name, call]
                rows.append(torch.log_softmax(unembed_fn(norm_fn(hidden)).float(), dim=-1))
                labels.append(name if len(calls) == 1 else f"{name} (call {call})")
    shapes = {tuple(r.shape) for r in rows}
    if len(shapes) > 1:
        raise ValueError(
            f"logit_lens: the chosen modules give outputs of different shapes {sorted(shapes)}; "
            "choose modules of one stream (the blocks)"
        )
    return LogitLens(torch.stack(rows), sites=tuple(labels))


def _norm(model: nn.Module, norm: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    if norm is not None:
        return _resolve(model, norm, "norm")
    base = getattr(model, "base_model", None)
    for owner in (base, model):
        if not isinstance(owner, nn.Module):
            continue
        found = [
            child
            for name, child in owner.named_children()
            if name in NORM_NAMES and "norm" in type(child).__name__.lower()
        ]
        if found:
            return found[-1]
    raise ValueError(
        "logit_lens: cannot find the model's final norm (a child of model.base_model named "
        f"{', '.join(NORM_NAMES)}); pass it as norm= (a module, its name, or nn.Identity() for "
        "none). A masked LM's head transform is one: norm=model.cls.predictions.transform"
    )


def _unembed(model: nn.Module, unembed: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    if unembed is not None:
        return _resolve(model, unembed, "unembed")
    get = getattr(model, "get_output_embeddings", None)
    found = get() if callable(get) else None
    if isinstance(found, nn.Module):
        return found
    raise ValueError(
        "logit_lens: cannot find the unembedding (model.get_output_embeddings() gave "
        f"{type(found).__name__}); pass it as unembed= (a module, its name, or a function)"
    )


def _resolve(model: nn.Module, given: Any, what: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if isinstance(given, str):
        try:
            return model.get_submodule(given)
        except AttributeError:
            raise ValueError(f"logit_lens: {what}={given!r} names no submodule") from None
    if callable(given):
        return given
    raise TypeError(f"logit_lens: {what}= must be a module, its name or a function, got {given!r}")
