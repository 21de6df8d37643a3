"""Bench results as a Markdown table and a chart."""

from __future__ import annotations

from pathlib import Path


def markdown_table(res: dict) -> str:
    m = res["machine"]
    lines = [
        f"`{res['model']}` — {res['date']} — {m['cpu']} ({m['cores']} cores), {m['os']}, MLX {m['mlx']} "
        f"({m['device']}), BLAS: {m['blas']}; {res['settings']['prompts']} prompts × "
        f"{res['settings']['max_tokens']} tokens × {res['settings'].get('rounds', 1)} rounds",
        "",
        "| method | temp | tok/s (median) | range | speedup vs ar | τ (tokens/pass) | TTFT ms | peak GB "
        "| equals ar | exact match |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in res["results"]:
        eq = "—" if r["matches_ar"] is None else ("yes" if r["matches_ar"] else "NO")
        em = "—" if r["exact_match"] is None else f"{r['exact_match']:.2f}"
        sp = "—" if r["speedup_vs_ar"] is None else f"{r['speedup_vs_ar']:.2f}×"
        lines.append(
            f"| {r['method']} | {r['temperature']:g} | {r['tokens_per_second_median']:.1f} | "
            f"{r['tokens_per_second_min']:.1f}–{r['tokens_per_second_max']:.1f} | {sp} | "
            f"{r['tokens_per_pass']:.2f} | {r['ttft_ms']:.0f} | {r['peak_memory_gb']:.2f} | {eq} | {em} |"
        )
    return "\n".join(lines) + "\n"


def write_chart(res: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rs = res["results"]
    names = [r["method"] for r in rs]
    med = [r["tokens_per_second_median"] for r in rs]
    lo = [r["tokens_per_second_median"] - r["tokens_per_second_min"] for r in rs]
    hi = [r["tokens_per_second_max"] - r["tokens_per_second_median"] for r in rs]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(names, med, yerr=[lo, hi], capsize=4, color=["#777" if "ss" not in n else "#2a7" for n in names])
    ax.set_ylabel("tokens / s (median, min–max)")
    ax.set_title(f"{res['model']} — {res['machine']['device']}, BLAS {res['machine']['blas'].split(' ')[0]}")
    for i, r in enumerate(rs):
        ax.text(i, med[i], f"τ {r['tokens_per_pass']:.2f}", ha="center", va="bottom", fontsize=8)
    plt.xticks(rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
