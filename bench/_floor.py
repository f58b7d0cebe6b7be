"""The floor: the least code that decodes eqrope's model, timed beside `eqrope.generate`.

A minimal JAX decoder of `RotaryDecoder`'s architecture (embedding; pre-norm blocks of
RMSNorm, causal attention with RoPE on interleaved pairs of q and k, residual, RMSNorm,
SwiGLU, residual; final RMSNorm; head with bias), as gpt-fast writes one: a single
`jax.jit`, full-cache masked attention over a static cache, a prefill and then a
`lax.scan` of greedy steps, no checks. It reads eqrope's arrays, so its greedy tokens
must equal eqrope's; what eqrope costs above it is the price of its generality.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import eqrope
from _timing import log, time_calls, without_result


class Sizes(NamedTuple):  # static: hashable
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_base: float
    norm_eps: float


def floor_weights(model) -> tuple[dict, Sizes]:
    """eqrope's arrays, by the floor's names, and the sizes the floor needs."""
    blocks, c = model.blocks, model.config
    w = dict(embed=model.embed, wqkv=blocks.attn.wqkv, wo=blocks.attn.wo,
             w_gate_up=blocks.mlp.w_gate_up, w_down=blocks.mlp.w_down,
             attn_norm=blocks.attn_norm.weight, mlp_norm=blocks.mlp_norm.weight,
             final_norm=model.final_norm.weight, head=model.head, head_bias=model.head_bias)
    return w, Sizes(c.n_heads, c.n_kv_heads, c.head_dim, c.rope_base, c.norm_eps)


def rms_norm(x, weight, eps):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps) * weight).astype(x.dtype)


def rope(x, positions, inv_freq):  # x: (seq, heads, head_dim); pairs (2i, 2i + 1)
    angles = positions.astype(jnp.float32)[:, None, None] * inv_freq
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return jnp.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).reshape(x.shape)


def forward(w, s: Sizes, ids, pos, cache):
    """Logits of `ids` at positions `pos, pos + 1, ...`; writes their keys and values."""
    seq, hd, kv, group = ids.shape[0], s.head_dim, s.n_kv_heads, s.n_heads // s.n_kv_heads
    positions = pos + jnp.arange(seq)
    inv_freq = jnp.asarray(1.0 / np.float32(s.rope_base) ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    visible = jnp.arange(cache[0].shape[2])[None, :] <= positions[:, None]

    def block(carry, layer):
        x, keys, values = carry
        i, wqkv, wo, w_gate_up, w_down, attn_norm, mlp_norm = layer
        q, k, v = jnp.split(rms_norm(x, attn_norm, s.norm_eps) @ wqkv, [s.n_heads * hd, (s.n_heads + kv) * hd], -1)
        q = rope(q.reshape(seq, s.n_heads, hd), positions, inv_freq).reshape(seq, kv, group, hd)
        k = rope(k.reshape(seq, kv, hd), positions, inv_freq).transpose(1, 0, 2)
        keys = jax.lax.dynamic_update_slice(keys, k[None], (i, 0, pos, 0))
        values = jax.lax.dynamic_update_slice(values, v.reshape(seq, kv, hd).transpose(1, 0, 2)[None], (i, 0, pos, 0))
        scores = jnp.einsum("skgd,ktd->kgst", q, keys[i], preferred_element_type=jnp.float32) / math.sqrt(hd)
        p = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
        attn = jnp.einsum("kgst,ktd->skgd", p.astype(x.dtype), values[i]).reshape(seq, -1)
        x = x + attn @ wo
        gate, up = jnp.split(rms_norm(x, mlp_norm, s.norm_eps) @ w_gate_up, 2, -1)
        return (x + (jax.nn.silu(gate) * up) @ w_down, keys, values), None

    layers = (jnp.arange(w["wqkv"].shape[0]), w["wqkv"], w["wo"], w["w_gate_up"], w["w_down"],
              w["attn_norm"], w["mlp_norm"])
    (x, *cache), _ = jax.lax.scan(block, (w["embed"][ids], *cache), layers)
    return rms_norm(x, w["final_norm"], s.norm_eps) @ w["head"] + w["head_bias"], cache


def greedy(run, prompt, cache, max_new: int):
    """The prompt through `run(ids, pos, cache) -> (logits, cache)` in one pass, then
    `max_new - 1` greedy steps in a `lax.scan`; shared by both floors."""
    logits, cache = run(prompt, 0, cache)
    first = jnp.argmax(logits[-1]).astype(prompt.dtype)

    def step(carry, _):
        token, pos, cache = carry
        logits, cache = run(token[None], pos, cache)
        token = jnp.argmax(logits[0]).astype(prompt.dtype)
        return (token, pos + 1, cache), token

    _, rest = jax.lax.scan(step, (first, prompt.shape[0], cache), None, length=max_new - 1)
    return jnp.concatenate([prompt, first[None], rest])


@functools.partial(jax.jit, static_argnames=("s", "max_new", "cache_len"))
def floor_generate(w, prompt, *, s: Sizes, max_new: int, cache_len: int):
    """Greedy: the prompt in one pass, then `max_new - 1` steps in a `lax.scan`."""
    shape = (w["wqkv"].shape[0], s.n_kv_heads, cache_len, s.head_dim)
    cache = [jnp.zeros(shape, w["embed"].dtype)] * 2
    return greedy(lambda ids, pos, c: forward(w, s, ids, pos, c), prompt, cache, max_new)


def unrolled_weights(w: dict) -> dict:
    """The floor's weights with each block's arrays split out, once, before any call:
    `w["layers"]` is a tuple of per-block tuples."""
    names = ("wqkv", "wo", "w_gate_up", "w_down", "attn_norm", "mlp_norm")
    n = w["wqkv"].shape[0]
    layers = tuple(tuple(jnp.array(w[k][i]) for k in names) for i in range(n))
    rest = {k: v for k, v in w.items() if k not in names}
    return {**rest, "layers": layers}


def forward_unrolled(w, s: Sizes, ids, pos, caches):
    """`forward` with a Python `for` over the blocks, each with its own weight arrays
    and its own `(keys, values)` buffers, so nothing is sliced out of a stacked array."""
    seq, hd, kv, group = ids.shape[0], s.head_dim, s.n_kv_heads, s.n_heads // s.n_kv_heads
    positions = pos + jnp.arange(seq)
    inv_freq = jnp.asarray(1.0 / np.float32(s.rope_base) ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    visible = jnp.arange(caches[0][0].shape[1])[None, :] <= positions[:, None]
    x, out = w["embed"][ids], []
    for (wqkv, wo, w_gate_up, w_down, attn_norm, mlp_norm), (keys, values) in zip(w["layers"], caches):
        q, k, v = jnp.split(rms_norm(x, attn_norm, s.norm_eps) @ wqkv, [s.n_heads * hd, (s.n_heads + kv) * hd], -1)
        q = rope(q.reshape(seq, s.n_heads, hd), positions, inv_freq).reshape(seq, kv, group, hd)
        k = rope(k.reshape(seq, kv, hd), positions, inv_freq).transpose(1, 0, 2)
        keys = jax.lax.dynamic_update_slice(keys, k, (0, pos, 0))
        values = jax.lax.dynamic_update_slice(values, v.reshape(seq, kv, hd).transpose(1, 0, 2), (0, pos, 0))
        scores = jnp.einsum("skgd,ktd->kgst", q, keys, preferred_element_type=jnp.float32) / math.sqrt(hd)
        p = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
        attn = jnp.einsum("kgst,ktd->skgd", p.astype(x.dtype), values).reshape(seq, -1)
        x = x + attn @ wo
        gate, up = jnp.split(rms_norm(x, mlp_norm, s.norm_eps) @ w_gate_up, 2, -1)
        x = x + (jax.nn.silu(gate) * up) @ w_down
        out.append((keys, values))
    x = rms_norm(x, w["final_norm"], s.norm_eps)
    head = w["head"] if w["head"] is not None else w["embed"].T
    logits = x @ head
    if w["head_bias"] is not None:
        logits = logits + w["head_bias"]
    return logits, out


@functools.partial(jax.jit, static_argnames=("s", "max_new", "cache_len"))
def floor_generate_unrolled(w, prompt, *, s: Sizes, max_new: int, cache_len: int):
    """`floor_generate` on `unrolled_weights`: per-block weights and caches."""
    shape = (s.n_kv_heads, cache_len, s.head_dim)
    caches = [(jnp.zeros(shape, w["embed"].dtype), jnp.zeros(shape, w["embed"].dtype)) for _ in w["layers"]]
    return greedy(lambda ids, pos, c: forward_unrolled(w, s, ids, pos, c), prompt, caches, max_new)


@functools.partial(jax.jit, static_argnames=("s", "cache_len"))
def floor_prefill_unrolled(w, prompt, *, s: Sizes, cache_len: int):
    """The first token after `prompt`: the unrolled floor's one-pass prefill into empty
    per-block caches, then the argmax (the time to the first token)."""
    shape = (s.n_kv_heads, cache_len, s.head_dim)
    caches = [(jnp.zeros(shape, w["embed"].dtype), jnp.zeros(shape, w["embed"].dtype)) for _ in w["layers"]]
    logits, _ = forward_unrolled(w, s, prompt, 0, caches)
    return jnp.argmax(logits[-1])


def default_cache_len(seq: int, max_new: int, model_max_len: int) -> int:
    """What `eqrope.generate` picks by default: the smallest power of two (at least 16)
    holding the prompt and the new tokens, capped at the model's `max_len`."""
    return min(1 << (max(16, seq + max_new) - 1).bit_length(), model_max_len)


