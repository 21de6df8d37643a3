"""Speculative Streaming itself: stream parameters and their files (:mod:`.streams`),
the speculative pass with multi-stream attention (:mod:`.msa`), draft trees
(:mod:`.tree`) and verification rules (:mod:`.acceptance`). Depends on ``models`` only."""
