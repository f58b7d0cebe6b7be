"""The published shapes of two small checkpoints, as plain dicts (no torch, no transformers).

Fields are copied from each model's `config.json` on the hub (nothing is downloaded; the
weights are random wherever these are used). `eqrope_config` turns one into eqrope's config
dict. bench/_real_shapes.py builds transformers' models of these shapes (it needs the
`[hf]` extra); every other bench script, the main job included, reads them from here, so
that it runs with `[dev]` alone.
"""

# huggingface.co/HuggingFaceTB/SmolLM2-135M, config.json (model_type llama); head_dim
# 576 / 9 = 64.
SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
    initializer_range=0.041666666666666664,
)
# huggingface.co/Qwen/Qwen2.5-0.5B, config.json (model_type qwen2); head_dim 896 / 14 = 64.
# The window is off (use_sliding_window false), so sliding_window and max_window_layers
# change nothing.
QWEN25_05B = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
    rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
    use_sliding_window=False, sliding_window=32768, max_window_layers=24,
    initializer_range=0.02,
)


def eqrope_config(fields: dict, *, max_len: int = 2048, n_blocks: int | None = None) -> dict:
    """transformers' config fields (above) as eqrope's config dict (`DecoderConfig`'s
    keywords, which `DecoderConfig.from_dict` reads too); `max_len` only bounds caches,
    `n_blocks` overrides the depth."""
    return dict(
        vocab_size=fields["vocab_size"], d_model=fields["hidden_size"],
        n_heads=fields["num_attention_heads"], n_kv_heads=fields["num_key_value_heads"],
        n_blocks=n_blocks or fields["num_hidden_layers"], d_ff=fields["intermediate_size"],
        max_len=max_len, rope_base=fields["rope_theta"], norm_eps=fields["rms_norm_eps"],
        tie_embeddings=fields["tie_word_embeddings"], head_bias=False,
    )  # fmt: skip
