"""bench/kv_cache.py, sections 1 to 4: what generation takes with the cache and without.

1. the seed's protocol (cached against uncached, the seed's JSON keys);
2. the textbook chapter's growth protocol (seconds to generate N tokens);
3. time to first token: one-pass `model.prefill` against feeding the prompt token by token;
4. tokens/s for a batch of prompts.

Each section is a function of the mode's settings (`cfg`, see `kv_cache.MODES`) that
returns its JSON record. The uncached path is [`eqrope.testing.Uncached`][]: the model
as a field (not a closure), so its weights are arguments of the compiled program, as on
the cached path.
"""

import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqrope
import eqrope.testing
from _roofline import fresh_cache
from _timing import log, time_call, without_result


from eqrope.generation._uncached import uncached_bucket  # descriptive only


# The seed's protocol; identical in every mode except --tiny, which shortens it.
SEED_MODEL = eqrope.DecoderConfig(vocab_size=65, d_model=64, n_heads=4, n_blocks=2, max_len=256)

CACHED_DESCRIPTION = (
    "eqrope.generate on the RotaryDecoder with default arguments: one eqx.filter_jit "
    "program that prefills the prompt in chunks of 64 and then decodes one token per "
    "iteration with the static cache in the carry, stopping when every row is done; the "
    "cache has the smallest power of two (at least 16) of rows that holds prompt and "
    "max_new, capped by the model's max_len; max_new is traced, so it compiles once per "
    "(cache length, batch)."
)


def model_record(model) -> dict:
    return {"config": model.config.to_dict(), "params": eqrope.count_params(model)}


def uncached_buckets(text_lengths, max_len: int) -> list[int]:
    """The padded widths the uncached path runs at, for texts of these lengths."""
    return sorted({uncached_bucket(n, max_len) for n in text_lengths})


def uncached_description(prompt_len: int, max_new: int, max_len: int) -> dict:
    lengths = range(prompt_len, min(prompt_len + max_new, max_len))
    return {
        "how": (
            "eqrope.generate on eqrope.testing.Uncached (an eqx.Module with only __call__, "
            "max_len and vocab_size) takes the uncached path: a Python loop over new "
            "tokens; at every token the whole text so far is right-padded with zeros to "
            "the next power of two (at least 16, at most max_len) and run through "
            "model(ids) by an eqx.filter_jit function, so it compiles once per padded "
            "width; the last real position's logits go to a jax.jit greedy sampler and the "
            "token back to the host. Nothing is reused between tokens."
        ),
        "padded_widths": uncached_buckets(lengths, max_len),
        "compiled": "once per padded width (eqx.filter_jit), reused across calls",
    }


# -- 1. the seed's protocol ------------------------------------------------------------------


def seed_protocol(cfg: dict) -> dict:
    model = eqrope.RotaryDecoder.from_config(SEED_MODEL, key=jax.random.PRNGKey(0))
    plain = eqrope.testing.Uncached(model)  # one instance, reused: so are its compiled widths
    prompt = jnp.arange(8, dtype=jnp.int32)
    new = cfg["seed_new"]
    cache = time_call(lambda: eqrope.generate(model, prompt, new), repeats=cfg["seed_repeats"])
    no_cache = time_call(lambda: eqrope.generate(plain, prompt, new), repeats=cfg["seed_repeats"])
    same = bool(np.array_equal(np.asarray(cache["result"]), np.asarray(no_cache["result"])))
    return {
        "cache": without_result(cache),
        "no_cache": without_result(no_cache),
        "speedup_median": no_cache["median_s"] / cache["median_s"],
        "seed": {
            **model_record(model),
            "key": 0,
            "prompt": np.asarray(prompt).tolist(),
            "max_new": new,
            "sampling": "greedy (temperature 0)",
            "identical_tokens": same,
            "tokens": np.asarray(cache["result"]).tolist(),
            "cached_path": CACHED_DESCRIPTION,
            "uncached_path": uncached_description(8, new, model.max_len),
            "first_call_ratio_vs_seed": cache["first_s"] / 0.794,
            "per_token_s": {"cache": cache["median_s"] / new, "no_cache": no_cache["median_s"] / new},
            "seed_measured": {"cache": {"first_s": 0.794, "median_s": 0.055},
                              "no_cache": {"first_s": 2.258, "median_s": 1.383},
                              "speedup_median": 25.0},
        },
    }


