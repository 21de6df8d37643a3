"""Interactive chat (`specstream-mlx chat`): streaming replies, multi-turn KV reuse.

Commands: /reset, /stats, /mode ss|ar|lookup, /temp T, /quit. Ctrl-C stops the
current reply, not the program. When stdin is not a terminal, no prompts or
colours are printed, so the command can be driven through a pipe. When the
conversation outgrows the context, the oldest turns are dropped (with a
notice); a failing turn prints one line and the chat goes on.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Optional, TextIO

from ..runtime.generation import MODES
from ..runtime.sampling import SamplingParams
from ..runtime.session import ChatSession, ContextError, Reply

HELP = "commands: /reset  /stats  /mode ss|ar|lookup  /temp T  /quit"


@dataclass
class ChatOptions:
    """Settings of a chat; ``mode`` and ``temp`` change with /mode and /temp."""

    mode: str = "ar"
    temp: float = 0.0
    max_tokens: int = 512
    system: Optional[str] = None
    tree: str = "auto"
    top_p: float = 1.0
    max_context: int = 4096


class _Chat:
    def __init__(self, model, tokenizer, opts: ChatOptions, stdin: TextIO, stdout: TextIO, stderr: TextIO):
        self.model, self.opts = model, opts
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.interactive = stdin.isatty() and stdout.isatty()
        self.session = ChatSession(model, tokenizer, opts.system)
        self.last: Optional[Reply] = None

    def dim(self, s: str) -> str:
        return f"\033[2m{s}\033[0m" if self.interactive else s

    def command(self, text: str) -> bool:
        """Run a /command; False when the chat should end."""
        cmd, _, arg = text.strip().partition(" ")
        arg = arg.strip()
        out, err = self.stdout, self.stderr
        if cmd in ("/quit", "/exit"):
            return False
        if cmd == "/reset":
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
        sampling = SamplingParams(temperature=o.temp, top_p=o.top_p, seed=time.time_ns() % 2**31)
        gen = self.session.say(
            text, max_tokens=o.max_tokens, sampling=sampling, mode=o.mode, tree=o.tree, max_context=o.max_context
        )
        try:
            while True:
                self.stdout.write(next(gen))
                self.stdout.flush()
        except StopIteration as stop:
            self.last = stop.value
        except KeyboardInterrupt:
            gen.close()
            self.last = None
            self.stdout.write(self.dim(" [stopped]"))
        except ContextError as e:
            self.last = None
            print(f"[{e}]", file=self.stderr)
            return
        except Exception as e:  # one failed turn must not end the chat
            self.last = None
            print(f"[error: {type(e).__name__}: {e}]", file=self.stderr)
            return
        self.stdout.write("\n")
        last = self.last
        if last is not None and last.dropped_turns:
            print(
                self.dim(
                    f"[dropped the {last.dropped_turns} oldest turn(s) to fit the context of {o.max_context} tokens]"
                ),
                file=self.stderr,
            )
        if last is not None and last.stats is not None:
            print(self.dim(_stats_line(last)), file=self.stdout if self.interactive else self.stderr)
        self.stdout.flush()


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
        print(chat.dim(f"specstream-mlx chat — mode {opts.mode}, temperature {opts.temp}. {HELP}"), file=stdout)
    while True:
        if chat.interactive:
            stdout.write("\n> ")
            stdout.flush()
        try:
            line = stdin.readline()
        except KeyboardInterrupt:
            stdout.write("\n")
            return 0
        if not line:
            return 0
        text = line.rstrip("\n")
        if not text.strip():
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
