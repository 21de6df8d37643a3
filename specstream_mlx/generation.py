"""Generation as a stack of generators.

* ``*_steps`` generators (one per decoding mode) take prompt ids and yield a
  :class:`Step` per target forward pass: the tokens it produced.
* :func:`stream_generate` adds prompt formatting, EOS / max-token stops,
  detokenization, timing and memory, and yields :class:`GenerationResponse`.
* :func:`generate` collects it into one :class:`GenerationResult`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Generator, Iterable, List, Optional, Sequence, Union

import mlx.core as mx

from .cache import make_cache
from .sampling import KeyStream, SamplingParams, sample_token

MODES = ("ar", "ss", "lookup")


@dataclass
class Step:
    """What one target forward pass produced."""

    tokens: List[int]
    # Extra, mode-specific facts about the step (accepted length, pruned nodes...).
    info: Dict[str, Any] = field(default_factory=dict)


@dataclass
class GenerationStats:
    mode: str = "ar"
    prompt_tokens: int = 0
    generated_tokens: int = 0
    forward_passes: int = 0
    tokens_per_pass: float = 0.0
    tokens_per_second: float = 0.0
    prompt_seconds: float = 0.0
    generation_seconds: float = 0.0
    peak_memory_gb: float = 0.0
    # Speculative modes: accepted draft tokens per pass -> number of passes.
    accepted_histogram: Dict[int, int] = field(default_factory=dict)
    draft_nodes: int = 0
    pruned_nodes: int = 0
    tree: Optional[str] = None
    fallback: Optional[str] = None

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


@dataclass
class GenerationResponse:
    """One streamed chunk: the new text and tokens of a step, and running stats."""

    text: str
    tokens: List[int]
    stats: GenerationStats
    finish_reason: Optional[str] = None  # "stop" (EOS), "length", or None while running
    # Every token the pass decided, before EOS/max-token truncation: the tokens
    # whose keys and values may now be in the cache (for multi-turn reuse).
    step_tokens: List[int] = field(default_factory=list)


@dataclass
class GenerationResult:
    text: str
    tokens: List[int]
    prompt_tokens: List[int]
    mode: str
    finish_reason: str
    stats: GenerationStats

    def to_dict(self) -> Dict[str, Any]:
        return {
            "text": self.text,
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "mode": self.mode,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }


def prefill(model, prompt: mx.array, cache, chunk: int = 512) -> None:
    """Run all of ``prompt`` (1-D ids) through the model into ``cache``, in chunks."""
    for start in range(0, prompt.shape[0], chunk):
        model(prompt[start : start + chunk][None], cache=cache)
        mx.eval([c.keys for c in cache])


def ar_steps(
    model,
    prompt: mx.array,
    sampling: SamplingParams,
    cache=None,
    prefill_chunk: int = 512,
) -> Generator[Step, None, None]:
    """Plain autoregressive decoding; one token per forward pass.

    The next pass is queued (``mx.async_eval``) before the current token is
    handed out, so Python work overlaps the model's compute.
    """
    cache = cache if cache is not None else make_cache(model)
    keys = KeyStream(sampling.seed)
    prefill(model, prompt[:-1], cache, prefill_chunk)

    def forward(tok: mx.array) -> mx.array:
        logits = model(tok.reshape(1, -1), cache=cache)[:, -1, :]
        return sample_token(logits, sampling, None if sampling.greedy else keys.next())

    y = forward(prompt[-1:])
    mx.async_eval(y)
    while True:
        next_y = forward(y)
        mx.async_eval(next_y)
        yield Step([y.item()])
        y = next_y


StepFn = Callable[..., Iterable[Step]]


def get_step_fn(mode: str) -> StepFn:
    if mode == "ar":
        return ar_steps
    if mode == "ss":
        from .speculative import ss_steps

        return ss_steps
    if mode == "lookup":
        from .speculative import lookup_steps

        return lookup_steps
    raise ValueError(f"unknown mode {mode!r}; available: {', '.join(MODES)}")


def encode_prompt(
    tokenizer, prompt: Union[str, Sequence[int], List[Dict[str, str]]], use_chat_template: bool = True
) -> List[int]:
    """Token ids for a string, a list of chat messages, or ids as given."""
    if isinstance(prompt, (list, tuple)) and (not prompt or isinstance(prompt[0], int)):
        return list(prompt)
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # The template writes BOS itself when the model wants one.
        return list(tokenizer.encode(text, add_special_tokens=False))
    if isinstance(prompt, list):
        text = "\n".join(m["content"] for m in prompt)
    else:
        text = prompt
    return list(tokenizer.encode(text))


def stream_generate(
    model,
    tokenizer,
    prompt: Union[str, Sequence[int], List[Dict[str, str]]],
    max_tokens: int = 256,
    sampling: Optional[SamplingParams] = None,
    mode: str = "ar",
    use_chat_template: bool = True,
    cache=None,
    **mode_kwargs,
) -> Generator[GenerationResponse, None, None]:
    """Stream a completion of ``prompt``; yields one response per forward pass.

    Args:
        model, tokenizer: from :func:`specstream_mlx.load`.
        prompt: text, chat messages, or token ids.
        max_tokens: most tokens to generate. Default 256.
        sampling: :class:`SamplingParams`; default greedy.
        mode: decoding mode (``ar``).
        use_chat_template: wrap text in the tokenizer's chat template if it has one.
        cache: an existing KV cache to continue (multi-turn); default fresh.
    """
    sampling = sampling or SamplingParams()
    ids = encode_prompt(tokenizer, prompt, use_chat_template)
    if not ids:
        raise ValueError("empty prompt")
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
    stats = GenerationStats(mode=mode, prompt_tokens=len(ids))
    detok = tokenizer.detokenizer
    detok.reset()
    mx.reset_peak_memory()
    steps = get_step_fn(mode)(model, mx.array(ids, dtype=mx.int32), sampling, cache=cache, **mode_kwargs)
    tic = time.perf_counter()
    gen_start = None
    first_tokens = 0
    finish = None
    try:
        for step in steps:
            now = time.perf_counter()
            if gen_start is None:
                stats.prompt_seconds = now - tic
                gen_start = now
            stats.forward_passes += 1
            _record_step_info(stats, step.info)
            out: List[int] = []
            for t in step.tokens:
                if t in eos:
                    finish = "stop"
                    break
                out.append(t)
                detok.add_token(t)
                if stats.generated_tokens + len(out) >= max_tokens:
                    finish = "length"
                    break
            stats.generated_tokens += len(out)
            if finish is not None:
                detok.finalize()
            elapsed = time.perf_counter() - gen_start
            stats.generation_seconds = elapsed
            # The first step's tokens arrive with the prefill (time to first
            # token); the decoding rate counts the tokens after them.
            if stats.forward_passes == 1:
                first_tokens = stats.generated_tokens
            elif elapsed > 0:
                stats.tokens_per_second = (stats.generated_tokens - first_tokens) / elapsed
            # τ counts every token a pass decided, including an EOS that ends the reply.
            decided = stats.generated_tokens + (1 if finish == "stop" else 0)
            stats.tokens_per_pass = decided / stats.forward_passes
            stats.peak_memory_gb = mx.get_peak_memory() / 1e9
            yield GenerationResponse(detok.last_segment, out, stats, finish, list(step.tokens))
            if finish is not None:
                return
    finally:
        close = getattr(steps, "close", None)
        if close:
            close()


def _record_step_info(stats: GenerationStats, info: Dict[str, Any]) -> None:
    if not info:
        return
    if "accepted" in info:
        a = int(info["accepted"])
        stats.accepted_histogram[a] = stats.accepted_histogram.get(a, 0) + 1
    stats.draft_nodes += int(info.get("nodes", 0))
    stats.pruned_nodes += int(info.get("pruned", 0))
    if info.get("tree"):
        stats.tree = info["tree"]
    if info.get("fallback"):
        stats.fallback = info["fallback"]


def generate(model, tokenizer, prompt, max_tokens: int = 256, sampling=None, mode="ar", **kw) -> GenerationResult:
    """Run :func:`stream_generate` to the end and collect the result."""
    text, tokens = [], []
    last = None
    for r in stream_generate(model, tokenizer, prompt, max_tokens, sampling, mode, **kw):
        text.append(r.text)
        tokens.extend(r.tokens)
        last = r
    ids = encode_prompt(tokenizer, prompt, kw.get("use_chat_template", True))
    return GenerationResult(
        text="".join(text),
        tokens=tokens,
        prompt_tokens=ids,
        mode=mode,
        finish_reason=last.finish_reason or "length",
        stats=last.stats,
    )
