"""Generation as a stack of generators.

* step generators (one per decoding mode: :func:`~.steps.ar_steps`,
  :func:`~.speculative.ss_steps`, :func:`~.lookup.lookup_steps`) take prompt
  ids and yield a :class:`~.steps.Step` per target forward pass.
* :func:`stream_generate` adds prompt formatting, EOS / max-token stops,
  detokenization, timing and memory, and yields :class:`GenerationResponse`.
* :func:`generate` collects it into one :class:`GenerationResult`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Generator, Iterator, List, Optional, Sequence, Union

import mlx.core as mx

from ..io.limits import not_text
from ..method.tree import TreeSpec
from .autotune import AutoPolicy
from .bounded import TEMPLATE_SECONDS, PromptError, check_token_ids, guarded, time_limit
from .loaded_model import base_model
from .lookup import lookup_steps
from .sampling import SamplingParams
from .speculative import DEFAULT_TREE, SSOptions, ss_steps
from .steps import Step, StepInfo, ar_steps

MODES = ("ar", "ss", "lookup")


@dataclass
class GenerationStats:
    mode: str = "ar"
    prompt_tokens: int = 0
    generated_tokens: int = 0
    forward_passes: int = 0  # the prefill pass included
    tokens_per_pass: float = 0.0  # τ: per decoding pass, prefill left out (0 before the first one)
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


def make_steps(
    mode: str, model, ids: mx.array, sampling: SamplingParams, cache=None, ss: Optional[SSOptions] = None
) -> Iterator[Step]:
    """The step generator of a decoding mode; ``ss`` holds what only ``ss`` takes."""
    if mode == "ar":
        return ar_steps(base_model(model), ids, sampling, cache=cache)
    if mode == "ss":
        ss = ss or SSOptions()
        return ss_steps(
            model,
            ids,
            sampling,
            cache=cache,
            tree=ss.tree,
            pruning_threshold=ss.pruning_threshold,
            log=ss.log,
            policy=ss.policy,
        )
    if mode == "lookup":
        return lookup_steps(base_model(model), ids, sampling, cache=cache)
    raise ValueError(f"unknown mode {mode!r}; available: {', '.join(MODES)}")


def encode_prompt(
    tokenizer,
    prompt: Union[str, Sequence[int], List[Dict[str, str]]],
    use_chat_template: bool = True,
    max_chars: Optional[int] = None,
) -> List[int]:
    """Token ids for a string, a list of chat messages, or ids as given.

    The model's chat template runs under a time limit and the tokenizer's failures
    (native panics included) become one :class:`~.bounded.PromptError`; ``max_chars``
    bounds the rendered text before it is tokenized."""
    if isinstance(prompt, (list, tuple)) and (not prompt or isinstance(prompt[0], int)):
        return list(prompt)
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    for m in messages:
        why = isinstance(m.get("content"), str) and not_text(m["content"])
        if why:
            raise PromptError(f"the {m.get('role', 'message')}'s text is {why}")
    templated = use_chat_template and getattr(tokenizer, "chat_template", None)
    if templated:

        def render():
            with time_limit(TEMPLATE_SECONDS):
                return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

        from jinja2 import TemplateError  # the template's own refusal ("roles must alternate") stays one

        text = guarded(render, "the chat template", keep=(TemplateError,))
    elif isinstance(prompt, list):
        text = "\n".join(m["content"] for m in prompt)
    else:
        text = prompt
    if max_chars is not None and len(text) > max_chars:
        raise PromptError(f"the prompt renders to {len(text):,} characters, over the limit of {max_chars:,}")
    # With a template, the template writes BOS itself when the model wants one.
    kwargs = {"add_special_tokens": False} if templated else {}
    return list(guarded(lambda: tokenizer.encode(text, **kwargs), "the tokenizer"))


def stream_generate(
    model,
    tokenizer,
    prompt: Union[str, Sequence[int], List[Dict[str, str]]],
    max_tokens: int = 256,
    sampling: Optional[SamplingParams] = None,
    mode: str = "ar",
    use_chat_template: bool = True,
    cache=None,
    tree: Union[None, str, TreeSpec] = DEFAULT_TREE,
    pruning_threshold: Optional[float] = None,
    log: Optional[Callable[[str], None]] = None,
    policy: Optional[AutoPolicy] = None,
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
        tree: ss only: a :class:`TreeSpec` or its text form, or ``"auto"`` (the default, as in
            the CLI: measure and choose, plain decoding when no tree pays).
        pruning_threshold: ss only: early-exit pruning threshold; default the model's.
        log: ss only: where ``--tree auto`` says it has no stored pass costs for this model yet.
        policy: ss with ``tree="auto"``: the :class:`AutoPolicy` to decode with (servers
            pass each client's own); default the model's shared one.
    """
    sampling = sampling or SamplingParams()
    ids = encode_prompt(tokenizer, prompt, use_chat_template)
    if not ids:
        raise ValueError("empty prompt")
    check_token_ids(ids, base_model(model).args.vocab_size)
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
    stats = GenerationStats(mode=mode, prompt_tokens=len(ids))
    detok = tokenizer.detokenizer
    detok.reset()
    mx.reset_peak_memory()
    ss = SSOptions(tree, pruning_threshold, log, policy)
    steps = make_steps(mode, model, mx.array(ids, dtype=mx.int32), sampling, cache, ss)
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
            # τ (docs/DESIGN.md §5): tokens per decoding pass, the prefill pass and its
            # token left out, an EOS that ends the reply counted (a pass decided it).
            decided = stats.generated_tokens + (1 if finish == "stop" else 0) - first_tokens
            stats.tokens_per_pass = decided / (stats.forward_passes - 1) if stats.forward_passes > 1 else 0.0
            stats.peak_memory_gb = mx.get_peak_memory() / 1e9
            yield GenerationResponse(detok.last_segment, out, stats, finish, list(step.tokens))
            if finish is not None:
                return
    finally:
        close = getattr(steps, "close", None)
        if close:
            close()


