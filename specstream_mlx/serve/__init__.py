"""Serving a model to other programs: JSON lines over stdio (:mod:`.stdio`) and
an OpenAI-compatible HTTP server (:mod:`.http`), sharing one request
representation and one set of validators (:mod:`.protocol`)."""
