"""A multi-turn chat session with KV-cache reuse, shared by `chat` and `serve`.

The cache holds the keys/values of ``seq[:offset]``. A new turn renders the
whole conversation with the chat template, keeps the longest cached prefix
that matches it, trims the rest, and prefills only the new suffix: history
is not re-prefilled each turn.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Dict, Generator, List, Optional, Sequence, Union

from ..method.tree import TreeSpec
from .autotune import AutoPolicy
from .cache import make_cache, trim_cache
from .generation import GenerationStats, encode_prompt, stream_generate
from .sampling import SamplingParams
from .speculative import DEFAULT_TREE


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ContextError(ValueError):
    """A message that does not fit the context even with all earlier turns dropped."""


@dataclass
class Reply:
    text: str = ""
    tokens: List[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stats: Optional[GenerationStats] = None
    reused_tokens: int = 0
    dropped_turns: int = 0


class StopStrings:
    """Cuts streamed text at the first stop string, holding back a possible prefix of one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.text = ""
        self.emitted = 0
        self.hit = False

    def feed(self, delta: str) -> str:
        """New text that is safe to emit."""
        self.text += delta
        if not self.stops:
            out, self.emitted = self.text[self.emitted :], len(self.text)
            return out
        cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit = True
            self.text = self.text[:cut]
            out, self.emitted = self.text[self.emitted :], len(self.text)
            return out
        hold = max((len(s) - 1 for s in self.stops), default=0)
        safe = max(self.emitted, len(self.text) - hold)
        out, self.emitted = self.text[self.emitted : safe], safe
        return out

    def flush(self) -> str:
        out, self.emitted = self.text[self.emitted :], len(self.text)
        return out


class ChatSession:
    """Conversation state: messages, the KV cache and the tokens it holds."""

    def __init__(self, model, tokenizer, system: Optional[str] = None):
        self.model = model
        self.tokenizer = tokenizer
        self.system = system
        self.reset()

    def reset(self) -> None:
        self.messages: List[Dict[str, str]] = []
        if self.system:
            self.messages.append({"role": "system", "content": self.system})
        self.cache = make_cache(self.model)
        self.seq: List[int] = []

    def _prepare(self, ids: List[int]) -> List[int]:
        """Trim the cache to the longest reusable prefix; return the tokens to feed."""
        offset = self.cache[0].offset
        keep = common_prefix(self.seq[:offset], ids)
        keep = min(keep, len(ids) - 1)  # at least one token must be fed
        trim_cache(self.cache, offset - keep)
        self.seq = list(ids)
        return ids[keep:]

    def stream(self, messages: List[Dict[str, str]], **kw) -> Generator[str, None, Reply]:
        """Generate the assistant's answer to ``messages`` (chat template applied);
        same arguments and behaviour as :meth:`stream_ids`."""
        ids = encode_prompt(self.tokenizer, messages, use_chat_template=True)
        return (yield from self.stream_ids(ids, **kw))

    def stream_ids(
        self,
        ids: List[int],
        max_tokens: int = 512,
        sampling: Optional[SamplingParams] = None,
        mode: str = "ar",
        stop: Sequence[str] = (),
        cancel: Optional[threading.Event] = None,
        reply: Optional[Reply] = None,
        tree: Union[None, str, TreeSpec] = DEFAULT_TREE,
        policy: Optional[AutoPolicy] = None,
    ) -> Generator[str, None, Reply]:
        """Stream the reply to token ids ``ids``, yielding text deltas.

        Stops on EOS, ``max_tokens``, a stop string, or when ``cancel`` is set
        (``finish_reason`` "cancelled"). ``tree`` is the ss draft tree (default
        ``auto``); ``policy`` is the ``auto`` policy to use (a server's per-client one). Returns the :class:`Reply`."""
        if not ids:
            raise ValueError("empty prompt")
        reply = reply if reply is not None else Reply()
        feed = self._prepare(list(ids))
        reply.reused_tokens = len(ids) - len(feed)
        stops = StopStrings(stop)
        gen = stream_generate(
            self.model,
            self.tokenizer,
            feed,
            max_tokens=max_tokens,
            sampling=sampling,
            mode=mode,
            use_chat_template=False,
            cache=self.cache,
            tree=tree if mode == "ss" else None,
            policy=policy,
        )
        try:
            for r in gen:
                self.seq.extend(r.step_tokens)
                reply.tokens.extend(r.tokens)
                reply.stats = r.stats
                delta = stops.feed(r.text)
                if delta:
                    reply.text += delta
                    yield delta
                if stops.hit:
                    reply.finish_reason = "stop"
                    break
                if r.finish_reason:
                    reply.finish_reason = r.finish_reason
                    break
                if cancel is not None and cancel.is_set():
                    reply.finish_reason = "cancelled"
                    break
        finally:
            gen.close()
            if reply.finish_reason is None:
                reply.finish_reason = "cancelled"
            tail = stops.flush() if not stops.hit else ""
            if tail:
                reply.text += tail
        if tail:
            yield tail
        return reply

    def say(
        self, user_text: str, max_tokens: int = 512, max_context: Optional[int] = None, **kw
    ) -> Generator[str, None, Reply]:
        """One chat turn: append the user message, stream the reply, record it.

        With ``max_context``, the oldest turns are dropped until the rendered
        conversation plus ``max_tokens`` fits (the reply is then capped by what
        is left); a message too long on its own raises :class:`ContextError`
        and is not kept."""
        self.messages.append({"role": "user", "content": user_text})
        reply = Reply()
        if max_context is not None:
            try:
                reply.dropped_turns, max_tokens = self._fit(max_tokens, max_context)
            except ContextError:
                self.messages.pop()
                raise
        try:
            yield from self.stream(list(self.messages), reply=reply, max_tokens=max_tokens, **kw)
        finally:
            self.messages.append({"role": "assistant", "content": reply.text})
        return reply

    def _fit(self, max_tokens: int, max_context: int) -> "tuple[int, int]":
        """Drop the oldest (user, assistant) turns until the prompt leaves room for
        the reply; returns (turns dropped, max_tokens capped to what is left)."""
        first = 1 if self.system else 0
        dropped = 0
        while True:
            n = len(encode_prompt(self.tokenizer, self.messages, use_chat_template=True))
            if n + max_tokens <= max_context or len(self.messages) - first <= 1:
                break
            del self.messages[first : first + 2]  # the oldest user message and its reply
            dropped += 1
        if n >= max_context:
            raise ContextError(f"the message has {n} tokens with the system prompt; the context is {max_context}")
        return dropped, min(max_tokens, max_context - n)
