"""Running a model directory's own code paths (its chat template, its tokenizer) with bounds.

A chat template is a program shipped with the model (Jinja, sandboxed by
transformers) and a tokenizer's pre-tokenizer is a regular expression: either can
be written to run for ever, allocate without end, or fail in native code. The
tokenizers library reports a failed regex search as ``pyo3_runtime.PanicException``,
a ``BaseException`` that ``except Exception`` does not catch. Here every such
call ends in its result or one :class:`PromptError`.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence, Tuple, TypeVar

from ..io.limits import outside_vocabulary

T = TypeVar("T")

# Rendering a real chat template takes well under 10 ms; a second is a runaway.
TEMPLATE_SECONDS = 2.0
# What still ends the process: the user's Ctrl-C, an exit, a closed generator.
FATAL = (KeyboardInterrupt, SystemExit, GeneratorExit)


class PromptError(ValueError):
    """A prompt the model's own template or tokenizer could not turn into tokens."""


def check_token_ids(ids: Sequence[int], vocab_size: int) -> None:
    """Raise :class:`PromptError` for an id outside the model's vocabulary
    (:func:`~specstream_mlx.io.limits.outside_vocabulary`)."""
    why = outside_vocabulary(ids, vocab_size)
    if why:
        raise PromptError(why)


class _Deadline(Exception):
    pass


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`PromptError` in this thread's Python code once ``seconds`` have passed.

    A trace function sees every line the template's compiled code runs, so a loop that
    never ends is stopped at its next line (a single long native call is not)."""
    end = time.monotonic() + seconds

    def trace(frame, event, arg):
        if time.monotonic() > end:
            raise _Deadline()
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        yield
    except _Deadline:
        raise PromptError(f"the chat template ran for more than {seconds:g} s; refusing it") from None
    finally:
        sys.settrace(previous)


def guarded(fn: Callable[[], T], what: str, keep: Tuple[type, ...] = ()) -> T:
    """``fn()``, with any failure but a fatal one or one of ``keep`` (a native panic
    included) as one PromptError."""
    try:
        return fn()
    except (PromptError, *keep):
        raise
    except FATAL:
        raise
    except BaseException as e:  # pyo3's PanicException derives from BaseException
        raise PromptError(f"{what} failed ({type(e).__name__}: {str(e)[:200]})") from None
