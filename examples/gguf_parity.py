"""A GGUF file you hold, imported on the float path, against transformers' own GGUF loader.

    python examples/gguf_parity.py --gguf model.gguf [--prompt "..."] [--tokens 32]

Prints the tokenizer's agreement on a fixed set of texts and on the chat prompt, the largest
logit difference on the prompt (relative to the largest logit), and whether 32 greedy tokens
agree. The import runs with ``--dtype float32`` (the dequantized weights transformers reads);
a quantized import is measured by ``specstream-mlx bench`` instead.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

TEXTS = [
    "Hello world",
    "  leading spaces and   runs of spaces  ",
    "It's 2024: 12345 apples cost $67.89 (not 1,000.5)!",
    "café naïve über — “quotes”, [brackets] and {braces}; ok?",
    "東京 北京 привет мир 🙂🚀 emoji",
    "def f(x):\n\treturn x * 2\n\n",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True, type=Path)
    ap.add_argument("--prompt", default="Write one sentence about the sea.")
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specstream_mlx.convert import ConvertOptions, convert_gguf
    from specstream_mlx.io.loading import load_model_dir
    from specstream_mlx.runtime.sampling import SamplingParams
    from specstream_mlx.runtime.steps import ar_steps

    src = args.gguf.resolve()
    with tempfile.TemporaryDirectory() as d:
        dst = convert_gguf(str(src), str(Path(d) / "mlx"), ConvertOptions(dtype="float32"))
        ours = load_model_dir(str(dst))
        hf_tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        hf = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32).eval()

        same = sum(ours.tokenizer.encode(t) == hf_tok.encode(t) for t in TEXTS)
        print(f"tokenizer: {same}/{len(TEXTS)} texts encode as transformers encodes them")
        msgs = [{"role": "user", "content": args.prompt}]
        if hf_tok.chat_template is None:  # a base model: the prompt as it is
            prompt, special = args.prompt, True
            print("chat template: none in the file")
        else:
            prompt, special = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False), False
            mine = ours.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            print(f"chat template: {'same' if prompt == mine else 'DIFFERS'}")
        ids = hf_tok.encode(prompt, add_special_tokens=special)
        same_ids = ids == ours.tokenizer.encode(prompt, add_special_tokens=special)
        print(f"prompt: {len(ids)} tokens, ids {'same' if same_ids else 'DIFFER'}")
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].numpy()
            hf_out = hf.generate(
                torch.tensor([ids]), max_new_tokens=args.tokens, do_sample=False, min_new_tokens=args.tokens
            )[0, len(ids) :].tolist()
        got = np.array(ours.model(mx.array([ids]))[0])
        rel = np.abs(ref - got).max() / np.abs(ref).max()
        print(f"logits: max |difference| {np.abs(ref - got).max():.3g}, relative {rel:.2e}")
        steps = ar_steps(ours.model, mx.array(ids), SamplingParams())
        mine = [next(steps).tokens[0] for _ in range(args.tokens)]
        agree = next((i for i, (a, b) in enumerate(zip(mine, hf_out)) if a != b), len(mine))
        print(f"greedy: {agree}/{args.tokens} tokens agree before the first difference")
        print(f"text: {ours.tokenizer.decode(mine)!r}")


if __name__ == "__main__":
    main()
