"""The OpenAI-compatible HTTP server on `eqrope.Engine`: `python -m eqrope.serve DIR`.

Starlette routes (`_app.py`) over a `Server` (`_server.py`) whose engine runs on a thread
of its own (`_worker.py`). Needs the `[serve]` extra.
"""

from ._app import build_app as build_app
from ._server import Server as Server
