#!/usr/bin/env bash
# A peer on the same file: llama.cpp, the reference runtime for GGUF files, decoding SmolLM2's
# Q4_1 GGUF (the one `smollm2` is converted from) on this machine, against specstream-mlx on the
# same weights: exact (every product the float32 expansion's bits) and with 8-bit activations
# (SPECSTREAM_PRODUCTS=q8), which is llama.cpp's own arithmetic for Q4_1 weights (it multiplies
# them by activations quantized to 8 bits, Q8_1).
#
# Each round runs, in turn (the order rotating from round to round): `llama-bench` (token
# generation of TOKENS tokens, and batches of ROWS tokens, each after a CONTEXT-token depth; 3
# repetitions; as many threads as the product kernel uses), and for exact and q8 products
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
runs=(llama exact q8 passes-exact passes-q8)
for r in $(seq 1 "$rounds"); do
  for i in 0 1 2 3 4; do
    run=${runs[$(((i + r - 1) % 5))]}
    case $run in
      llama) "$bench" -m "$gguf" -t "$threads" -p "$rows" -n "$tokens" -d "$context" -r 3 -o json \
               > "$out/llama-$r.json" 2> "$out/llama-$r.log" ;;
      passes-exact) env -u SPECSTREAM_PRODUCTS $("$py" -m specstream_mlx.blas_env) "$py" \
               examples/chain_pass_cost.py --rows "$rows" --context "$context" --json "$out/passes-exact-$r.json" \
               > /dev/null ;;
      passes-q8) SPECSTREAM_PRODUCTS=q8 env $("$py" -m specstream_mlx.blas_env) "$py" \
               examples/chain_pass_cost.py --rows "$rows" --context "$context" --json "$out/passes-q8-$r.json" \
               > /dev/null ;;
      exact) env -u SPECSTREAM_PRODUCTS "$cli" floor --model smollm2 --rounds 1 --tokens "$tokens" \
               --context "$context" --json "$out/exact-$r.json" > /dev/null ;;
      q8) SPECSTREAM_PRODUCTS=q8 "$cli" floor --model smollm2 --rounds 1 --tokens "$tokens" \
            --context "$context" --json "$out/q8-$r.json" > /dev/null ;;
    esac
  done
  echo "round $r of $rounds done" >&2
done

"$py" - "$out" "$rounds" "$json_out" "$version" <<'PY'
import json, statistics, sys
out, rounds, json_out, version = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
rounds_out = []
for r in range(1, rounds + 1):
    tests = json.load(open(f"{out}/llama-{r}.json"))
    for t in tests:  # the file's name, not where this machine keeps it
        t["model_filename"] = t["model_filename"].rsplit("/", 1)[-1]
    llama = next(t for t in tests if t["n_gen"] > 0)
    batches = {t["n_prompt"]: 1e3 * t["n_prompt"] / t["avg_ts"] for t in tests if t["n_prompt"] > 0}
    exact, q8 = (json.load(open(f"{out}/{m}-{r}.json")) for m in ("exact", "q8"))
    passes = {m: json.load(open(f"{out}/passes-{m}-{r}.json")) for m in ("exact", "q8")}
    floor = statistics.median([exact["floor_ms"], q8["floor_ms"]])
    row = {
        "floor_ms": floor,
        "llama_cpp_ms": 1e3 / llama["avg_ts"],
        "exact_ms": statistics.median(exact["step_ms"]),
        "q8_ms": statistics.median(q8["step_ms"]),
        "llama_cpp_batch_ms": batches,
        "pass_ms": {m: {int(b): v for b, v in p["pass_ms"].items()} for m, p in passes.items()},
        "pass_step_ms": {m: p["step_ms"] for m, p in passes.items()},
    }
    rounds_out.append(row)
    print(f"round {r}: floor {floor:.2f} ms; llama.cpp {row['llama_cpp_ms']:.2f} ms ({llama['avg_ts']:.1f} tok/s, "
          f"{row['llama_cpp_ms'] / floor:.2f}x the floor); specstream-mlx exact {row['exact_ms']:.2f} ms "
          f"({row['exact_ms'] / floor:.2f}x), 8-bit activations {row['q8_ms']:.2f} ms ({row['q8_ms'] / floor:.2f}x)")
    for b in sorted(batches):
        e, q = row["pass_ms"]["exact"][b], row["pass_ms"]["q8"][b]
        print(f"  {b} rows: llama.cpp {batches[b]:.2f} ms ({batches[b] / row['llama_cpp_ms']:.2f} of its steps); "
              f"exact {e:.2f} ms ({e / row['pass_step_ms']['exact']:.2f}); "
              f"8-bit activations {q:.2f} ms ({q / row['pass_step_ms']['q8']:.2f})")
med = {k: statistics.median(row[k] for row in rounds_out) for k in ("floor_ms", "llama_cpp_ms", "exact_ms", "q8_ms")}
ratio = {k: statistics.median(row[k] / row["llama_cpp_ms"] for row in rounds_out) for k in ("exact_ms", "q8_ms")}
print(f"median: floor {med['floor_ms']:.2f} ms; llama.cpp {med['llama_cpp_ms']:.2f} ms a token "
      f"({med['llama_cpp_ms'] / med['floor_ms']:.2f}x the floor); specstream-mlx exact {med['exact_ms']:.2f} ms "
      f"({ratio['exact_ms']:.2f}x llama.cpp's time), 8-bit activations {med['q8_ms']:.2f} ms ({ratio['q8_ms']:.2f}x)")
steps = {}
for b in sorted(rounds_out[0]["llama_cpp_batch_ms"]):
    ll = statistics.median(row["llama_cpp_batch_ms"][b] / row["llama_cpp_ms"] for row in rounds_out)
    ours = {m: statistics.median(row["pass_ms"][m][b] / row["pass_step_ms"][m] for row in rounds_out) for m in ("exact", "q8")}
    ms = {m: statistics.median(row["pass_ms"][m][b] for row in rounds_out) for m in ("exact", "q8")}
    llms = statistics.median(row["llama_cpp_batch_ms"][b] for row in rounds_out)
    steps[b] = {"llama_cpp": ll, **ours}
    print(f"median, {b} rows: llama.cpp {llms:.2f} ms = {ll:.2f} of its steps; exact {ms['exact']:.2f} ms = "
          f"{ours['exact']:.2f} plain steps; 8-bit activations {ms['q8']:.2f} ms = {ours['q8']:.2f}")
print(f"llama.cpp: llama-cpp-python {version}'s sources, {llama['n_threads']} threads, {llama['cpu_info']}; "
      f"specstream-mlx: {exact['blas']}")
if json_out:
    json.dump({"llama_cpp_python": version, "rounds": rounds_out, "median": med, "time_vs_llama_cpp": ratio,
               "batch_in_steps": steps, "llama_cpp": tests, "specstream_exact": exact, "specstream_q8": q8},
              open(json_out, "w"), indent=1)
PY
