"""The OpenAI-compatible HTTP server on `eqrope.Engine`: `python -m eqrope.serve DIR`.

Starlette routes (`_app.py`) over a `Server` (`_server.py`) whose engine runs on a thread
of its own (`_worker.py`). The HTTP parts need the `[serve]` extra; this package imports
nothing itself, so that its host-side pieces (`_text.py`, `_logprobs.py`) import without
it.
"""
