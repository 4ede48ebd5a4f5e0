"""The largest pre-softmax logit of each attention module, on sampled steps.

Attention logits that grow step after step (no QK normalisation, a high learning rate) are a
known precursor of divergence in transformers; the logits themselves are never a module's
output, so the usual hooks do not see them. While a Monitor with attention modules is open,
``F.scaled_dot_product_attention``, ``torch.softmax`` and ``Tensor.softmax`` are measuring
wrappers (installed once through ``_hooks.use``, shared by every Monitor, put back when the
last one closes), and they see the two calls that attention implementations make. A
wrapper measures only while an attention module of a Monitor runs a sampled forward *in
its own thread* (a thread-local stack that the modules' pre- and forward hooks push and
pop); any other call, and every call inside a compiled graph, goes straight to torch's
function. (A ``TorchFunctionMode`` sees them too, but every op and attribute of the forward
then passes through Python: 4 % of a GPT-2 step at every=1.)

- eager attention: ``softmax`` of a 4-D ``(batch, heads, queries, keys)`` tensor, whose
  largest finite entry is the logit (masked entries are very negative or ``-inf``: a finite
  mask value never wins the max, a non-finite one is left out);
- SDPA: ``F.scaled_dot_product_attention(q, k, v, ...)``, whose logits are
  ``q @ k^T * scale`` (``scale`` defaults to ``1/sqrt(d)``), recomputed for query rows spread
  over the sequence, at most ``sample`` logits in all (a full recomputation would cost as much
  as the attention), and masked as SDPA masks them (``attn_mask``, ``is_causal``).

Attention modules are those whose class name ends in ``Attention`` (``GPT2Attention``,
``BertSelfAttention``, a hand-written ``CausalSelfAttention``). Nested ones (BERT's
``BertAttention`` around ``BertSelfAttention``) are wrapped once, at the outermost, and a
logit is credited to the innermost module running. ``nn.MultiheadAttention`` (torch's
``TransformerEncoderLayer``, ViTs built on it) computes its logits inside
``F.multi_head_attention_forward``, whose ``need_weights=True`` path gives softmax 3-D
scores of merged heads: its pre-hook recomputes them instead, from the module's input projections, for
query rows such that at most ``sample`` logits are computed, masked as the module masks them (``attn_mask``,
``key_padding_mask``: ``True`` or ``-inf`` is left out). The value is a device scalar,
moved to the host with the step's one transfer.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..._hooks import HookSet
from ..._log import StepRecord
from .._step._buffer import Host, StepBuffer
from .._step._dist import Entry

__all__ = ["Attention", "attention_modules"]


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The modules of ``model`` whose logits the mode can see, by qualified name."""
    return {name: m for name, m in model.named_modules() if type(m).__name__.endswith("Attention")}


