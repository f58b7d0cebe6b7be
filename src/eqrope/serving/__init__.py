"""Serving: many requests at once, continuous batching over a paged key/value cache.

The host side (the scheduler, the page pool) is plain Python; the device side is a few
compiled programs over the pool (`_programs.py`). Uses `generation/` and `model/`.
"""

from ._engine import Engine as Engine
from ._processes import dismiss as dismiss, follow as follow, lead as lead
from ._sequence import Completion as Completion, EngineStats as EngineStats, Event as Event
