"""Interactive chat (`specstream-mlx chat`): streaming replies, multi-turn KV reuse.

Commands: /reset, /stats, /mode ss|ar|lookup, /temp T, /quit. Ctrl-C stops the
current reply, not the program. When stdin is not a terminal, no prompts or
colours are printed, so the command can be driven through a pipe.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

from ..runtime.generation import MODES
from ..runtime.sampling import SamplingParams
from ..runtime.session import ChatSession, Reply

HELP = "commands: /reset  /stats  /mode ss|ar|lookup  /temp T  /quit"


def run_chat(
    model,
    tokenizer,
    mode: str,
    temp: float,
    max_tokens: int,
    system: Optional[str] = None,
    tree="auto",
    stdin: TextIO = sys.stdin,
    stdout: TextIO = sys.stdout,
    stderr: TextIO = sys.stderr,
) -> int:
    interactive = stdin.isatty() and stdout.isatty()
    dim = (lambda s: f"\033[2m{s}\033[0m") if interactive else (lambda s: s)
    session = ChatSession(model, tokenizer, system)
    last: Optional[Reply] = None
    if interactive:
        print(dim(f"specstream-mlx chat — mode {mode}, temperature {temp}. {HELP}"), file=stdout)
    while True:
        if interactive:
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
            cmd, _, arg = text.strip().partition(" ")
            arg = arg.strip()
            if cmd in ("/quit", "/exit"):
                return 0
            if cmd == "/reset":
                session.reset()
                print(dim("[conversation reset]"), file=stdout)
            elif cmd == "/stats":
                print(dim(_stats_line(last) if last else "[no reply yet]"), file=stdout)
            elif cmd == "/mode":
                if arg not in MODES:
                    print(f"[usage: /mode {'|'.join(MODES)}]", file=stderr)
                elif arg == "ss" and model.streams is None:
                    print("[this model has no speculative streams; ss is unavailable]", file=stderr)
                else:
                    mode = arg
                    print(dim(f"[mode {mode}]"), file=stdout)
            elif cmd == "/temp":
                try:
                    # Validate before assigning: a bad value must not outlive the usage message.
                    SamplingParams(temperature=float(arg))
                    temp = float(arg)
                    print(dim(f"[temperature {temp}]"), file=stdout)
                except ValueError:
                    print("[usage: /temp T with T >= 0]", file=stderr)
            else:
                print(f"[unknown command {cmd}; {HELP}]", file=stderr)
            continue
        sampling = SamplingParams(temperature=temp, seed=time.time_ns() % 2**31)
        gen = session.say(text, max_tokens=max_tokens, sampling=sampling, mode=mode, tree=tree)
        try:
            while True:
                stdout.write(next(gen))
                stdout.flush()
        except StopIteration as stop:
            last = stop.value
        except KeyboardInterrupt:
            gen.close()
            last = None
            stdout.write(dim(" [stopped]"))
        stdout.write("\n")
        if last is not None and last.stats is not None:
            print(dim(_stats_line(last)), file=stdout if interactive else stderr)
        stdout.flush()


def _stats_line(r: Reply) -> str:
    s = r.stats
    return (
        f"[{s.mode}] {s.generated_tokens} tokens, {s.tokens_per_second:.1f} tok/s, "
        f"τ {s.tokens_per_pass:.2f}, reused {r.reused_tokens} cached tokens, {r.finish_reason}"
    )