def floor_protocol(cfg: dict, model) -> dict:
    """The seed protocol on both floors and on `eqrope.generate`, calls interleaved.

    The floor is the unrolled one (per-block weights split once before the call, per-block
    caches, a Python `for` over the blocks); the stacked floor (a `lax.scan` over stacked
    blocks) is kept beside it so that the layout's effect shows. eqrope runs the model as
    built (stacked; `generate` slices its blocks once per call) and held unstacked
    (`model.unstacked()`, as `from_hf(..., layout="unstacked")` gives).
    """
    prompt = jnp.arange(8, dtype=jnp.int32)
    new = cfg["seed_new"]
    w, s = floor_weights(model)
    wu = unrolled_weights(w)
    held = model.unstacked()
    cache_len = default_cache_len(8, new, model.max_len)
    fns = {"eqrope": lambda: eqrope.generate(held, prompt, new),
           "eqrope_stacked": lambda: eqrope.generate(model, prompt, new),
           "floor": lambda: floor_generate_unrolled(wu, prompt, s=s, max_new=new, cache_len=cache_len),
           "stacked_floor": lambda: floor_generate(w, prompt, s=s, max_new=new, cache_len=cache_len)}
    t = time_calls(fns, repeats=cfg["floor_repeats"])
    tokens = {k: np.asarray(v["result"]) for k, v in t.items()}
    ratio = t["eqrope"]["median_s"] / t["floor"]["median_s"]
    ms = lambda k: f"{t[k]['median_s'] * 1e3:.2f} ms"
    log(f"  floor: eqrope {ms('eqrope')} (stacked model {ms('eqrope_stacked')}), unrolled floor "
        f"{ms('floor')}, stacked floor {ms('stacked_floor')}; ratio {ratio:.2f}")
    return {
        **{k: without_result(v) for k, v in t.items()},
        "ratio_median": ratio,
        "ratio_stacked_model": t["eqrope_stacked"]["median_s"] / t["floor"]["median_s"],
        "ratio_stacked_floor": t["stacked_floor"]["median_s"] / t["floor"]["median_s"],
        "tokens_equal": all(np.array_equal(tokens["eqrope"], v) for v in tokens.values()),
        "floor_cache_len": cache_len,
        "max_new": new,
        "method": (
            "the seed protocol (prompt 0..7, greedy) with the same arrays on: eqrope.generate "
            "of the model held unstacked (eqrope) and as built, stacked (eqrope_stacked); "
            "bench/_floor.py's floor_generate_unrolled (floor: one jax.jit, per-block weights "
            "split once before the call, per-block caches, a Python for over the blocks, "
            "prefill then a lax.scan of max_new - 1 steps, full-cache masked attention over "
            "floor_cache_len rows, eqrope's default cache length for this job) and "
            "floor_generate (stacked_floor: the same with stacked blocks in a lax.scan); "
            "one warm-up call each (first_s, compile included), then rounds of one timed "
            "call each, interleaved; ratio_median = eqrope median / floor median"
        ),
    }
