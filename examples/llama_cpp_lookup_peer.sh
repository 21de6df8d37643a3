#!/usr/bin/env bash
# Prompt lookup against a peer: llama.cpp's `llama-lookup` (drafts copied from the prompt's
# n-grams, verified in one batch) and its plain decoding (`llama-completion`), and
# specstream-mlx's `ss --tree auto` and `ar`, greedy, on SmolLM2's Q4_1 file (llama.cpp) and
# `smollm2` converted from it, with `make demo`'s two prompts (an open chat prompt and one whose
# reply copies it; the chat template applied as `smollm2`'s tokenizer applies it). Each round
# runs the four in turn, the order rotating; prints decoding tokens/s (llama.cpp's decoding
# time without the prompt's, as specstream-mlx's `tokens_per_second`), each method's speed
# over its runtime's plain decoding in the same round, and the medians.
#   bash examples/llama_cpp_lookup_peer.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "llama_cpp_lookup_peer.sh: ROUNDS '$rounds': a positive integer" >&2; exit 2; }
source examples/llama_cpp_build.sh
completion=$(llama_cpp_tool llama-completion)
lookup=$(llama_cpp_tool llama-lookup)

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# Each demo prompt, written once as files: its user text (what specstream-mlx is given, on
# stdin), the prompt formatted with the chat template (llama.cpp's -f drops one final newline,
# so the file carries one more than the template's "assistant\n") and its token budget.
n=$("$py" - "$out" <<'PY'
import sys
from specstream_mlx import load
from specstream_mlx.demo.run import DEMOS
out = sys.argv[1]
_, tok = load("smollm2", warn=False)
for i, d in enumerate(DEMOS):
    text = tok.apply_chat_template([{"role": "user", "content": d.prompt}], add_generation_prompt=True, tokenize=False)
    open(f"{out}/prompt-{i}.user", "w").write(d.prompt)
    open(f"{out}/prompt-{i}.llama", "w").write(text + "\n")
    open(f"{out}/prompt-{i}.max", "w").write(str(d.max_tokens))
print(len(DEMOS))
PY
)
runs=(llama-plain llama-lookup ar ss)
for r in $(seq 1 "$rounds"); do
  for p in $(seq 0 $((n - 1))); do
    max=$(< "$out/prompt-$p.max")
    for i in 0 1 2 3; do
      run=${runs[$(((i + r + p - 1) % 4))]}
      case $run in
        llama-plain) "$completion" -m "$gguf" -f "$out/prompt-$p.llama" -n "$max" --temp 0 -t "$threads" -no-cnv \
                       > "$out/$run-$r-$p.txt" 2> "$out/$run-$r-$p.log" ;;
        llama-lookup) "$lookup" -m "$gguf" -f "$out/prompt-$p.llama" -n "$max" --temp 0 -t "$threads" \
                        > "$out/$run-$r-$p.txt" 2> "$out/$run-$r-$p.log" ;;
        ar | ss) "$cli" generate --model smollm2 --mode "$run" --tree auto --temp 0 -m "$max" --prompt - \
                   --json < "$out/prompt-$p.user" > "$out/$run-$r-$p.json" 2> /dev/null ;;
      esac
    done
  done
  echo "round $r of $rounds done" >&2
done

"$py" - "$out" "$rounds" "$n" <<'PY'
import json, re, statistics, sys
out, rounds, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def llama_plain(path):  # common_perf_print: "eval time = X ms / N runs (... tokens per second)"
    m = re.search(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs", open(path).read())
    return int(m.group(2)) / (float(m.group(1)) / 1e3), int(m.group(2))

def llama_lookup(path):  # "decoded N tokens in S seconds" and "accept = P%"
    text = open(path).read()
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", text)
    return int(m.group(1)) / float(m.group(2)), int(m.group(1))

for p in range(n):
    ratios = {"llama.cpp lookup": [], "specstream-mlx ss": []}
    speeds = {k: [] for k in ("llama.cpp plain", "llama.cpp lookup", "specstream-mlx ar", "specstream-mlx ss")}
    for r in range(1, rounds + 1):
        lp, ln = llama_plain(f"{out}/llama-plain-{r}-{p}.log")
        ll, lln = llama_lookup(f"{out}/llama-lookup-{r}-{p}.log")
        ar, ss = (json.load(open(f"{out}/{m}-{r}-{p}.json")) for m in ("ar", "ss"))
        assert ss["tokens"] == ar["tokens"], f"prompt {p}, round {r}: ss output differs from ar"
        a, s = ar["stats"]["tokens_per_second"], ss["stats"]["tokens_per_second"]
        for k, v in zip(speeds, (lp, ll, a, s)):
            speeds[k].append(v)
        ratios["llama.cpp lookup"].append(ll / lp)
        ratios["specstream-mlx ss"].append(s / a)
        print(f"prompt {p}, round {r}: llama.cpp plain {lp:.1f} tok/s ({ln} tokens), lookup {ll:.1f} ({ll / lp:.2f}x); "
              f"specstream-mlx ar {a:.1f} ({len(ar['tokens'])} tokens), ss {s:.1f} ({s / a:.2f}x, "
              f"{ss['stats']['tokens_per_pass']:.2f} tokens a pass)")
    print(f"prompt {p}, medians: " + ", ".join(f"{k} {statistics.median(v):.1f} tok/s" for k, v in speeds.items())
          + "; " + ", ".join(f"{k} {statistics.median(v):.2f}x its plain decoding" for k, v in ratios.items()))
PY
