"""Features from the middle of a Hugging Face GPT-2, and a steering intervention.

Builds a small GPT-2 from a config (random weights, no download), extracts the residual
stream after block 1 (the pass stops there), captures every block's output with gradients,
and adds a steering vector to block 1's output.

    python examples/capture_features.py
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import hookscope as hs


def main() -> None:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=4,
        n_embd=64,
        n_head=4,
        vocab_size=100,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 100, (2, 16))

    feats = hs.extract(model, ids, where="transformer.h.1")
    hidden = feats["transformer.h.1"]
    hidden = hidden[0] if isinstance(hidden, tuple) else hidden
    print("block 1 features:", tuple(hidden.shape))

    with hs.capture(model, "transformer.h.*", what=("output", "grad_output")) as cap:
        model(ids, labels=ids).loss.backward()
    for name, record in cap.items():
        grad = record.grad_output[0]
        print(f"{name:16s} grad norm {grad.norm():.4f}")

    steer = torch.randn(64) * 4
    with torch.no_grad():
        with hs.intervene(model, "transformer.h.1", lambda out, site: _add(out, steer)):
            steered = model(ids).logits
        print("logits moved by", float((steered - model(ids).logits).abs().mean()))


def _add(out, vector):
    if isinstance(out, tuple):
        return (out[0] + vector, *out[1:])
    return out + vector


if __name__ == "__main__":
    main()
