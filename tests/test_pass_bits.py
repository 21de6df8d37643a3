"""A speculative pass's main rows are a plain step's bits (docs/DESIGN.md decision 1).

The product kernel adds a row's outputs in one order whatever the product's rows, attention's
scores (query rows by one head's keys) included, so a tree pass's logits along the accepted
path are exactly the plain steps' logits: greedy speculative decoding reproduces plain
decoding bit for bit, ties included.
"""

from functools import partial

import mlx.core as mx
import numpy as np
import pytest

from specstream_mlx.io.loading import load_model
from specstream_mlx.method.msa import ss_forward
from specstream_mlx.method.streams import StreamConfig, new_streams
from specstream_mlx.method.tree import Tree
from specstream_mlx.models.fusion import fuse_projections
from specstream_mlx.platform_info import skinny_kernel
from specstream_mlx.runtime.attention_choice import set_attention_form
from specstream_mlx.runtime.cache import make_cache
from specstream_mlx.runtime.compiled_pass import SSPass
from specstream_mlx.runtime.plain_step import plain_step
from specstream_mlx.runtime.steps import prefill
from tests.helpers import KERNEL_NOT_LOADED
from tests.test_speculative import pretend_trained


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def test_attention_scores_give_a_row_the_same_bits_in_any_product():
    """Query rows by one head's keys (the product stored (keys x head dim), a thin operand): each
    row's scores are the same bits in a product of 1 to 48 rows as alone, at head dimensions
    of 16 to 128 and key counts that fill no block evenly. The kernel once multiplied 4 rows
    or more by keys transposed into a buffer, in another order than one row: a tree pass's
    scores then differed from a plain step's in their last bits."""
    if skinny_kernel() is None:
        pytest.fail(KERNEL_NOT_LOADED)
    rng = np.random.default_rng(0)
    for depth in (16, 64, 128):
        for keys in (7, 40, 193, 1000):
            k = mx.array(rng.standard_normal((keys, depth)).astype(np.float32))
            q = rng.standard_normal((48, depth)).astype(np.float32)
            alone = np.concatenate([np.array(mx.array(q[i : i + 1]) @ k.T) for i in range(48)])
            for m in (2, 3, 4, 9, 27, 48):
                together = np.array(mx.array(q[:m]) @ k.T)
                assert np.array_equal(_bits(together), _bits(alone[:m])), (depth, keys, m)


@pytest.mark.parametrize("attention", ["composed", "fused"])
@pytest.mark.parametrize("compiled", [False, True])
def test_a_pass_gives_the_plain_steps_logits_bit_for_bit(hf_models, attention, compiled):
    """After the same prompt, a pass over a chain, a branching tree and a 9-node tree (streams at
    every node or at none), op by op or compiled, gives at each node of the accepted path the
    logits that plain decoding's compiled step gives at that position, bit for bit, in either
    attention form."""
    if skinny_kernel() is None:
        pytest.fail(KERNEL_NOT_LOADED)
    _, _, dst = hf_models("mistral")  # a head dimension of 16: the kernel's vector width
    base = load_model(dst)[0]
    fuse_projections(base)  # q/k/v and gate/up as decoding runs them
    set_attention_form(base, attention)
    streams = pretend_trained(new_streams(base, StreamConfig(num_streams=3, stream_layers=2, lora_rank=4)))
    prompt = mx.array(np.random.RandomState(3).randint(3, 151, size=40).astype(np.int32))

    def fresh():
        cache = make_cache(base)
        prefill(base, prompt[:-1], cache, 512)
        return cache

    forward = SSPass(base, streams, compiled=True) if compiled else partial(ss_forward, base, streams)
    step, cache = plain_step(base), fresh()
    offset = cache[0].offset
    tokens, want = [int(prompt[-1].item())], []
    for _ in range(3):  # the greedy path, as `ar` decodes it
        logits = np.array(step(mx.array([tokens[-1]]), cache).astype(mx.float32)).reshape(-1)
        want.append(logits)
        tokens.append(int(logits.argmax()))
    t0, t1, t2, _ = tokens
    x = 150 if 150 not in tokens else 149  # a token off the path
    trees = [
        (Tree((t0, t1, t2), (-1, 0, 1)), [0, 1, 2]),
        (Tree((t0, x, t1, x, t2, x), (-1, 0, 0, 1, 2, 2)), [0, 2, 4]),
        (Tree((t0, x, x - 1, t1, x, x - 1, x - 2, t2, x), (-1, 0, 0, 0, 1, 2, 3, 3, 3)), [0, 3, 7]),
    ]
    for tree, path in trees:
        for hosts in (None, np.zeros(0, dtype=np.int64)):
            out = forward(tree, offset, fresh(), 0.0, None, hosts)
            got = np.array(out.main_logits.astype(mx.float32)).reshape(len(tree), -1)
            for depth, node in enumerate(path):
                assert np.array_equal(_bits(got[node]), _bits(want[depth])), (tree.parents, hosts, depth)
