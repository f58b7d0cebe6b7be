"""Speculative decoding: drafts from a small model or from the prompt, checked in one target pass.

`_round.py` is the program; drafting, prompt lookup and the acceptance rules are its parts.
"""

from ._prompt_lookup import PromptLookup as PromptLookup
