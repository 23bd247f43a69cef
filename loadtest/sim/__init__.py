"""A simulated GPU replica: OpenAI-compatible, with an HBM / CPU / remote KV cache and real sleeps.

config.py (specs and their sourced defaults), tiers.py (block LRU), engine.py (cache and timing
model), remote.py (the shared remote tier service and its client), protocol.py (OpenAI wire
shapes), server.py (the replica's HTTP app), fleet.py (many replicas in one process, and the CLI).

Nothing is imported here: tests/engine/make_tiny_model.py imports tiny_tokenizer.py from the
engine's own venv, which has none of the gateway's dependencies.
"""
