"""Interactive chat (`specstream-mlx chat`): streaming replies, multi-turn KV reuse.

Commands: /help, /reset, /stats, /mode ss|ar|lookup, /temp T, /quit. In a terminal the
line is edited with the standard ``readline`` (arrows, history). Ctrl-C stops the
current reply (its figures stay for /stats), not the program; at an empty prompt it
asks once before quitting (a second Ctrl-C, Ctrl-D or /quit ends the chat). When stdin
is not a terminal, no prompts or colours are printed, so the command can be driven
through a pipe. When the conversation outgrows the context, the oldest turns are
dropped (with a notice); a failing turn prints one line and the chat goes on.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional, TextIO

from ..io.limits import SEED_MAX, not_text
from ..runtime.generation import MODES
from ..runtime.sampling import SamplingParams
from ..runtime.session import ChatSession, ContextError, Reply

HELP = "commands: /help  /reset  /stats  /mode ss|ar|lookup  /temp T  /quit"
HELP_LONG = """/help             this list
/reset            forget the conversation (and its cached tokens)
/stats            the last reply's figures: tokens, tok/s, tokens per pass, cached tokens
/mode ss|ar|lookup  the decoding mode (ss: Speculative Streaming, when the model has streams)
/temp T           the sampling temperature (0: greedy)
/quit, /exit      end the chat (also Ctrl-D, or Ctrl-C twice at an empty prompt)
Ctrl-C during a reply stops it."""
# Why ss might not pay, and what would help: said once per chat, when it falls back.
SS_HINT = (
    "streams that accept more draft tokens (`specstream-mlx train`) or a cheaper tree pass "
    "on this machine would make ss pay; `specstream-mlx bench` measures both"
)


@dataclass
class ChatOptions:
    """Settings of a chat; ``mode`` and ``temp`` change with /mode and /temp.

    ``seed``: sampling seed of the first reply (the n-th uses seed + n); None: from the clock."""

    mode: str = "ar"
    temp: float = 0.0
    max_tokens: int = 512
    system: Optional[str] = None
    tree: str = "auto"
    top_p: float = 1.0
    max_context: int = 4096
    seed: Optional[int] = None


class _Chat:
    def __init__(self, model, tokenizer, opts: ChatOptions, stdin: TextIO, stdout: TextIO, stderr: TextIO):
        self.model, self.opts = model, opts
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.interactive = stdin.isatty() and stdout.isatty()
        self.session = ChatSession(model, tokenizer, opts.system)
        self.last: Optional[Reply] = None
        self.turns = 0
        self.told_fallback = False

    def dim(self, s: str) -> str:
        return f"\033[2m{s}\033[0m" if self.interactive else s

    def command(self, text: str) -> bool:
        """Run a /command; False when the chat should end."""
        cmd, _, arg = text.strip().partition(" ")
        arg = arg.strip()
        out, err = self.stdout, self.stderr
        if cmd in ("/quit", "/exit", "/bye"):
            return False
        if cmd in ("/help", "/?"):
            print(self.dim(HELP_LONG), file=out)
        elif cmd == "/reset":
            self.session.reset()
            print(self.dim("[conversation reset]"), file=out)
        elif cmd == "/stats":
            print(self.dim(_stats_line(self.last) if self.last else "[no reply yet]"), file=out)
        elif cmd == "/mode":
            if arg not in MODES:
                print(f"[usage: /mode {'|'.join(MODES)}]", file=err)
            elif arg == "ss" and self.model.streams is None:
                print("[this model has no speculative streams; ss is unavailable]", file=err)
            else:
                self.opts.mode = arg
                print(self.dim(f"[mode {arg}]"), file=out)
        elif cmd == "/temp":
            try:
                # Validate before assigning: a bad value must not outlive the usage message.
                SamplingParams(temperature=float(arg), top_p=self.opts.top_p)
                self.opts.temp = float(arg)
                print(self.dim(f"[temperature {self.opts.temp}]"), file=out)
            except ValueError:
                print("[usage: /temp T with T >= 0]", file=err)
        else:
            print(f"[unknown command {cmd}; {HELP}]", file=err)
        return True

    def turn(self, text: str) -> None:
        o = self.opts
        seed = (o.seed + self.turns) % (SEED_MAX + 1) if o.seed is not None else time.time_ns() % 2**31
        self.turns += 1
        sampling = SamplingParams(temperature=o.temp, top_p=o.top_p, seed=seed)
        cancel = threading.Event()
        gen = self.session.say(
            text,
            max_tokens=o.max_tokens,
            sampling=sampling,
            mode=o.mode,
            tree=o.tree,
            max_context=o.max_context,
            cancel=cancel,
        )
        # Ctrl-C during a reply sets the cancel flag: the reply ends at its next token with
        # its text and figures (for /stats), instead of an exception inside the model code.
        on_main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, lambda *_: cancel.set()) if on_main else None
        try:
            while True:
                self.stdout.write(next(gen))
                self.stdout.flush()
        except StopIteration as stop:
            self.last = stop.value
        except KeyboardInterrupt:  # not on the main thread: no handler was installed
            gen.close()
            self.last = None
        except ContextError as e:
            self.last = None
            print(f"[{e}]", file=self.stderr)
            return
        except Exception as e:  # one failed turn must not end the chat
            self.last = None
            print(f"[error: {type(e).__name__}: {e}]", file=self.stderr)
            return
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
        last = self.last
        if last is None or last.finish_reason == "cancelled":
            self.stdout.write(self.dim(" [stopped]"))
        self.stdout.write("\n")
        if last is not None and last.dropped_turns:
            print(
                self.dim(
                    f"[dropped the {last.dropped_turns} oldest turn(s) to fit the context of {o.max_context} tokens]"
                ),
                file=self.stderr,
            )
        if last is not None and last.stats is not None:
            print(self.dim(_stats_line(last)), file=self.stdout if self.interactive else self.stderr)
            if last.stats.fallback and not self.told_fallback:
                self.told_fallback = True
                print(self.dim(f"[ss is not paying here: {last.stats.fallback}; {SS_HINT}]"), file=self.stderr)
        self.stdout.flush()

    def read(self) -> Optional[str]:
        """The next line (None at EOF); in a terminal through ``readline``'s line editing."""
        if not self.interactive:
            line = self.stdin.readline()
            return line.rstrip("\n") if line else None
        try:
            return input("\n> ")
        except EOFError:
            self.stdout.write("\n")
            return None


