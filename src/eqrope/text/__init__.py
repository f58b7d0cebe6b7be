"""Text in, text out: the tokenizer (with chat templates) and `generate_text` around `generate`.

Reads a checkpoint's tokenizer files; no transformers needed.
"""

from ._details import TextGeneration as TextGeneration
from ._generate_text import generate_text as generate_text
from ._tokenizer import Tokenizer as Tokenizer