# Added to the reason for plain decoding once a later pass of the request verifies a draft
# again (a reply seen copying its context, a periodic probe): "plain decoding" alone would
# then misstate the request.
RESUMED = "; drafts were verified again later in this request"


def _record_step_info(stats: GenerationStats, info: StepInfo) -> None:
    if info.accepted is not None:
        stats.accepted_histogram[info.accepted] = stats.accepted_histogram.get(info.accepted, 0) + 1
    stats.draft_nodes += info.nodes
    stats.pruned_nodes += info.pruned
    if info.tree:
        stats.tree = info.tree
    if info.fallback:
        stats.fallback = info.fallback
    elif info.nodes and stats.fallback and not stats.fallback.endswith(RESUMED):
        stats.fallback += RESUMED


def generate(
    model,
    tokenizer,
    prompt,
    max_tokens: int = 256,
    sampling: Optional[SamplingParams] = None,
    mode: str = "ar",
    use_chat_template: bool = True,
    cache=None,
    tree: Union[None, str, TreeSpec] = DEFAULT_TREE,
    pruning_threshold: Optional[float] = None,
    log: Optional[Callable[[str], None]] = None,
) -> GenerationResult:
    """Run :func:`stream_generate` (same arguments) to the end and collect the result."""
    text, tokens = [], []
    last = None
    for r in stream_generate(
        model,
        tokenizer,
        prompt,
        max_tokens,
        sampling,
        mode,
        use_chat_template,
        cache,
        tree=tree,
        pruning_threshold=pruning_threshold,
        log=log,
    ):
        text.append(r.text)
        tokens.extend(r.tokens)
        last = r
    ids = encode_prompt(tokenizer, prompt, use_chat_template)
    return GenerationResult(
        text="".join(text),
        tokens=tokens,
        prompt_tokens=ids,
        mode=mode,
        finish_reason=last.finish_reason or "length",
        stats=last.stats,
    )