def run_chat(
    model,
    tokenizer,
    opts: ChatOptions,
    stdin: TextIO = sys.stdin,
    stdout: TextIO = sys.stdout,
    stderr: TextIO = sys.stderr,
) -> int:
    chat = _Chat(model, tokenizer, opts, stdin, stdout, stderr)
    if chat.interactive:
        import readline  # noqa: F401  (line editing and history for input())

        print(chat.dim(f"specstream-mlx chat — mode {opts.mode}, temperature {opts.temp}. {HELP}"), file=stdout)
    if not getattr(tokenizer, "chat_template", None):
        print(
            chat.dim("[warning: this model has no chat template: each turn is sent as plain text, unformatted]"),
            file=stderr,
        )
    asked = False  # Ctrl-C once at an empty prompt asks; twice in a row quits
    while True:
        try:
            text = chat.read()
        except KeyboardInterrupt:
            if asked:
                stdout.write("\n")
                return 0
            asked = True
            print(chat.dim("\n[Ctrl-C again, Ctrl-D or /quit to end the chat]"), file=stdout)
            continue
        asked = False
        if text is None:
            return 0
        if not text.strip():
            continue
        why = not_text(text)
        if why:  # bytes that are not UTF-8 (pasted or piped): nothing a tokenizer could take
            print(f"[not sent: the line is {why}]", file=stderr)
            continue
        if text.startswith("/"):
            if not chat.command(text):
                return 0
            continue
        chat.turn(text)


def _stats_line(r: Reply) -> str:
    s = r.stats
    return (
        f"[{s.mode}] {s.generated_tokens} tokens, {s.tokens_per_second:.1f} tok/s, "
        f"τ {s.tokens_per_pass:.2f}, reused {r.reused_tokens} cached tokens, {r.finish_reason}"
    )
