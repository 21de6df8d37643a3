"""A client for `specstream-mlx serve --stdio`, written the way the Swift client works.

It starts the server as a subprocess with pipes, writes one JSON request per
line, and reads events line by line from the server's stdout (stderr carries
logs only). Requests are answered in order; `ping` and `cancel` are answered
at once.

    python examples/python_client.py --model path/to/model "Hello there"
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import threading
from typing import Dict, Iterator, List, Optional


class SpecStreamClient:
    """Owns one `specstream-mlx serve --stdio` process."""

    def __init__(self, model: str, executable: Optional[List[str]] = None, extra_args: Optional[List[str]] = None):
        cmd = (executable or ["specstream-mlx"]) + ["serve", "--stdio", "--model", model] + (extra_args or [])
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._ids = itertools.count(1)
        self._write_lock = threading.Lock()
        # Logs are drained so the server never blocks on a full stderr pipe.
        self.log_lines: List[str] = []
        threading.Thread(target=self._drain_stderr, daemon=True).start()

    def _drain_stderr(self):
        for line in self.proc.stderr:
            self.log_lines.append(line.decode("utf-8", "replace"))

    def send(self, request: Dict) -> None:
        with self._write_lock:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()

    def events(self) -> Iterator[Dict]:
        """Every event the server writes, in order."""
        for line in self.proc.stdout:
            yield json.loads(line)

    def generate(self, prompt: Optional[str] = None, messages: Optional[List[Dict]] = None, **params) -> Iterator[Dict]:
        """Send one request and yield its events up to and including `done` or `error`."""
        rid = f"req-{next(self._ids)}"
        req = {"id": rid, **({"prompt": prompt} if prompt is not None else {"messages": messages}), **params}
        self.send(req)
        for ev in self.events():
            if ev.get("id") != rid:
                continue
            yield ev
            if ev["event"] in ("done", "error"):
                return

    def cancel(self, rid: str) -> None:
        self.send({"id": rid, "cancel": True})

    def close(self) -> int:
        """Close stdin (EOF); the server finishes queued work and exits 0."""
        self.proc.stdin.close()
        return self.proc.wait(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("prompt")
    args = ap.parse_args()
    client = SpecStreamClient(args.model)
    for ev in client.generate(args.prompt, max_tokens=args.max_tokens):
        if ev["event"] == "token":
            sys.stdout.write(ev["text"])
            sys.stdout.flush()
        elif ev["event"] == "done":
            s = ev["stats"]
            print(
                f"\n[{ev['finish_reason']}] {s.get('generated_tokens')} tokens, "
                f"{s.get('tokens_per_second', 0):.1f} tok/s, τ {s.get('tokens_per_pass', 0):.2f}",
                file=sys.stderr,
            )
        else:
            print(f"\nerror {ev['code']}: {ev['message']}", file=sys.stderr)
    return client.close()


if __name__ == "__main__":
    sys.exit(main())
