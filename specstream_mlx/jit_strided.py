"""Vectorisable inner loops for MLX's strided element-wise CPU kernels.

MLX's CPU backend writes a compiled element-wise kernel in two forms (``mlx/backend/cpu/
compiled.cpp``): a contiguous one, one flat loop that GCC vectorises, and a strided one for
inputs that broadcast or are views, whose loops step every input's pointer by a stride
known only at run time, so GCC compiles them one element at a time. A tree pass's rows
meet the strided form everywhere (RMSNorm's weight and its per-row scale broadcast over
the rows; SwiGLU reads the halves of the fused gate/up output): at 9 rows its RMSNorm took
twice its one-row time, SwiGLU on the halves 1.3x its time on copies (bench/README.md).

This module rewrites such a kernel's source before it is built (the ``g++`` wrapper of
:mod:`specstream_mlx.cpu_jit` runs it on every kernel source it builds): where every input's
stride along the innermost dimension is 0 (broadcast) or 1 (contiguous), which is what
rows of a tree pass give, the innermost loop runs in chunks over plain arrays, a broadcast
input read from a small buffer filled with its one value, and GCC vectorises it; any other
stride takes MLX's loop as it was. The arithmetic of each element is the same text, so the
results are the same bits (a test compares them with MLX's own build).

Standalone: the wrapper runs it with Python's ``-S -E`` on a path, without importing the
package. A source it does not recognise is left as it is.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import List, Optional

# Elements per chunk of the rewritten loop (and of a broadcast input's buffer).
CHUNK = 256

_STRIDES = re.compile(r"^\s*const int64_t\* (\w+)_strides = strides\[\d+\];\s*$")
_POINTER = re.compile(r"^\s*([\w:<> ]+?)\* (\w+) = \(\1\*\)args\[\d+\];\s*$")
_FOR = re.compile(r"^\s*for \(int i(\d+) = 0; i\1 < shape\[\1\]; \+\+i\1\) \{\s*$")
_READ = re.compile(r"^(\s*)([\w:<> ]+?) tmp_(\w+) = \*(\w+);\s*$")
_WRITE = re.compile(r"^(\s*)\*(\w+)\+\+ = tmp_(\w+);\s*$")
_STEP = re.compile(r"^\s*(\w+) \+= \1_strides\[(\d+)\];\s*$")
# In any other line of the loop: a dereference, an increment or a compound assignment.
_OTHER_ACCESS = re.compile(r"(^|[^\w)\s]|=)\s*\*\s*[A-Za-z_]|\+\+|--|[-+*/]=")


def rewrite(source: str) -> Optional[str]:
    """``source`` with its innermost loop specialised for strides 0 and 1, or None where it
    is not a strided kernel in the form this module knows."""
    lines = source.split("\n")
    strided = [m.group(1) for m in map(_STRIDES.match, lines) if m]
    types = {m.group(2): m.group(1) for m in map(_POINTER.match, lines) if m}
    loops = [(i, int(m.group(1))) for i, m in ((i, _FOR.match(line)) for i, line in enumerate(lines)) if m]
    if not strided or not loops or any(name not in types for name in strided):
        return None
    start, depth = loops[-1]
    if depth != len(loops) - 1:
        return None
    # The innermost loop: reads, arithmetic, writes, then one pointer step per strided input.
    end = start + 1
    while end < len(lines) and not _STEP.match(lines[end]):
        end += 1
    steps = end
    while steps < len(lines) and _STEP.match(lines[steps]):
        m = _STEP.match(lines[steps])
        if int(m.group(2)) != depth:
            return None
        steps += 1
    stepped = sorted(_STEP.match(x).group(1) for x in lines[end:steps])
    if steps >= len(lines) or lines[steps].strip() != "}" or stepped != sorted(strided):
        return None
    body, reads, writes = [], [], []
    for line in lines[start + 1 : end]:
        r, w = _READ.match(line), _WRITE.match(line)
        if r and r.group(4) in strided:
            reads.append(r.group(4))
            body.append(f"{r.group(1)}{r.group(2)} tmp_{r.group(3)} = p_{r.group(4)}[i_];")
        elif w:
            if w.group(2) not in types:
                return None
            writes.append(w.group(2))
            body.append(f"{w.group(1)}p_{w.group(2)}[i_] = tmp_{w.group(3)};")
        elif _OTHER_ACCESS.search(line):
            return None  # a pointer read or step of a form not known here
        else:
            body.append(line)
    if sorted(reads) != sorted(strided) or not writes:
        return None
    fast = _fast_loop(strided, writes, types, depth, body)
    original = lines[start : steps + 1]
    out = lines[:start] + fast + ["  } else {"] + original + ["  }", "  }"] + lines[steps + 1 :]
    head = next((i for i, line in enumerate(out) if line.startswith('extern "C"')), None)
    if head is None:
        return None
    return "\n".join(out[:head] + [SWITCH_DECLARATION] + out[head:])


# A switch for measuring the rewritten loops against MLX's within one process: the
# forwarder's library (native/gemv_forward.c) defines it; where it is not loaded the weak
# reference is null and the rewritten loop runs.
SWITCH_DECLARATION = 'extern "C" int specstream_jit_strided_off __attribute__((weak));'
_SWITCH = "(&specstream_jit_strided_off == nullptr || !specstream_jit_strided_off)"


def _fast_loop(strided: List[str], writes: List[str], types: dict, depth: int, body: List[str]) -> List[str]:
    unit = " && ".join([_SWITCH] + [f"(s_{x} == 0 || s_{x} == 1)" for x in strided])
    code = ["  {", f"  const int n_ = shape[{depth}];"]
    code += [f"  const int64_t s_{x} = {x}_strides[{depth}];" for x in strided]
    code += [f"  if ({unit}) {{"]
    for x in strided:
        code += [
            f"  {types[x]} b_{x}[{CHUNK}];",
            f"  if (s_{x} == 0) for (int c_ = 0; c_ < (n_ < {CHUNK} ? n_ : {CHUNK}); ++c_) b_{x}[c_] = *{x};",
        ]
    code += [
        f"  for (int c0_ = 0; c0_ < n_; c0_ += {CHUNK}) {{",
        f"  const int m_ = n_ - c0_ < {CHUNK} ? n_ - c0_ : {CHUNK};",
    ]
    code += [f"  const {types[x]}* p_{x} = s_{x} ? {x} + c0_ : b_{x};" for x in strided]
    code += [f"  {types[x]}* p_{x} = {x} + c0_;" for x in writes]
    code += ["  for (int i_ = 0; i_ < m_; ++i_) {"] + body + ["  }", "  }"]
    code += [f"  {x} += s_{x} * n_;" for x in strided]
    code += [f"  {x} += n_;" for x in writes]
    return code


def main(argv: List[str]) -> int:
    """Rewrites each named source file in place where :func:`rewrite` knows its form (a
    file written whole or not at all); never fails the build."""
    for name in argv:
        try:
            path = Path(name)
            new = rewrite(path.read_text())
            if new is not None:
                tmp = path.with_name(f".{path.name}.rewrite")
                tmp.write_text(new)
                tmp.replace(path)
        except Exception:  # the kernel then builds as MLX wrote it
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
