import os

import pytest

# transformers prints progress bars and advisories we do not need in tests.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Bundled models converted on first use (smollm2) go to a cache of the test run's own,
# never into the user's ~/.cache, and it is removed when the run ends (a converted SmolLM2
# and the run's compiled kernels: some 370 MB).
_OWN_CACHE = None
if "SPECSTREAM_MLX_CACHE" not in os.environ:
    import tempfile

    _OWN_CACHE = os.environ["SPECSTREAM_MLX_CACHE"] = tempfile.mkdtemp(prefix="specstream-test-cache-")


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE is not None:
        import shutil

        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """Factory: variant -> (torch model, HF dir, converted float32 MLX dir); cached."""
    from specstream_mlx.convert import ConvertOptions, convert
    from tests.helpers.hf_reference import make_hf_model

    made = {}

    def get(variant: str):
        if variant not in made:
            root = tmp_path_factory.mktemp(variant)
            tm, src = make_hf_model(variant, root / "hf")
            dst = convert(str(src), str(root / "mlx"), ConvertOptions(dtype="float32"))
            made[variant] = (tm, src, dst)
        return made[variant]

    return get


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A small llama with the byte tokenizer: a complete model directory for CLI tests."""
    from tests.helpers.tiny_models import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def quantized_dir(tmp_path_factory):
    """A tiny model converted to 4-bit in groups of 32, a tied head the same way, with 2 streams:
    depths past 128 (the product kernel's stored tiles serve those)."""
    from specstream_mlx.convert import ConvertOptions, convert
    from specstream_mlx.demo.tiny import make_tiny_model_dir

    dims = dict(hidden_size=160, intermediate_size=320, num_attention_heads=5, num_key_value_heads=1)
    src = make_tiny_model_dir(tmp_path_factory.mktemp("src"), **dims)
    opts = ConvertOptions(dtype="float32", quantize=True, q_bits=4, q_group_size=32, num_streams=2, stream_layers=1)
    return convert(str(src), str(tmp_path_factory.mktemp("q4") / "m"), opts)


@pytest.fixture
def float32_products():
    """The product kernel multiplies weights read as stored by the float32 activations within
    the test (``SPECSTREAM_PRODUCTS=exact``; the default takes 16-bit integer activations,
    docs/DESIGN.md decision 46): for tests of the float32 products' bits."""
    from specstream_mlx.platform_info import set_q8_products

    before = set_q8_products(0)
    yield
    if before:
        set_q8_products(before)
