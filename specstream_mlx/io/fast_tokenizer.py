"""A model directory's tokenizer read with the ``tokenizers`` library alone.

Loading through mlx-lm costs seconds before the first token: it imports transformers
(which imports PyTorch where it is installed) to wrap a ``tokenizer.json`` that the
``tokenizers`` package reads directly in milliseconds. :class:`FastTokenizer` is that
direct path for the directories it can serve exactly — a ``tokenizer.json`` whose
tokenizer class does not rewrite it at load time — and offers what the runtime uses:
``encode``/``decode``, the chat template rendered as transformers renders it (the same
sandbox, filters and globals), the EOS ids, and a streaming detokenizer. Every other
directory goes through mlx-lm (:func:`specstream_mlx.io.loading.load_tokenizer`).
tests/test_fast_tokenizer.py holds it equal to transformers on every tokenizer the
repository builds or ships.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set

# Tokenizer classes that take tokenizer.json as it is. Others (LlamaTokenizerFast, Gemma...)
# rebuild its post-processor from add_bos_token/add_eos_token, or add a prefix space: those
# load through transformers.
AS_STORED = {None, "PreTrainedTokenizerFast", "TokenizersBackend", "GPT2Tokenizer", "GPT2TokenizerFast"}
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _token_text(v: Any) -> Optional[str]:
    if isinstance(v, dict):  # {"content": "<s>", "__type": "AddedToken", ...}
        v = v.get("content")
    return v if isinstance(v, str) else None


def chat_template_of(path: Path, tok_config: Dict[str, Any]) -> Optional[str]:
    """The chat template as transformers finds it: chat_template.jinja, chat_template.json,
    then tokenizer_config.json (a list of named templates: the one named "default")."""
    path = Path(path)
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    if (path / "chat_template.json").is_file():
        t = json.loads((path / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
    else:
        t = tok_config.get("chat_template")
    if isinstance(t, list):
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        t = named.get("default")
    return t if isinstance(t, str) else None


def can_serve(path: Path, tok_config: Dict[str, Any]) -> bool:
    """Whether :class:`FastTokenizer` reproduces transformers' tokenizer for this directory."""
    if not (Path(path) / "tokenizer.json").is_file():
        return False
    if tok_config.get("tokenizer_class") not in AS_STORED:
        return False
    # Settings transformers applies on top of tokenizer.json.
    return not any(tok_config.get(k) for k in ("add_prefix_space", "chat_template_type", "auto_map"))


def _compile(template: str):
    """The template in transformers' environment: an immutable sandbox, trim/lstrip blocks,
    loop controls, its ``tojson``, ``raise_exception`` and ``strftime_now``."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # {% generation %}...{% endgeneration %}: rendered as its body
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _clean_up_spaces(text: str) -> str:
    """transformers' ``clean_up_tokenization``: no space before punctuation and contractions."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't")):
        text = text.replace(a, b)
    for a, b in ((" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


class StreamingDetokenizer:
    """Text of a growing token sequence, piece by piece, never splitting a character: each
    token's text is the decoding of a short window that starts a token earlier (so a
    tokenizer that drops a leading space at the start of a decode keeps it), and is held
    back while it ends in an incomplete UTF-8 sequence. As mlx-lm's detokenizers,
    :attr:`last_segment` is the text added since it was last read (a pass may add several
    tokens)."""

    def __init__(self, tokenizer: "FastTokenizer"):
        self._tok = tokenizer
        self.reset()

    def reset(self) -> None:
        self.tokens: List[int] = []
        self.text = ""
        self._shown = 0  # characters of self.text already returned by last_segment
        self._prefix = 0  # window start
        self._read = 0  # tokens before this are in self.text

    @property
    def last_segment(self) -> str:
        segment = self.text[self._shown :]
        self._shown = len(self.text)
        return segment

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        prefix_text = self._tok.decode(self.tokens[self._prefix : self._read])
        new_text = self._tok.decode(self.tokens[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self.tokens)

    def finalize(self) -> None:
        prefix_text = self._tok.decode(self.tokens[self._prefix : self._read])
        self.text += self._tok.decode(self.tokens[self._prefix :])[len(prefix_text) :]
        self._prefix = self._read = len(self.tokens)


class FastTokenizer:
    """What the runtime needs of a tokenizer, on ``tokenizers`` alone (see the module)."""

    def __init__(self, path: Path, tok_config: Dict[str, Any], eos_token_ids: Optional[Sequence[int]] = None):
        from tokenizers import Tokenizer

        self.path = Path(path)
        self._tk = Tokenizer.from_file(str(self.path / "tokenizer.json"))
        self._tk.no_truncation()
        self._tk.no_padding()
        self.init_kwargs = tok_config
        self.special_tokens = {k: _token_text(tok_config.get(k)) for k in SPECIAL_KEYS}
        self.chat_template = chat_template_of(self.path, tok_config)
        self._template = None
        self._clean_up = bool(tok_config.get("clean_up_tokenization_spaces", False))
        self.eos_token = self.special_tokens["eos_token"]
        self.bos_token = self.special_tokens["bos_token"]
        self.eos_token_id = self._tk.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_token_id = self._tk.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_ids: Set[int] = set(eos_token_ids or [])
        if self.eos_token_id is not None:
            self.eos_token_ids.add(self.eos_token_id)

    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text = self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self._clean_up else text

    def convert_ids_to_tokens(self, ids):
        return [self._tk.id_to_token(i) for i in ids] if isinstance(ids, (list, tuple)) else self._tk.id_to_token(ids)

    @property
    def detokenizer(self) -> StreamingDetokenizer:
        return StreamingDetokenizer(self)

    def apply_chat_template(
        self,
        messages: List[Dict[str, Any]],
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        tools: Optional[List[dict]] = None,
        **kwargs,
    ):
        """The conversation through the chat template, as transformers renders it."""
        if self.chat_template is None:
            raise ValueError(f"{self.path}: the tokenizer has no chat template")
        if self._template is None:
            self._template = _compile(self.chat_template)
        context = {k: v for k, v in self.special_tokens.items() if v is not None}
        context.update(kwargs)
        text = self._template.render(
            messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **context
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text
