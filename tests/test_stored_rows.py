"""Up to how many rows quantized weights are read as stored (runtime/stored_rows.py)."""

import gc
import json

import mlx.core as mx
import numpy as np
import pytest

from specstream_mlx.platform_info import set_q8_products, skinny_kernel
from specstream_mlx.runtime import step_costs, stored_rows, stored_weights
from specstream_mlx.runtime.loaded_model import load
from specstream_mlx.runtime.step_costs import model_key
from tests.helpers import KERNEL_NOT_LOADED


def _times(pairs):
    """{rows: {"stored": s, "float32": f}} from {rows: (s, f)}."""
    return {r: {"stored": s, "float32": f} for r, (s, f) in pairs.items()}


def test_the_limit_is_the_row_count_before_float32_wins_twice_running():
    """The float32 weight is taken from the first of two row counts running where it was the
    faster; a single win (noise) moves nothing; never faster: every row count stored."""
    limits = stored_rows.limits_from(
        {
            4: _times({2: (1, 3), 3: (2, 3), 4: (3, 2.9), 5: (3, 3.5), 6: (4, 3.9), 7: (5, 4)}),
            8: _times({2: (1, 3), 3: (2, 3), 4: (3, 4)}),
            16: _times({2: (3, 2), 3: (4, 3)}),
        }
    )
    assert limits == {4: 5, 8: stored_rows.ALL_ROWS, 16: 1}


def test_the_setting_is_auto_or_a_row_count(monkeypatch):
    monkeypatch.delenv("SPECSTREAM_STORED_ROWS", raising=False)
    assert stored_rows.configured_rows() is None
    monkeypatch.setenv("SPECSTREAM_STORED_ROWS", "7")
    assert stored_rows.configured_rows() == 7
    monkeypatch.setenv("SPECSTREAM_STORED_ROWS", "500")
    assert stored_rows.configured_rows() == stored_rows.ALL_ROWS
    monkeypatch.setenv("SPECSTREAM_STORED_ROWS", "some")
    with pytest.raises(ValueError, match="SPECSTREAM_STORED_ROWS='some': expected auto or a row count"):
        stored_rows.configured_rows()


def test_products_past_the_limit_read_the_float32_weight_with_the_same_bits(
    quantized_dir, monkeypatch, float32_products
):
    """With a limit of 3 rows, a 3-row product reads the stored form and a 4-row one the float32
    weight (the kernel serves nothing from the stored form), each the same bits as with the
    float32 weights throughout (SPECSTREAM_STORED=0); the limit is kept on the registration and
    named in the pass costs' key."""
    if skinny_kernel() is None:
        pytest.fail(KERNEL_NOT_LOADED)
    monkeypatch.setenv("SPECSTREAM_STORED", "0")
    plain, _ = load(str(quantized_dir), warn=False)
    prompts = {n: mx.array([list(range(5, 5 + n))]) for n in (3, 4)}
    want = {n: np.array(plain.base(p)[0]) for n, p in prompts.items()}
    del plain
    gc.collect()
    monkeypatch.delenv("SPECSTREAM_STORED")
    monkeypatch.setenv("SPECSTREAM_STORED_ROWS", "3")
    model, _ = load(str(quantized_dir), warn=False)
    assert stored_rows.row_limits(model.base).by_bits == {4: 3}
    assert stored_rows.row_limits(model.base).label() == "4-bit up to 3 rows"
    for n, p in prompts.items():
        served = stored_weights.served()
        got = np.array(model.base(p)[0])
        assert (stored_weights.served() > served) == (n <= 3), n
        assert np.array_equal(got.view(np.uint32), want[n].view(np.uint32)), n
    key = model_key(model.base, model.streams, "greedy", False)
    stored_rows.limit_stored_rows(model.base, setting=stored_rows.ALL_ROWS)  # set again, in process
    served = stored_weights.served()
    mx.eval(model.base(prompts[4]))
    assert stored_weights.served() > served
    assert stored_rows.row_limits(model.base).label() == "4-bit at every row count"
    assert model_key(model.base, model.streams, "greedy", False) != key  # passes cost otherwise
    key = model_key(model.base, model.streams, "greedy", False)
    monkeypatch.setattr(step_costs, "kernel_version", lambda: "another")
    assert model_key(model.base, model.streams, "greedy", False) != key  # and under another kernel


def test_measured_limits_are_kept_per_machine_and_model(quantized_dir, monkeypatch, tmp_path, float32_products):
    """`auto` measures once (announced), keeps the verdict in the user cache and reads it back in
    the next load without measuring (a kernel of another version measures again); a real
    measurement times every row count up to two float32 wins running, leaves every weight read
    as stored and the caller's random state as it was."""
    if skinny_kernel() is None:
        pytest.fail(KERNEL_NOT_LOADED)
    monkeypatch.setenv("SPECSTREAM_MLX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECSTREAM_STORED_ROWS", "5")  # a row count is not measured, nor kept
    model, _ = load(str(quantized_dir), warn=False)
    assert not (tmp_path / "cache" / "stored_rows.json").exists()
    monkeypatch.delenv("SPECSTREAM_STORED_ROWS")
    reg = stored_weights.registration(model.base)
    calls, said = [], []

    def measure(r):
        calls.append(r)
        return {4: _times({2: (1, 2), 3: (2, 2.5), 4: (3, 2), 5: (4, 3)})}

    assert stored_rows.measured_limits(reg, measure, log=said.append) == {4: 3}
    assert stored_rows.measured_limits(reg, measure, log=said.append) == {4: 3}
    # Measured with integer activations off, the limits serve every activation setting: a
    # process that multiplies by 16- or 8-bit activations reads them back too.
    for planes in (2, 1):
        set_q8_products(planes)
        assert stored_rows.measured_limits(reg, measure, log=said.append) == {4: 3}
    set_q8_products(0)
    assert len(calls) == 1 and len(said) == 1 and "once" in said[0]
    store = tmp_path / "cache" / "stored_rows.json"
    table = json.loads(store.read_text())
    for damaged in ({"4": "many"}, {"4": 0}, {"8": 3}):  # not a count, no rows, another width
        for entry in table.values():
            entry["limits"] = damaged
        store.write_text(json.dumps(table))
        assert stored_rows.measured_limits(reg, measure) == {4: 3}  # measured again
    assert len(calls) == 4
    # The verdict holds for the kernel that was timed: another version of it measures afresh.
    monkeypatch.setattr(stored_rows, "kernel_version", lambda: "another")
    assert stored_rows.measured_limits(reg, measure) == {4: 3}
    assert len(calls) == 5
    mx.random.seed(7)
    want = np.array(mx.random.normal((4,)))
    mx.random.seed(7)
    times = stored_rows.time_forms(reg, reps=1)
    # The measurement draws its rows from keys of its own: a caller's seeded draws go on as before.
    assert np.array_equal(np.array(mx.random.normal((4,))), want)
    counts = sorted(times[4])
    assert counts == list(stored_rows.LADDER[: len(counts)]) and all(t["stored"] > 0 for t in times[4].values())
    served = stored_weights.served()
    mx.eval(model.base(mx.array([list(range(5, 5 + stored_rows.LADDER[-1]))])))
    assert stored_weights.served() > served  # the measurement left every row count stored
