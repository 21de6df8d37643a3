"""Bench results as a Markdown table and a chart."""

from __future__ import annotations

from pathlib import Path


def markdown_table(res: dict) -> str:
    m = res["machine"]
    lines = [
        f"`{res['model']}` — {res['date']} — {m['cpu']} ({m['cores']} cores), {m['os']}, MLX {m['mlx']} "
        f"({m['device']}), BLAS: {m['blas']}"
        + (f" {m['blas_version']}" if m.get("blas_version") else "")
        + (f", {m['blas_core']} kernels" if m.get("blas_core") else "")
        + (f", {m['blas_threads']} threads" if m.get("blas_threads") else "")
        + (f", {m['blas_forwarder']}" if m.get("blas_forwarder") else "")
        + (f"; compiled CPU kernels {m['cpu_kernels']}" if m.get("cpu_kernels") else "")
        + (f"; allocator {m['malloc']}" if m.get("malloc") else "")
        + (f"; ss passes {res['settings']['ss_passes'].get('greedy')}" if res["settings"].get("ss_passes") else "")
        + (f"; attention of several rows {res['settings']['attention']}" if res["settings"].get("attention") else "")
        + (f"; weights read as stored: {res['settings']['stored_rows']}" if res["settings"].get("stored_rows") else "")
        + f"; {res['settings']['prompts']} "
        + (f"{res['settings']['prompt_set']} " if res["settings"].get("prompt_set") else "")
        + "prompts × "
        f"{res['settings']['max_tokens']} tokens × {res['settings'].get('rounds', 1)} rounds",
        "",
        "| method | temp | tok/s (median) | range | speedup vs ar | τ (tokens/pass) | TTFT ms | peak GB "
        "| equals ar | exact match |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in res["results"]:
        eq = _equals_ar(r)
        em = "—" if r["exact_match"] is None else f"{r['exact_match']:.2f}"
        sp = "—" if r["speedup_vs_ar"] is None else f"{r['speedup_vs_ar']:.2f}×"
        lines.append(
            f"| {r['method']} | {r['temperature']:g} | {r['tokens_per_second_median']:.1f} | "
            f"{r['tokens_per_second_min']:.1f}–{r['tokens_per_second_max']:.1f} | {sp} | "
            f"{r['tokens_per_pass']:.2f} | {r['ttft_ms']:.0f} | {r['peak_memory_gb']:.2f} | {eq} | {em} |"
        )
    return "\n".join(lines) + "\n"


def _equals_ar(r: dict) -> str:
    """yes, NO, or how many replies part from ar's at a tie within rounding (and none elsewhere)."""
    if r["matches_ar"] is None:
        return "—"
    if r["matches_ar"]:
        return "yes"
    ties, differs = r.get("ties_with_ar", 0), r.get("differs_from_ar", 0)
    if ties and ties == differs:
        return f"at ties only ({ties})"
    return f"NO ({ties} of {differs} at ties)" if ties else "NO"


def _reference(method: str) -> str:
    """The plain-decoding row a method is compared with: ar@T for sampled rows."""
    return "ar@" + method.split("@", 1)[1] if "@" in method else "ar"


def write_chart(res: dict, path: Path) -> bool:
    """Speedup over plain decoding per method (sampled rows next to their ar@T), with τ labels."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rs = res["results"]
    # Greedy methods first, then each sampled pair side by side.
    order = [r for r in rs if "@" not in r["method"]] + sorted(
        (r for r in rs if "@" in r["method"]), key=lambda r: (r["method"].split("@")[1], r["method"][:2] != "ar")
    )
    names = [r["method"] for r in order]
    speed = [r["speedup_vs_ar"] or 0.0 for r in order]
    by_name = {r["method"]: r for r in rs}
    lo, hi = [], []
    for r in order:
        ref = by_name.get(_reference(r["method"]), {}).get("tokens_per_second_median") or 1.0
        lo.append(max(0.0, (r["tokens_per_second_median"] - r["tokens_per_second_min"]) / ref))
        hi.append(max(0.0, (r["tokens_per_second_max"] - r["tokens_per_second_median"]) / ref))
    colors = ["#2a7" if n.startswith("ss") else "#bbb" if n.startswith("ar") else "#789" for n in names]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.bar(names, speed, yerr=[lo, hi], capsize=4, color=colors)
    ax.axhline(1.0, color="#444", linewidth=0.8, linestyle="--")
    ax.set_ylabel("speedup vs plain decoding (ar; ar@T for sampled rows)")
    for i, r in enumerate(order):
        ax.annotate(
            f"τ {r['tokens_per_pass']:.2f}",
            (i, speed[i] + hi[i]),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=9,
        )
    st, m = res["settings"], res["machine"]
    ax.set_title(
        f"{res['model']} — {res['date'][:16].replace('T', ' ')} — {m['device']}, BLAS {m['blas'].split(' ')[0]}\n"
        f"{st['prompts']} prompts × ≤{st['max_tokens']} tokens × {st.get('rounds', 1)} rounds, tree {st['tree']}",
        fontsize=10,
    )
    ax.set_ylim(0, max(speed[i] + hi[i] for i in range(len(speed))) * 1.18 + 0.05)
    plt.xticks(rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
