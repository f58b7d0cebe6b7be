"""Hugging Face `config.json` to `DecoderConfig` and back, for each supported family.

| `model_type` | class | what it adds to Llama |
|---|---|---|
| `llama` | `LlamaForCausalLM` | (`attention_bias`, `mlp_bias`, `head_dim`) |
| `mistral` | `MistralForCausalLM` | `sliding_window` on every layer |
| `qwen2` | `Qwen2ForCausalLM` | q/k/v biases; a window on the layers `layer_types` names |
| `qwen3` | `Qwen3ForCausalLM` | q/k RMSNorm, `head_dim` (default 128), `attention_bias` |

A key the file leaves out takes the default of the family's transformers config class
(`LlamaConfig`, `MistralConfig`, `Qwen2Config`, `Qwen3Config`: `_DEFAULTS`), so a Mistral
config without `sliding_window` has transformers' window of 4096. Every field read is
checked for type and range under its key in the file, and a field eqrope cannot honour
raises a `ValueError` naming it and the file.
"""

from ..model._attention_options import AttentionOptions
from .._checks import check_bool, check_int
from ..model._config import DecoderConfig
from ._hf_rope import check_above, read_rope, valid, write_rope


ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# The value transformers' config class gives each key eqrope reads when config.json leaves
# it out (the class attributes of `LlamaConfig`, ... in transformers 5). `None` for
# `head_dim` means `hidden_size // num_attention_heads`, for `num_key_value_heads`
# `num_attention_heads`, for `sliding_window` no window. Qwen2 has no `head_dim` (its
# attention takes the key when present, as here); Mistral and Qwen2 no `attention_bias`.
_LLAMA_DEFAULTS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
    "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "mlp_bias": False,
}  # fmt: skip
_QWEN_DEFAULTS = {
    **_LLAMA_DEFAULTS, "vocab_size": 151936, "intermediate_size": 22016,
    "num_key_value_heads": 32, "max_position_embeddings": 32768,
    "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
    "layer_types": None,
}  # fmt: skip
_DEFAULTS = {
    "llama": _LLAMA_DEFAULTS,
    "mistral": {
        **_LLAMA_DEFAULTS, "intermediate_size": 14336, "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32, "sliding_window": 4096,
    },
    "qwen2": _QWEN_DEFAULTS,
    "qwen3": {**_QWEN_DEFAULTS, "head_dim": 128},
}  # fmt: skip


def decoder_config(hf: dict, source: str, dtype_name: str, max_len: int | None) -> DecoderConfig:
    """The [`eqrope.DecoderConfig`][] of a Hugging Face `config.json` dict.

    `max_len`: the model's length (its default cache length); `None` means the config's
    `max_position_embeddings`, which bounds it.
    """
    family = hf.get("model_type")
    if not isinstance(family, str) or family not in ARCHITECTURES:
        raise ValueError(
            f"from_hf: {source} has model_type={family!r}; eqrope reads "
            f"{', '.join(repr(f) for f in ARCHITECTURES)} checkpoints "
            f"({', '.join(ARCHITECTURES.values())})."
        )
    hf = {**_DEFAULTS[family], **hf}  # the keys the file leaves out, as transformers fills them

    def need(name):
        if hf.get(name) is None:
            raise ValueError(
                f"from_hf: {source} has no field {name!r}: it is null, and a {family} config "
                f"needs a value (leave the key out for transformers' default, "
                f"{_DEFAULTS[family][name]!r})."
            )
        return hf[name]

    def size(name, value=None):
        return valid(check_int, need(name) if value is None else value, name, source, minimum=1)

    def flag(name):
        return valid(check_bool, hf[name], name, source)

    def refuse(name, why):
        raise ValueError(
            f"from_hf: {source} has {name}={hf.get(name)!r}, which eqrope cannot honour: {why}"
        )

    if hf["hidden_act"] != "silu":
        refuse("hidden_act", "eqrope's SwiGLU gates with silu, as these families do.")
    d_model, n_heads, n_blocks = size("hidden_size"), size("num_attention_heads"), size("num_hidden_layers")
    head_dim = None if hf["head_dim"] is None else size("head_dim")
    if head_dim is None and d_model % n_heads != 0:
        refuse("num_attention_heads", f"it does not divide hidden_size={d_model}.")
    if (head_dim or d_model // n_heads) % 2 != 0:
        refuse(
            "head_dim" if head_dim else "num_attention_heads",
            f"the head width {head_dim or f'hidden_size // num_attention_heads = {d_model // n_heads}'} "
            "is odd, and rotary embeddings rotate pairs of dimensions.",
        )
    positions = size("max_position_embeddings")
    if max_len is None:
        max_len = positions
    elif max_len > positions:
        raise ValueError(
            f"from_hf: max_len={max_len} is more than the checkpoint's "
            f"max_position_embeddings={positions} ({source}); pass at most {positions}."
        )
    attention_bias = flag("attention_bias")
    mlp_bias = flag("mlp_bias") if family == "llama" else False
    if family in ("mistral", "qwen2") and attention_bias:
        refuse("attention_bias", f"{family} has no such option in transformers.")
    if mlp_bias and not attention_bias:
        refuse("mlp_bias", "eqrope puts feed-forward biases only beside attention biases.")
    attention = AttentionOptions(
        head_dim=head_dim,
        qkv_bias=family == "qwen2" or (attention_bias and not mlp_bias),
        out_bias=attention_bias and not mlp_bias,
        qk_norm=family == "qwen3",
        **_window(hf, family, n_blocks, source),
    )
    n_kv_heads = n_heads if hf["num_key_value_heads"] is None else size("num_key_value_heads")
    if n_heads % n_kv_heads != 0:
        refuse(
            "num_key_value_heads",
            f"it does not divide num_attention_heads={n_heads}; each key/value head serves "
            "a whole group of query heads.",
        )
    fields = dict(
        vocab_size=size("vocab_size"),
        d_ff=size("intermediate_size"),
        **read_rope(hf, source, positions),
        norm_eps=valid(check_above, hf["rms_norm_eps"], "rms_norm_eps", source),
        tie_embeddings=flag("tie_word_embeddings"),
    )
    try:
        return DecoderConfig(
            d_model=d_model,
            n_heads=n_heads,
            n_blocks=n_blocks,
            max_len=max_len,
            n_kv_heads=n_kv_heads,
            attention=attention,
            bias=mlp_bias,
            head_bias=False,
            dtype=dtype_name,
            **fields,
        )
    except ValueError as e:  # every field was checked above under its key; a bug if reached
        raise ValueError(f"from_hf: {source} does not give a valid eqrope config: {e}") from None


def _window(hf: dict, family: str, n_blocks: int, source: str) -> dict:
    """`window` and `window_blocks` from `sliding_window`, `use_sliding_window`,
    `max_window_layers` and `layer_types`, as transformers reads them."""
    if family == "llama":
        return {}
    window = hf["sliding_window"]
    if family in ("qwen2", "qwen3") and not valid(
        check_bool, hf["use_sliding_window"], "use_sliding_window", source
    ):
        window = None
    window = None if window is None else valid(check_int, window, "sliding_window", source, minimum=1)
    kinds = hf.get("layer_types")
    if kinds is None:
        if window is None or family == "mistral":
            return dict(window=window)
        first = valid(check_int, hf["max_window_layers"], "max_window_layers", source, minimum=0)
        kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(n_blocks)]
    if (
        not isinstance(kinds, list)
        or len(kinds) != n_blocks
        or not all(k in ("sliding_attention", "full_attention") for k in kinds)
    ):
        raise ValueError(
            f"from_hf: {source} has layer_types={kinds!r}; eqrope reads a list of "
            f"{n_blocks} entries, each 'sliding_attention' or 'full_attention'."
        )
    blocks = tuple(i for i, k in enumerate(kinds) if k == "sliding_attention")
    if not blocks:
        return dict(window=None)
    if window is None:
        raise ValueError(
            f"from_hf: {source} has sliding_attention layers but no sliding_window; set it."
        )
    return dict(window=window, window_blocks=None if len(blocks) == n_blocks else blocks)


