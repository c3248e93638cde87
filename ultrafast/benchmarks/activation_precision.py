"""Why the VNNI kernels round activations to int16, not to int8 as llama.cpp does.

    python -m ultrafast.benchmarks.activation_precision [--model smollm2-135m] [--bits 8] [--tokens 64]

Runs Hugging Face transformers on the GGUF in fp32 twice: as is, and with the input of every linear layer
rounded per block of 32 values to signed `bits`-bit integers (s = max|x| / (2^(bits-1) - 1), x = rint(x/s) * s:
the activation quantization of our kernels, whose top is 32639 rather than 32767 at 16 bits, or of
llama.cpp's q8 dot products at 8 bits). Prints, for eight chat prompts, the largest last-token logit
difference and whether greedy decoding of `--tokens` tokens stays identical. Needs the `test` extra (transformers). hf_model and hf_greedy are also the reference of
tests/test_reference_hf.py.
"""

from __future__ import annotations

import argparse
import inspect

import torch

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "What is 17 * 23? Show your working.",
    "Hi! How are you today?",
    "Explain what a hash map is to a beginner.",
    "Translate to French: The weather is nice today.",
    "Write a haiku about the sea.",
    "If a train travels 60 km in 45 minutes, what is its speed in km/h?",
    "Give me three tips for writing clean code.",
]


def rounding_hook(bits: int, block: int = 32):
    """A forward pre-hook rounding a linear's input per `block` values to signed `bits`-bit integers, as the kernels
    do (per 32 on the VNNI kernels; the AVX2 int8 ones round per 256)."""
    top = float(2 ** (bits - 1) - 1)

    def hook(_module, inputs):
        x = inputs[0]
        xb = x.reshape(-1, block)
        s = xb.abs().amax(-1, keepdim=True) / top
        safe = torch.where(s > 0, s, torch.ones_like(s))
        return ((torch.round(xb / safe) * s).reshape(x.shape),)

    return hook


def hf_model(path):
    """transformers' fp32 model of a GGUF file (the reference the engine's tests compare against)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy decoding with transformers in a plain loop, with an explicit all-ones attention mask: SmolLM2's
    pad token is its EOS, which appears inside every chat prompt, and generate() would mask it
    (shared/notes/measurements.md)."""
    # the KV cache's name: `cache` in recent transformers (which deprecate `past_key_values` and will drop it),
    # `past_key_values` before
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    x = torch.tensor([ids])
    out = model(x, attention_mask=torch.ones_like(x), use_cache=True)
    past, toks = getattr(out, key), []
    for _ in range(n):
        toks.append(int(out.logits[0, -1].argmax()))
        mask = torch.ones(1, len(ids) + len(toks), dtype=torch.long)
        out = model(torch.tensor([[toks[-1]]]), attention_mask=mask, use_cache=True, **{key: past})
        past = getattr(out, key)
    return toks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--bits", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args(argv)
    if not 2 <= args.bits <= 24:
        ap.error("--bits must be between 2 and 24")
    from ..engine import Engine
    from ..pull import pull

    path = pull(args.model)
    engine = Engine.from_path(path, max_context=1024)
    ref, rounded = hf_model(path), hf_model(path)
    for m in rounded.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(rounding_hook(args.bits))
    same = 0
    for i, prompt in enumerate(PROMPTS):
        ids = engine.chat_prompt([{"role": "user", "content": prompt}])
        with torch.no_grad():
            mask = torch.ones(1, len(ids), dtype=torch.long)
            a = ref(torch.tensor([ids]), attention_mask=mask).logits[0, -1]
            b = rounded(torch.tensor([ids]), attention_mask=mask).logits[0, -1]
        ok = hf_greedy(ref, ids, args.tokens) == hf_greedy(rounded, ids, args.tokens)
        same += ok
        print(f"prompt {i}: max |logit diff| {(a - b).abs().max().item():.3g}, greedy {args.tokens} tokens "
              f"{'identical' if ok else 'differ'}", flush=True)
    print(f"{args.model}, activations rounded to int{args.bits} per block of 32: greedy identical on {same} of "
          f"{len(PROMPTS)} prompts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
