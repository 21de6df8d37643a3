#!/usr/bin/env bash
# A peer on the same file: llama.cpp, the reference runtime for GGUF files, decoding SmolLM2's
# Q4_1 GGUF (the one `smollm2` is converted from) on this machine, against specstream-mlx on the
# same weights, in each of the product kernel's settings: exact (SPECSTREAM_PRODUCTS=exact, every
# product the float32 expansion's bits), 16-bit activations as two 8-bit planes (q16, the default)
# and 8-bit activations (q8), which is llama.cpp's own arithmetic for Q4_1 weights (it multiplies
# them by activations quantized to 8 bits, Q8_1).
#
# Each round runs, in turn (the order rotating from round to round): `llama-bench` (token
# generation of TOKENS tokens, and batches of ROWS tokens, each after a CONTEXT-token depth; 3
# repetitions; as many threads as the product kernel uses), and for each setting
# `specstream-mlx floor` (the plain step beside the machine's floor, measured in that run) and
# `examples/chain_pass_cost.py` (a plain step and verifying passes of ROWS chained rows, in one
# process). A batch of b tokens is what a verifying pass of b rows computes, except that
# llama-bench's batches take the LM head of their last row only. Prints each round and the
# medians; writes them to OUT (JSON) when given.
#
# llama.cpp is built once from the sources in llama-cpp-python's PyPI package
# (examples/llama_cpp_build.sh). A measuring tool only: nothing in specstream-mlx uses it.
#   bash examples/llama_cpp_peer.sh [ROUNDS] [TOKENS] [CONTEXT] [OUT] [ROWS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
tokens=${2:-64}
context=${3:-128}
json_out=${4:-}
rows=${5:-2,5,9,17}
for v in "$rounds" "$tokens" "$context"; do
  [[ $v =~ ^[1-9][0-9]*$ ]] || { echo "llama_cpp_peer.sh: '$v': ROUNDS, TOKENS and CONTEXT are positive integers" >&2; exit 2; }
