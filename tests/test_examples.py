"""The repository's measuring tools read what the system tools print."""

import importlib.util
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _module(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _refused_in_one_line(script: str, cases) -> None:
    """Each (arguments, words) of ``cases`` makes ``script`` exit non-zero with one line on
    stderr that holds ``words``, nothing on stdout and no traceback."""
    import subprocess
    import sys

    for args, words in cases:
        out = subprocess.run(
            [sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=60
        )
        assert out.returncode != 0 and out.stdout == "", out
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0] and "Traceback" not in out.stderr, out.stderr


def test_profile_threads_reads_perf_script_with_indented_thread_lines():
    """``perf script -F tid,ip,sym,dso`` starts a sample's thread line with a space on some
    perf versions: those samples were taken for frames of the previous one and the tool
    printed no thread at all."""
    aggregate = _module("profile_threads").aggregate
    script = (
        " 6342 \n\t    75ac rows4_avx512 (/root/.cache/x/libgemv.so)\n\t    b11c product_columns (/r/libgemv.so)\n\n"
        " 6342 \n\t    98f0 cfree@GLIBC_2.2.5 (/usr/lib/libc.so.6)\n\n"
        "6345 \n\t    b1cc worker (/root/.cache/x/libgemv.so)\n\n"
    )
    out = aggregate(script, least=0.0)
    assert set(out) == {"6342", "6345"}
    samples, rows = out["6342"]
    assert samples == 2 and {leaf for _, leaf in rows} == {"rows4_avx512 (libgemv.so)", "cfree@GLIBC_2.2.5 (libc.so.6)"}


def test_tree_sweep_keeps_the_commas_inside_a_tree():
    """A sweep's items are comma-separated, and so is a tree's depth (``dynamic:8,3``):
    splitting at every comma swept ``dynamic:8`` and a bad item ``3@1/prune=0``."""
    split_items = _module("tree_sweep").split_items
    got = split_items("dynamic:8@1/prune=0,dynamic:8,3@1/prune=0,topk:2,3,auto,chain:4")
    assert got == ["dynamic:8@1/prune=0", "dynamic:8,3@1/prune=0", "topk:2,3", "auto", "chain:4"]


def test_tree_sweep_divides_each_item_by_the_ar_run_right_before_it():
    """On a host whose speed drifts, an item is set against the ``ar`` run next to it: the
    sweep had run ``ar`` once at a round's head, and an item at the end of the round read a
    drift of the host as a cost of its own."""
    sweep_rounds = _module("tree_sweep").sweep_rounds
    clock = {"runs": 0}

    def run(mode, tree=None, options=None):  # the host slows by a tenth at every run; ss = ar
        clock["runs"] += 1
        speed = 100.0 * 0.9 ** clock["runs"]
        return speed, 1.0 if mode == "ar" else 1.5, 0.0

    items = [("a", "tree-a", {}), ("b", "tree-b", {}), ("c", "tree-c", {})]
    ratios, taus, pruned, ar_rates = sweep_rounds(run, items, 2)
    assert len(ar_rates) == 6 and taus == {"a": 1.5, "b": 1.5, "c": 1.5}
    for s in "abc":  # every item one run after its ar: the same tenth, whatever its place
        assert [round(r, 6) for r in ratios[s]] == [0.9, 0.9]


def test_skinny_rows_ab_refuses_bad_rows_and_settings_in_one_line():
    """A bad row count or setting is named in one line before any process is started."""
    _refused_in_one_line(
        "skinny_rows_ab.py",
        [
            (["--rows", "1,0"], "--rows '1,0'"),
            (["--rows", "9,x"], "--rows '9,x'"),
            (["--settings", "default;PREFETCH"], "setting 'PREFETCH'"),
        ],
    )


def test_chain_pass_cost_refuses_bad_rows_and_counts_in_one_line():
    """A bad row count or count of rounds is named in one line before any model is loaded."""
    _refused_in_one_line(
        "chain_pass_cost.py",
        [
            (["--rows", "2,0"], "--rows '2,0'"),
            (["--rows", "9,x"], "--rows '9,x'"),
            (["--rows", "2", "--reps", "0"], "--reps 0"),
        ],
    )


def test_prompt_products_ab_refuses_bad_lengths_and_rounds_in_one_line():
    """A bad prompt length or count of rounds is named in one line before any model is loaded."""
    _refused_in_one_line(
        "prompt_products_ab.py",
        [
            (["--tokens", "16,0"], "--tokens '16,0'"),
            (["--tokens", "16,x"], "--tokens '16,x'"),
            (["--rounds", "0"], "--rounds 0"),
        ],
    )
