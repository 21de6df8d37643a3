"""A byte-level tokenizer written as a standard Hugging Face tokenizer directory.

Needs no download and covers any text, so tests and the self-built demo model
have a real ``tokenizer.json`` that mlx-lm's TokenizerWrapper loads as usual.
Ids: 0 <pad>, 1 <s>, 2 </s>, then the 256 byte symbols of GPT-2's byte alphabet.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL = ["<pad>", "<s>", "</s>"]
VOCAB_SIZE = len(SPECIAL) + 256

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>\n' + m['content'] + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def save_byte_tokenizer(out_dir: Path, chat_template: bool = True) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def train_bpe_tokenizer(texts, vocab_size: int, out_dir: Path, chat_template: bool = True) -> None:
    """A byte-level BPE tokenizer trained on ``texts`` (an iterable of strings),
    saved as a standard Hugging Face tokenizer directory (same special tokens and
    chat template as :func:`save_byte_tokenizer`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
