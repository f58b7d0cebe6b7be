"""The modules of `pytest -m quick` (tests/conftest.py marks their tests)."""

# `pytest -m quick`: the core in a few minutes (the model, the cache and its layouts,
# generate and its controls, the engine, checkpoints and the tokenizer, the public types);
# the README's "Tests" gives its measured time. Every module here must exist
# (tests/test_newcomer.py checks), so that the subset cannot shrink unseen.
QUICK = frozenset({
    "test_smoke.py", "test_decoder.py", "test_rope.py", "test_reference.py", "test_cache_length.py",
    "test_int8_cache.py", "test_norm_range.py", "test_generate.py", "test_generate_work.py",
    "test_generate_logprobs.py", "test_processors.py", "test_eos_ids.py",
    "test_per_row_settings.py", "test_streaming.py", "test_hand_loop.py", "test_call_caches.py",
    "test_request_memo.py", "test_generation_config.py", "test_engine.py", "test_serving_pages.py",
    "test_checkpoint.py", "test_checkpoint_damage.py", "test_tokenizer.py", "test_train_errors.py",
    "test_types.py",
})  # fmt: skip
