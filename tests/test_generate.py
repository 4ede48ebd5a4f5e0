"""Steering, intervene and capture during generate(), with and without the KV cache: the same
greedy tokens as a plain-torch oracle (a greedy loop over the whole sequence, no cache)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import hookscope as hs
from _tiny_lms import ARCHS
from hookscope.testing import assert_no_hooks

GENERATES = [name for name, spec in ARCHS.items() if spec.name != "bert"]
STEPS = 6


@functools.cache
def model_of(arch: str) -> nn.Module:
    return ARCHS[arch].build()


def steered_block(arch: str) -> str:
    return (
        "decoder.block.0"
        if arch == "t5"
        else sorted(hs.select(model_of(arch), ARCHS[arch].blocks))[0]
    )


def prompt() -> torch.Tensor:
    return torch.tensor([[5, 17, 42, 9, 33], [8, 61, 12, 77, 3]])


def vector(arch: str) -> torch.Tensor:
    width = model_of(arch).config.d_model if arch == "t5" else model_of(arch).config.hidden_size
    return 8.0 * torch.randn(width, generator=torch.Generator().manual_seed(3))


def generate(model: nn.Module, x: torch.Tensor, *, use_cache: bool) -> torch.Tensor:
    out = model.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=STEPS,
        do_sample=False,
        use_cache=use_cache,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[:, -STEPS:]


def oracle(arch: str, name: str, v: torch.Tensor | None, positions: object) -> torch.Tensor:
    """Greedy tokens from a loop over the whole sequence (no cache), with a raw hook adding
    ``v`` at the chosen positions of ``name``'s output."""
    model, x = model_of(arch), prompt()

    def add(module: nn.Module, args: tuple, output: object) -> object:
        hidden = output[0] if isinstance(output, tuple) else output
        length = hidden.shape[1]
        if positions is None:
            chosen = list(range(length))
        elif isinstance(positions, slice):
            chosen = list(range(length))[positions]
        else:
            chosen = [p for p in positions if p < length]
        hidden = hidden.clone()
        hidden[:, chosen] += v
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handle = model.get_submodule(name).register_forward_hook(add) if v is not None else None
    try:
        with torch.no_grad():
            if arch == "t5":
                seq = torch.zeros(x.shape[0], 1, dtype=torch.long)
                for _ in range(STEPS):
                    logits = model(input_ids=x, decoder_input_ids=seq).logits
                    seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], 1)
                return seq[:, 1:]
            seq = x
            for _ in range(STEPS):
                logits = model(seq).logits
                seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], 1)
            return seq[:, -STEPS:]
    finally:
        if handle is not None:
            handle.remove()


@pytest.mark.parametrize("positions", [None, [1, 4], slice(5, None)], ids=["all", "prompt", "new"])
@pytest.mark.parametrize("arch", GENERATES)
def test_steered_greedy_tokens_with_and_without_cache_equal_the_oracle(
    arch: str, positions: object
) -> None:
    model, name, v = model_of(arch), steered_block(arch), vector(arch)
    plain = generate(model, prompt(), use_cache=True)
    torch.testing.assert_close(plain, oracle(arch, name, None, None), rtol=0, atol=0)
    expected = oracle(arch, name, v, positions)
    assert not torch.equal(expected, plain)  # the vector changes what is generated
    for use_cache in (True, False):
        with hs.steer(model, name, v, positions=positions):
            got = generate(model, prompt(), use_cache=use_cache)
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=f"use_cache={use_cache}")
    assert_no_hooks(model)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_intervene_lambda_steers_every_forward_call(arch: str) -> None:
    """The README's form: ``lambda out, site: out + v`` (blocks return a tensor or a tuple)."""
    model, name, v = model_of(arch), steered_block(arch), vector(arch)
    expected = oracle(arch, name, v, None)
    calls = []

    def add(out: object, site: hs.Site) -> object:
        calls.append(site.name)
        return (out[0] + v, *out[1:]) if isinstance(out, tuple) else out + v

    for use_cache in (True, False):
        calls.clear()
        with hs.intervene(model, {name: add}):
            got = generate(model, prompt(), use_cache=use_cache)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        assert len(calls) == STEPS  # the prompt pass and each new token but the last


def test_capture_keeps_every_forward_call_of_generate() -> None:
    model = model_of("gpt2")
    raw = []
    handle = model.transformer.h[1].register_forward_hook(
        lambda m, a, o: raw.append((o[0] if isinstance(o, tuple) else o).clone()) and None
    )
    try:
        with hs.capture(model, "transformer.h.1", keep="all") as cap:
            generate(model, prompt(), use_cache=True)
    finally:
        handle.remove()
    records = cap.all("transformer.h.1")
    assert [tuple(r.output.shape) for r in records] == [(2, 5, 32)] + [(2, 1, 32)] * (STEPS - 1)
    for record, value in zip(records, raw, strict=True):
        torch.testing.assert_close(record.output, value, rtol=0, atol=0)


def test_site_call_counts_the_forward_calls_of_generate() -> None:
    model = model_of("gpt2")
    seen = []
    with hs.intervene(model, {"transformer.h.0": lambda out, site: seen.append(site.call)}):
        generate(model, prompt(), use_cache=True)
    assert seen == list(range(STEPS))
    seen.clear()
    with hs.intervene(model, {"transformer.h.0": lambda out, site: seen.append(site.call)}):
        for _ in range(3):  # one pass per generate() call, however they follow each other
            generate(model, prompt(), use_cache=True)
        model(prompt())  # the user's own call: a pass of its own
    assert seen == [*range(STEPS), *range(STEPS), *range(STEPS), 0]