class Attention:
    """Per attention module, the largest pre-softmax logit of its sampled-step calls (the max
    over calls; the record's ``attn`` group).

    ``active()`` says whether a call should be measured (a sampled training step, not a
    replay nor an activation-checkpoint recompute); ``buffer()`` is the step's buffer at
    the time of the call.
    """

    def __init__(
        self,
        model: nn.Module,
        hooks: HookSet,
        sample: int | None,
        active: Callable[[nn.Module], bool],
        buffer: Callable[[], StepBuffer],
    ) -> None:
        found = attention_modules(model)
        self.modules = list(found)
        self.sample, self._active, self._buffer = sample, active, buffer
        wrapped = False
        for name, module in found.items():
            if isinstance(module, nn.MultiheadAttention):
                hooks.forward_pre(module, lambda m, a, k, name=name: self._multihead(name, m, a, k))
                continue
            if not wrapped:
                hooks.patch(F, "scaled_dot_product_attention", _measuring_sdpa)
                hooks.patch(torch, "softmax", _measuring_softmax)
                hooks.patch(torch.Tensor, "softmax", _measuring_softmax)
                wrapped = True
            hooks.forward_pre(module, lambda m, a, k, name=name: self._enter(name, m))
            hooks.forward(module, lambda m, a, k, o, name=name: self._exit(name), always_call=True)

    def _multihead(self, name: str, module: nn.MultiheadAttention, args: tuple, kwargs: dict):
        if self._active(module):
            with torch.no_grad():
                logit = _multihead_logit_max(module, args, kwargs, self.sample)
            self._buffer().add(("attn", name), logit.float(), "max")

    def _enter(self, name: str, module: nn.Module) -> None:
        if torch.compiler.is_compiling():  # eager-only: a graph would guard on the thread's
            return  # state, which changes after the first step (a recompile at step 1)
        running = _running()
        if not any(probe is self for probe, _ in running) and not self._active(module):
            return
        running.append((self, name))

    def _exit(self, name: str) -> None:
        if torch.compiler.is_compiling():
            return
        running = _running()
        for i in range(len(running) - 1, -1, -1):
            if running[i][0] is self:
                if running[i][1] == name:
                    del running[i]
                return  # else its pre-hook measured nothing

    def add(self, name: str, logit: torch.Tensor) -> None:
        self._buffer().add(("attn", name), logit.float(), "max")

    def layout(self) -> list[Entry]:
        """Keys and combining rules, for a collective across ranks."""
        return [Entry(("attn", name), 1, "max") for name in self.modules]

    def read(self, host: Host, record: StepRecord) -> None:
        for name in self.modules:
            value = host.get(("attn", name))
            if value is not None:
                record.attn[name] = {"logit_max": value[0]}


# The attention modules running a measured forward in this thread, outermost first, with
# the probe (one per Monitor) that measures them.
_THREAD = threading.local()


def _running() -> list[tuple[Attention, str]]:
    running = getattr(_THREAD, "running", None)
    if running is None:
        running = _THREAD.running = []
    return running


def _credit(logit: Callable[[], torch.Tensor]) -> None:
    """Give the logit to the innermost running module of each probe measuring now."""
    running = getattr(_THREAD, "running", None)
    if not running:
        return
    with torch.no_grad():
        value, done = logit(), []
    for probe, name in reversed(running):
        if not any(p is probe for p in done):
            done.append(probe)
            probe.add(name, value)


