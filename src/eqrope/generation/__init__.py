"""Generation: a checked request, one compiled program (prefill, then a decode loop), the result.

Sampling, logits processors, stop sequences and streaming sit beside it; `speculative/` drafts.
"""

from ._automaton import Automaton as Automaton
from ._generate import TruncationWarning as TruncationWarning, generate as generate
from ._result import Generation as Generation
from ._stop_strings import StopStrings as StopStrings
from ._generation_config import GenerationConfig as GenerationConfig
from .speculative import PromptLookup as PromptLookup