# -- 2. the growth protocol ------------------------------------------------------------------


def growth_protocol(cfg: dict, model) -> dict:
    plain = eqrope.testing.Uncached(model)
    prompt = jnp.arange(cfg["growth_prompt"], dtype=jnp.int32)
    max_len = model.max_len
    # Warm-up. The cached program compiles once per cache length (a power of two holding
    # the prompt and N): time_call's warm-up call compiles each N's. The uncached path
    # compiles once per padded width: one generated token from a prompt of each width's
    # length compiles (and runs) that width once.
    texts = range(cfg["growth_prompt"], cfg["growth_prompt"] + max(cfg["uncached_n"]))
    widths = uncached_buckets(texts, max_len)
    start = time.perf_counter()
    for width in widths:
        eqrope.generate(plain, jnp.zeros((min(width, max_len - 1),), jnp.int32), 1)
    uncached_warmup = time.perf_counter() - start

    cached, uncached = {}, {}
    for n in cfg["growth_n"]:
        t = time_call(lambda: eqrope.generate(model, prompt, n), repeats=cfg["growth_repeats"])
        cached[n] = t
        log(f"  growth cached N={n}: {t['median_s']:.3f} s")
    for n in cfg["uncached_n"]:
        # Every width is compiled above, so the first call is already a timed repeat.
        t = time_call(lambda: eqrope.generate(plain, prompt, n),
                      repeats=cfg["uncached_repeats"], warmup=0)
        uncached[n] = t
        log(f"  growth uncached N={n}: {t['median_s']:.3f} s")
    identical = {
        str(n): bool(np.array_equal(np.asarray(cached[n]["result"]), np.asarray(uncached[n]["result"])))
        for n in uncached
    }

    def ratio(times, a, b):
        return times[a]["median_s"] / times[b]["median_s"] if a in times and b in times else None

    hi = max(cfg["growth_n"])
    lo = hi // 2
    return {
        **model_record(model),
        "note": (
            "eqrope defaults (RMSNorm, SwiGLU, no biases): the chapter's 3,290,880 "
            "parameters are the same sizes with norm='layer', mlp='gelu', bias=True."
        ),
        "prompt_len": cfg["growth_prompt"],
        "n": list(cfg["growth_n"]),
        "cached": {str(n): without_result(t) for n, t in cached.items()},
        "uncached": {str(n): without_result(t) for n, t in uncached.items()},
        "uncached_warmup_s": uncached_warmup,
        "uncached_padded_widths": widths,
        "identical_tokens": identical,
        "ratio_hi_lo": {"hi": hi, "lo": lo, "cached": ratio(cached, hi, lo),
                        "uncached": ratio(uncached, hi, lo)},
        "speedup": {str(n): uncached[n]["median_s"] / cached[n]["median_s"] for n in uncached},
        "chapter": {"ratio_512_256": {"uncached": 3.9, "cached": 2.2}, "speedup_512": 8.5},
    }


# -- 3. prefill against token by token -------------------------------------------------------


@eqx.filter_jit
def first_token_prefill(model, ids):
    """One pass over the prompt into a fresh cache; the greedy first token and the cache."""
    logits, cache = model.prefill(ids, model.init_cache(), 0, check=False)
    return jnp.argmax(logits[-1]), cache


@eqx.filter_jit
def first_token_scan(model, ids):
    """The prompt one token at a time (a lax.scan of `model.step`) into a fresh cache."""

    def body(cache, xs):
        token, pos = xs
        logits, cache = model.step(token, cache, pos, check=False)
        return cache, logits

    positions = jnp.arange(ids.shape[0], dtype=jnp.int32)
    cache, logits = jax.lax.scan(body, model.init_cache(), (ids, positions))
    return jnp.argmax(logits[-1]), cache


