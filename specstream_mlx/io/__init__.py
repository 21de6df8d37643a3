"""Model directories on disk: finding them (paths, bundled names, hub ids),
loading base weights, speculative streams and tokenizers, and the files a
model directory is made of. Depends on ``models`` and ``method`` only."""
