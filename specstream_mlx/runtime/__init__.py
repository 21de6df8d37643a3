"""Decoding: the KV cache, sampling, the step engines (plain :mod:`.steps`,
Speculative Streaming :mod:`.speculative`, prompt lookup :mod:`.lookup`), drafting and
verification, ``--tree auto`` (:mod:`.autotune`), the loaded model (:mod:`.loaded_model`),
generation (:mod:`.generation`) and multi-turn chat sessions (:mod:`.session`)."""
