"""`specstream-mlx cache`: what the user cache holds, and pruning the builds nothing uses.

Every new virtual environment, MLX version or kernel-flag change left another ~50 MB
precompiled kernel header (and its kernel folder, and a product-kernel library per source
version) in the user cache, with nothing to say so or to remove them: a development
machine's cache held 16 such headers (660 MB) beside 384 MB of models."""

import os
import subprocess
import sys

from specstream_mlx.user_cache import KERNELS, MEASUREMENTS, MODEL, PRODUCTS, WRAPPER, inventory, prune

CLI = [sys.executable, "-m", "specstream_mlx"]


def _write(path, data=b""):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _stale_builds(cache, gone_include):
    """Builds of another MLX installation (its folder deleted) and of an older source."""
    _write(cache / "native" / "jit-bin-0000dead" / "g++", f'exec g++ -I {gone_include} "$@"\n'.encode())
    _write(cache / "native" / "jit-bin-0000dead" / "pch" / "h.gch", b"x" * 5000)
    _write(cache / "native" / "libspecstream-gemv-000000000000.so", b"y" * 300)
    _write(cache / "jit-tmp-0000dead" / "mlx" / "k.so", b"z" * 700)


def test_inventory_marks_what_is_unused_and_prune_removes_only_that(tmp_path):
    cache = tmp_path / "cache"
    _write(cache / "smollm2" / "config.json", b"{}")
    _write(cache / "smollm2" / "model.safetensors", b"w" * 1000)
    _write(cache / "step_costs.json", b"{}")
    _write(cache / ".smollm2.lock")
    _stale_builds(cache, tmp_path / "deleted-env" / "include")
    live = tmp_path / "env" / "include"
    live.mkdir(parents=True)
    used_bin = cache / "native" / "jit-bin-0000beef"
    _write(used_bin / "g++", f'exec g++ -I {live} "$@"\n'.encode())
    used_kernels = cache / "jit-tmp-0000beef"
    _write(used_kernels / "mlx" / "k.so", b"k" * 10)
    used_gemv = _write(cache / "native" / "libspecstream-gemv-111111111111.so", b"g" * 10)

    entries = inventory(cache, [used_bin, used_kernels, used_gemv, None])
    by_name = {e.path.name: e for e in entries}
    assert ".smollm2.lock" not in by_name
    assert by_name["smollm2"].kind == MODEL and by_name["smollm2"].nbytes == 1002
    assert by_name["step_costs.json"].kind == MEASUREMENTS
    assert by_name["jit-bin-0000dead"].kind == WRAPPER and by_name["jit-bin-0000dead"].gone
    assert by_name["jit-bin-0000beef"].built_for == live and not by_name["jit-bin-0000beef"].gone
    assert by_name["jit-tmp-0000dead"].kind == KERNELS and by_name["jit-tmp-0000dead"].nbytes == 700
    assert by_name["libspecstream-gemv-000000000000.so"].kind == PRODUCTS
    stale = {e.path.name for e in entries if e.prunable}
    assert stale == {"jit-bin-0000dead", "jit-tmp-0000dead", "libspecstream-gemv-000000000000.so"}

    wrapper = len(f'exec g++ -I {tmp_path / "deleted-env" / "include"} "$@"\n')
    assert by_name["jit-bin-0000dead"].nbytes == 5000 + wrapper
    freed, failed = prune(entries)
    assert (freed, failed) == (5000 + wrapper + 300 + 700, [])
    left = {e.path.name for e in inventory(cache, [used_bin, used_kernels, used_gemv])}
    assert left == {
        "smollm2",
        "step_costs.json",
        "jit-bin-0000beef",
        "jit-tmp-0000beef",
        "libspecstream-gemv-111111111111.so",
    }


def test_the_cache_command_keeps_this_installations_builds(tmp_path):
    """End to end: the process's own builds (made in a fresh cache as it starts) survive
    ``--prune``; another installation's go; models and measurements stay."""
    cache = tmp_path / "cache"
    env = {**os.environ, "SPECSTREAM_MLX_CACHE": str(cache)}
    _write(cache / "m" / "config.json", b"{}")
    _write(cache / "step_costs.json", b"{}")
    _stale_builds(cache, tmp_path / "gone")

    r = subprocess.run([*CLI, "cache"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith(f"{cache}: ")
    last = r.stdout.splitlines()[-1]
    assert last.startswith("not in use: 1 kernel header (5.") and last.endswith(
        " KB; 1 for MLX installations that are gone), 1 MLX kernel folder (700 B), 1 product kernel (300 B); "
        "specstream-mlx cache --prune removes them"
    ), r.stdout
    in_use = [line.split()[-3] for line in r.stdout.splitlines() if line.endswith("(in use)")]
    assert all((cache / p).exists() for p in in_use)

    r = subprocess.run([*CLI, "doctor"], capture_output=True, text=True, timeout=120, env=env)
    line = next(x for x in r.stdout.splitlines() if x.startswith("user_cache: "))
    assert line.startswith(f"user_cache: {cache}, ") and line.endswith(
        " KB of native builds not in use (specstream-mlx cache --prune)"
    ), line

    r = subprocess.run([*CLI, "cache", "--prune"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1].startswith("removed 3 builds ("), r.stdout
    assert not (cache / "native" / "jit-bin-0000dead").exists() and not (cache / "jit-tmp-0000dead").exists()
    assert not (cache / "native" / "libspecstream-gemv-000000000000.so").exists()
    assert (cache / "m" / "config.json").exists() and (cache / "step_costs.json").exists()
    assert all((cache / p).exists() for p in in_use)

    r = subprocess.run([*CLI, "cache", "--prune"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "every build here is in use: nothing to remove", r.stdout