def prefill_protocol(cfg: dict, model, step) -> dict:
    """`step` is `_roofline.make_step(model)[0]`, compiled beforehand (donated cache)."""
    out = {}
    for length in cfg["prefill_lengths"]:
        ids = jnp.arange(length, dtype=jnp.int32) % model.vocab_size
        tokens = [ids[i] for i in range(length)]
        positions = [jnp.asarray(i, jnp.int32) for i in range(length)]

        def loop():
            cache = fresh_cache(model)
            for token, pos in zip(tokens, positions):
                logits, cache = step(token, pos, cache)
            return jnp.argmax(logits), cache

        reps = cfg["prefill_repeats"]
        one = time_call(lambda: first_token_prefill(model, ids), repeats=reps)
        scan = time_call(lambda: first_token_scan(model, ids), repeats=reps)
        python = time_call(loop, repeats=max(1, reps // 2), warmup=0)  # step compiled before
        same = {int(one["result"][0]), int(scan["result"][0]), int(python["result"][0])}
        best = min(scan["median_s"], python["median_s"])
        out[str(length)] = {
            "prefill": without_result(one),
            "token_by_token_scan": without_result(scan),
            "token_by_token_loop": without_result(python),
            "speedup_scan": scan["median_s"] / one["median_s"],
            "speedup_loop": python["median_s"] / one["median_s"],
            "speedup_best": best / one["median_s"],
            "same_first_token": len(same) == 1,
        }
        log(f"  prefill {length}: {one['median_s'] * 1e3:.2f} ms vs scan "
            f"{scan['median_s'] * 1e3:.2f} ms, loop {python['median_s'] * 1e3:.2f} ms")
    return {
        "lengths": list(cfg["prefill_lengths"]),
        "method": (
            "time to first token (greedy) on the growth model, into a fresh cache made "
            "inside the timed call: 'prefill' is one eqx.filter_jit call of "
            "model.prefill(prompt, cache, 0, check=False) and argmax of the last logits; "
            "'token_by_token_scan' is one eqx.filter_jit program with a lax.scan of "
            "model.step(token, cache, pos, check=False) over the prompt; "
            "'token_by_token_loop' is a Python loop of a jax.jit model.step with the cache "
            "donated, one dispatch per token. 'speedup_best' (the target) divides the faster "
            "of the two token-by-token times by the prefill time."
        ),
        "by_length": out,
    }


# -- 4. batch --------------------------------------------------------------------------------


def batch_protocol(cfg: dict, model) -> dict:
    out = {}
    prompt_len = cfg["growth_prompt"]
    new = cfg["batch_new"]
    for batch in cfg["batches"]:
        rows = (jnp.arange(prompt_len, dtype=jnp.int32)[None, :]
                + jnp.arange(batch, dtype=jnp.int32)[:, None]) % model.vocab_size
        # One call compiles (the cache length follows prompt and max_new, so the same
        # max_new); the timed calls follow.
        compiled = time_call(lambda: eqrope.generate(model, rows, new), repeats=1)
        t = time_call(lambda: eqrope.generate(model, rows, new),
                      repeats=cfg["batch_repeats"], warmup=0)
        t["first_s"], t["first_compile"] = compiled["first_s"], compiled["first_compile"]
        generated = int(np.asarray(t["result"]).shape[0]) * new
        out[str(batch)] = {
            **without_result(t),
            "new_tokens": generated,
            "tokens_per_s": generated / t["median_s"],
            "cache_nbytes": eqrope.cache_nbytes(model, batch=batch),
        }
        log(f"  batch {batch}: {generated / t['median_s']:.0f} tokens/s")
    return {
        "batches": list(cfg["batches"]),
        "prompt_len": prompt_len,
        "new_per_row": new,
        "method": (
            "eqrope.generate with a (batch, prompt_len) prompt, greedy, each row "
            "new_per_row tokens; the time includes the prefill. The program is compiled by "
            "a first call of the same job (first_s); every timed call is a repeat"
        ),
        "by_batch": out,
    }
