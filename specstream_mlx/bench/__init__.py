"""``specstream-mlx bench``: every decoding method on the same prompts, in one run
(:mod:`.runner`), reported as JSON, Markdown and a chart (:mod:`.report`)."""

from .report import markdown_table, write_chart
from .runner import DecodeTotals, decode_prompts, load_bench_prompts, run_bench

__all__ = ["run_bench", "load_bench_prompts", "decode_prompts", "DecodeTotals", "markdown_table", "write_chart"]