def _measuring_sdpa(sdpa: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(sdpa)
    def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> Any:
        if (
            not torch.compiler.is_compiling()
            and len(args) >= 2
            and getattr(_THREAD, "running", None)
        ):
            sample = _running()[-1][0].sample
            _credit(lambda: _sdpa_logit_max(*args[:2], sample, args[3:], kwargs))
        return sdpa(*args, **kwargs)

    return scaled_dot_product_attention


def _measuring_softmax(softmax: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.softmax`` or ``Tensor.softmax`` (which ``F.softmax`` calls), measured."""

    @functools.wraps(softmax)
    def measured(x: Any, *args: Any, **kwargs: Any) -> Any:
        if (
            not torch.compiler.is_compiling()
            and getattr(_THREAD, "running", None)
            and _is_scores(x)
        ):
            _credit(lambda: _finite_max(x.detach()))
        return softmax(x, *args, **kwargs)

    return measured


def _is_scores(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 4 and x.is_floating_point() and x.numel() > 0


def _finite_max(x: torch.Tensor) -> torch.Tensor:
    """The largest finite entry (``-inf`` when none is)."""
    return torch.where(torch.isfinite(x), x, -math.inf).amax()


def _sdpa_logit_max(
    q: torch.Tensor, k: torch.Tensor, sample: int | None, rest: tuple, kwargs: dict
) -> torch.Tensor:
    """The largest logit SDPA would compute, from query rows spread over the sequence (at
    most ``sample`` logits over every head; the last row included: under a causal mask it
    sees every key)."""
    names = ("attn_mask", "dropout_p", "is_causal", "scale")
    given = {**dict(zip(names, rest, strict=False)), **kwargs}
    mask, causal, scale = given.get("attn_mask"), given.get("is_causal", False), given.get("scale")
    q, k = q.detach(), k.detach()
    length, keys = q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    rows = _rows(length, q.numel() // max(length * q.shape[-1], 1), keys, sample, q.device)
    q = q.index_select(-2, rows)
    if q.dim() >= 3 and k.dim() >= 3 and k.shape[-3] != q.shape[-3]:  # grouped-query attention
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    logits = (q.float() @ k.float().transpose(-2, -1)) * scale
    if mask is not None:
        mask = mask.detach()
        if mask.dim() >= 2 and mask.shape[-2] == length:
            mask = mask.index_select(-2, rows)
        if mask.dtype == torch.bool:
            logits = logits.masked_fill(~mask, -math.inf)
        else:
            logits = logits + mask.float()
    if causal:
        allowed = torch.arange(keys, device=q.device)[None, :] <= rows[:, None]
        logits = logits.masked_fill(~allowed, -math.inf)
    return _finite_max(logits)


_MHA_ARGS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask")


def _multihead_logit_max(
    m: nn.MultiheadAttention, args: tuple, kwargs: dict, sample: int | None
) -> torch.Tensor:
    """The largest logit ``nn.MultiheadAttention`` will compute for this call, from its input
    projections, for query rows such that at most ``sample`` logits are computed."""
    given = {**dict(zip(_MHA_ARGS, args, strict=False)), **kwargs}
    q, k = given["query"].detach(), given["key"].detach()
    if q.dim() == 2:  # unbatched (L, E)
        q, k = q.unsqueeze(1), k.unsqueeze(1)
    elif m.batch_first:
        q, k = q.transpose(0, 1), k.transpose(0, 1)
    length, batch, e = q.shape  # (L, N, E) from here
    heads, d = m.num_heads, m.head_dim
    if m._qkv_same_embed_dim:
        wq, wk = m.in_proj_weight[:e], m.in_proj_weight[e : 2 * e]
    else:
        wq, wk = m.q_proj_weight, m.k_proj_weight
    bias = m.in_proj_bias
    bq, bk = (None, None) if bias is None else (bias[:e], bias[e : 2 * e])
    rows = _rows(length, batch * heads, k.shape[0] + (m.bias_k is not None), sample, q.device)
    qs = F.linear(q.index_select(0, rows), wq, bq)  # (r, N, E)
    ks = F.linear(k, wk, bk)  # (S, N, E)
    if m.bias_k is not None:  # add_bias_kv: one more key
        ks = torch.cat([ks, m.bias_k.expand(1, batch, e)])
    qs = qs.reshape(len(rows), batch, heads, d).permute(1, 2, 0, 3)  # (N, H, r, d)
    ks = ks.reshape(ks.shape[0], batch, heads, d).permute(1, 2, 0, 3)  # (N, H, S, d)
    logits = (qs.float() @ ks.float().transpose(-2, -1)) * d**-0.5
    mask = given.get("attn_mask")
    if mask is not None:  # (L, S) or (N * H, L, S)
        mask = mask.detach()
        if mask.dim() == 2:
            mask = mask.index_select(0, rows)[None, None]
        else:
            mask = mask.reshape(batch, heads, length, -1).index_select(2, rows)
        logits = _masked(logits, mask)
    padding = given.get("key_padding_mask")
    if padding is not None:  # (N, S)
        logits = _masked(logits, padding.detach().reshape(batch, 1, 1, -1))
    return _finite_max(logits)


def _masked(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``nn.MultiheadAttention``'s convention: a boolean ``True`` is not attended, a float
    mask is added (``add_bias_kv``'s extra key is never masked)."""
    mask = F.pad(mask, (0, logits.shape[-1] - mask.shape[-1]))
    if mask.dtype == torch.bool:
        return logits.masked_fill(mask, -math.inf)
    return logits + mask.float()


@functools.lru_cache(maxsize=64)
def _rows(
    length: int, heads: int, keys: int, sample: int | None, device: torch.device
) -> torch.Tensor:
    """Query positions such that all heads' logits number at most ``sample`` (one row at
    least: the last, which a causal mask lets see every key). Made on the host once per
    shape: ``unique`` on a GPU would wait for the device at every sampled call."""
    n = length if sample is None else max(1, min(length, sample // max(heads * keys, 1)))
    return torch.linspace(length - 1, 0, n).round().long().flip(0).unique().to(device)