done
[[ $rows =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || { echo "llama_cpp_peer.sh: ROWS '$rows': comma-separated row counts" >&2; exit 2; }
source examples/llama_cpp_build.sh
bench=$(llama_cpp_tool llama-bench)

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
modes=(exact q16 q8)
runs=(llama)
for m in "${modes[@]}"; do runs+=("$m" "passes-$m"); done
for r in $(seq 1 "$rounds"); do
  for i in $(seq 0 $((${#runs[@]} - 1))); do
    run=${runs[$(((i + r - 1) % ${#runs[@]}))]}
    case $run in
      llama) "$bench" -m "$gguf" -t "$threads" -p "$rows" -n "$tokens" -d "$context" -r 3 -o json \
               > "$out/llama-$r.json" 2> "$out/llama-$r.log" ;;
      passes-*) SPECSTREAM_PRODUCTS=${run#passes-} env $("$py" -m specstream_mlx.blas_env) "$py" \
               examples/chain_pass_cost.py --rows "$rows" --context "$context" --json "$out/$run-$r.json" \
               > /dev/null ;;
      *) SPECSTREAM_PRODUCTS=$run "$cli" floor --model smollm2 --rounds 1 --tokens "$tokens" \
               --context "$context" --json "$out/$run-$r.json" > /dev/null ;;
    esac
  done
  echo "round $r of $rounds done" >&2
done

"$py" - "$out" "$rounds" "$json_out" "$version" "${modes[@]}" <<'PY'
import json, statistics, sys
out, rounds, json_out, version = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
modes = sys.argv[5:]
words = {"exact": "exact", "q16": "16-bit activations", "q8": "8-bit activations"}
rounds_out = []
for r in range(1, rounds + 1):
    tests = json.load(open(f"{out}/llama-{r}.json"))
    for t in tests:  # the file's name, not where this machine keeps it
        t["model_filename"] = t["model_filename"].rsplit("/", 1)[-1]
    llama = next(t for t in tests if t["n_gen"] > 0)
    batches = {t["n_prompt"]: 1e3 * t["n_prompt"] / t["avg_ts"] for t in tests if t["n_prompt"] > 0}
    floors = {m: json.load(open(f"{out}/{m}-{r}.json")) for m in modes}
    passes = {m: json.load(open(f"{out}/passes-{m}-{r}.json")) for m in modes}
    floor = statistics.median([f["floor_ms"] for f in floors.values()])
    row = {
        "floor_ms": floor,
        "llama_cpp_ms": 1e3 / llama["avg_ts"],
        **{f"{m}_ms": statistics.median(floors[m]["step_ms"]) for m in modes},
        "llama_cpp_batch_ms": batches,
        "pass_ms": {m: {int(b): v for b, v in p["pass_ms"].items()} for m, p in passes.items()},
        "pass_step_ms": {m: p["step_ms"] for m, p in passes.items()},
    }
    rounds_out.append(row)
    ours = ", ".join(f"{words[m]} {row[m + '_ms']:.2f} ms ({row[m + '_ms'] / floor:.2f}x)" for m in modes)
    print(f"round {r}: floor {floor:.2f} ms; llama.cpp {row['llama_cpp_ms']:.2f} ms ({llama['avg_ts']:.1f} tok/s, "
          f"{row['llama_cpp_ms'] / floor:.2f}x the floor); specstream-mlx {ours}")
    for b in sorted(batches):
        ours = "; ".join(
            f"{words[m]} {row['pass_ms'][m][b]:.2f} ms ({row['pass_ms'][m][b] / row['pass_step_ms'][m]:.2f})" for m in modes
        )
        print(f"  {b} rows: llama.cpp {batches[b]:.2f} ms ({batches[b] / row['llama_cpp_ms']:.2f} of its steps); {ours}")
keys = ["floor_ms", "llama_cpp_ms"] + [f"{m}_ms" for m in modes]
med = {k: statistics.median(row[k] for row in rounds_out) for k in keys}
ratio = {f"{m}_ms": statistics.median(row[f"{m}_ms"] / row["llama_cpp_ms"] for row in rounds_out) for m in modes}
ours = ", ".join(f"{words[m]} {med[m + '_ms']:.2f} ms ({ratio[m + '_ms']:.2f}x llama.cpp's time)" for m in modes)
print(f"median: floor {med['floor_ms']:.2f} ms; llama.cpp {med['llama_cpp_ms']:.2f} ms a token "
      f"({med['llama_cpp_ms'] / med['floor_ms']:.2f}x the floor); specstream-mlx {ours}")
steps = {}
for b in sorted(rounds_out[0]["llama_cpp_batch_ms"]):
    ll = statistics.median(row["llama_cpp_batch_ms"][b] / row["llama_cpp_ms"] for row in rounds_out)
    ours = {m: statistics.median(row["pass_ms"][m][b] / row["pass_step_ms"][m] for row in rounds_out) for m in modes}
    ms = {m: statistics.median(row["pass_ms"][m][b] for row in rounds_out) for m in modes}
    llms = statistics.median(row["llama_cpp_batch_ms"][b] for row in rounds_out)
    steps[b] = {"llama_cpp": ll, **ours}
    text = "; ".join(f"{words[m]} {ms[m]:.2f} ms = {ours[m]:.2f} plain steps" for m in modes)
    print(f"median, {b} rows: llama.cpp {llms:.2f} ms = {ll:.2f} of its steps; {text}")
print(f"llama.cpp: llama-cpp-python {version}'s sources, {llama['n_threads']} threads, {llama['cpu_info']}; "
      f"specstream-mlx: {floors[modes[0]]['blas']}")
if json_out:
    json.dump({"llama_cpp_python": version, "rounds": rounds_out, "median": med, "time_vs_llama_cpp": ratio,
               "batch_in_steps": steps, "llama_cpp": tests, **{f"specstream_{m}": floors[m] for m in modes}},
              open(json_out, "w"), indent=1)
PY