def family_of(c: DecoderConfig) -> str:
    """The Hugging Face family that expresses `c`, or a `ValueError` saying why none does."""
    a = c.attention
    wanted = {
        "norm": ("rms", "these families normalise with RMSNorm"),
        "mlp": ("swiglu", "their feed-forward layer is SwiGLU"),
        "positions": ("rope", "they have rotary positions, not a learned table"),
    }
    for field, (value, why) in wanted.items():
        if getattr(c, field) != value:
            raise ValueError(
                f"to_hf: the model has {field}={getattr(c, field)!r}; {why}, so it cannot be "
                f"written as a Hugging Face checkpoint. Only models with {field}={value!r} can."
            )
    if c.bias and (a.qk_norm or a.window is not None):
        raise ValueError(
            "to_hf: bias=True (feed-forward biases) exists only in Llama, which has no q/k "
            "norms and no sliding window; such a model has no Hugging Face family."
        )
    if a.qk_norm:
        if c.has_qkv_bias != c.has_out_bias:
            raise ValueError(
                "to_hf: a model with q/k norms is a Qwen3, whose attention_bias puts biases "
                "on q, k, v and the output together; set qkv_bias and out_bias alike."
            )
        return "qwen3"
    if c.has_qkv_bias and not c.has_out_bias:
        return "qwen2"
    if a.window is not None:
        if c.has_qkv_bias or a.window_blocks is not None:
            raise ValueError(
                "to_hf: a sliding window on some blocks only (or with attention biases) is "
                "expressed by Qwen2 (q/k/v biases) or Qwen3 (q/k norms); this model has "
                "neither, and Mistral windows every block without biases."
            )
        return "mistral"
    if c.has_out_bias and not c.has_qkv_bias:
        raise ValueError("to_hf: an output bias without q/k/v biases has no Hugging Face family.")
    return "llama"


def hf_config(c: DecoderConfig) -> dict:
    """The Hugging Face config dict of `c`; `decoder_config` reads `c` back."""
    family = family_of(c)
    rope = write_rope(c)
    a = c.attention
    out = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "intermediate_size": c.d_ff,
        "num_hidden_layers": c.n_blocks,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.max_len,
        "hidden_act": "silu",
        "rms_norm_eps": c.norm_eps,
        # transformers >= 5 reads `rope_parameters`; older versions `rope_theta`/`rope_scaling`.
        "rope_parameters": rope,
        "rope_theta": c.rope_base,
        "rope_scaling": None if c.rope_scaling is None else rope,
        "tie_word_embeddings": c.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": c.dtype,
    }
    if family in ("llama", "qwen3"):
        out["attention_bias"] = c.has_out_bias
    if family == "llama":
        out["mlp_bias"] = c.bias
    if family == "mistral":
        out["sliding_window"] = a.window
    if family in ("qwen2", "qwen3"):
        windowed = a.windowed(c.n_blocks)
        out["use_sliding_window"] = a.window is not None
        out["sliding_window"] = a.window
        out["max_window_layers"] = windowed.index(True) if any(windowed) else c.n_blocks
        out["layer_types"] = ["sliding_attention" if w else "full_attention" for w in windowed]
    return out
