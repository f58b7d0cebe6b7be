"""What bounds a decode step, measured inside `eqrope.generate` beside the machine's rates.

- batch 1 is bound by memory: tokens/s x bytes per token (every weight once, plus the
  cache rows a step attends) against the rate of an in-place XLA pass over a buffer of
  the step's working-set size (it may sit in the CPU's last-level cache), and against
  the same pass over a large buffer (DRAM);
- a batch of 32 rows is bound by arithmetic: 2 x (matmul parameters) x tokens/s against
  the rate of XLA's float32 matmuls at the step's shapes, `(batch, in) @ (in, out)` for
  every weight matrix of a step.

Each pair is timed in one `time_calls`, calls interleaved, so load from other processes
falls on both alike.
"""

import functools

import jax
import jax.numpy as jnp

import eqrope
from _roofline import weight_nbytes
from _timing import log, time_calls, without_result


def weight_matrices(model) -> list:
    """The matrices one decode step multiplies by: each block's `wqkv`, `wo`, `w_gate_up`,
    `w_down`, and the head (the embedding is a gather, the norms are vectors)."""
    head = model.embed.T if model.head is None else model.head
    if isinstance(model.blocks, (tuple, list)):  # the unstacked layout (from_hf's float32 default)
        return [w for b in model.blocks for w in (b.attn.wqkv, b.attn.wo, b.mlp.w_gate_up, b.mlp.w_down)] + [head]
    blocks = model.blocks
    stacked = [blocks.attn.wqkv, blocks.attn.wo, blocks.mlp.w_gate_up, blocks.mlp.w_down]
    return [w[b] for w in stacked for b in range(w.shape[0])] + [head]


@functools.partial(jax.jit, donate_argnums=0)
def _passes(x, times):
    """`times` passes of `x + 1` over a donated buffer (a traced count, so XLA cannot
    unroll and fuse them): each pass reads and writes every byte."""
    return jax.lax.fori_loop(0, times, lambda i, x: x + 1.0, x)


def copy_probe(nbytes: int, call_bytes: int):
    """A no-argument call that makes enough passes over a float32 buffer of `nbytes` to
    move about `call_bytes`, and a function of its median time that gives its record."""
    n = max(1, nbytes // 4)
    passes = max(1, call_bytes // (2 * 4 * n))
    state = {"x": jnp.zeros((n,), jnp.float32), "times": jnp.asarray(passes, jnp.int32)}

    def call():
        state["x"] = _passes(state["x"], state["times"])
        return state["x"]

    def record(timing: dict) -> dict:
        moved = 2 * 4 * n * passes
        return {**without_result(timing), "buffer_nbytes": 4 * n, "passes": passes,
                "bytes_per_s": moved / timing["median_s"]}

    return call, record


COPY_CONVENTION = (
    "jax.jit of a lax.fori_loop of `x + 1` over a donated float32 buffer of buffer_nbytes, "
    "`passes` times per call (in place: each pass reads and writes every byte); "
    "bytes_per_s = 2 * buffer_nbytes * passes / median call time"
)


def roofline_in_generate(cfg: dict, model) -> dict:
    """Batch 1: the growth model's decode step as it runs inside `generate`."""
    config = model.config
    new, prompt_len = max(cfg["growth_n"]), cfg["growth_prompt"]
    prompt = jnp.arange(prompt_len, dtype=jnp.int32)
    weights = weight_nbytes(model)
    row = 2 * config.n_blocks * config.n_kv_heads * config.head_dim * config.jnp_dtype.itemsize
    # The first token comes from the prefill; steps at positions p = P .. P + N - 2 each
    # read rows 0 .. p, so p + 1 rows: P + N / 2 on average.
    mean_rows = prompt_len + new / 2
    per_token = weights + mean_rows * row
    working_set, working_set_record = copy_probe(int(per_token), cfg["copy_call_bytes"])
    dram, dram_record = copy_probe(cfg["copy_mb"] * 2**20, cfg["copy_call_bytes"])
    t = time_calls({"generate": lambda: eqrope.generate(model, prompt, new),
                    "copy_working_set": working_set, "copy_dram": dram},
                   repeats=cfg["bound_repeats"])
    tokens_per_s = new / t["generate"]["median_s"]
    achieved = tokens_per_s * per_token
    ws, big = working_set_record(t["copy_working_set"]), dram_record(t["copy_dram"])
    log(f"  inside generate: {achieved / 1e9:.2f} GB/s; copy {ws['bytes_per_s'] / 1e9:.2f} GB/s "
        f"({ws['buffer_nbytes'] / 2**20:.1f} MiB), {big['bytes_per_s'] / 1e9:.2f} GB/s "
        f"({big['buffer_nbytes'] / 2**20:.0f} MiB)")
    return {
        "new_tokens": new,
        "prompt_len": prompt_len,
        "generate": without_result(t["generate"]),
        "tokens_per_s": tokens_per_s,
        "weights_nbytes": weights,
        "cache_row_nbytes": row,
        "mean_rows_read": mean_rows,
        "bytes_per_token": per_token,
        "bytes_convention": (
            "every weight array once per token plus the cache rows the step attends: "
            "weights_nbytes + mean_rows_read * cache_row_nbytes, mean_rows_read = "
            "prompt_len + new_tokens / 2 (steps at p = P .. P + N - 2 read p + 1 rows; the "
            "prefill gives the first token)"
        ),
        "achieved_bytes_per_s": achieved,
        "copy_working_set": ws,
        "copy_dram": big,
        "copy_convention": COPY_CONVENTION,
        "fraction_of_working_set_copy": achieved / ws["bytes_per_s"],
        "fraction_of_dram_copy": achieved / big["bytes_per_s"],
        "method": (
            "eqrope.generate(model, arange(prompt_len), new_tokens) on the growth model, "
            "batch 1, greedy; tokens_per_s = new_tokens / median call time (the prefill and "
            "the call's overhead included); timed in rounds with the two copies"
        ),
    }


@jax.jit
def _products(xs, matrices):
    return [x @ w for x, w in zip(xs, matrices)]


def batch_matmul(cfg: dict, model) -> dict:
    """A batch of rows: the decode step's FLOP/s against XLA's matmul rate at its shapes."""
    batch, new, prompt_len = cfg["bound_batch"], cfg["batch_new"], cfg["growth_prompt"]
    matrices = weight_matrices(model)
    params = sum(int(w.size) for w in matrices)
    keys = jax.random.split(jax.random.PRNGKey(1), len(matrices))
    xs = [jax.random.normal(k, (batch, w.shape[0]), w.dtype) for k, w in zip(keys, matrices)]
    rows = (jnp.arange(prompt_len, dtype=jnp.int32)[None, :]
            + jnp.arange(batch, dtype=jnp.int32)[:, None]) % model.vocab_size
    t = time_calls({"generate": lambda: eqrope.generate(model, rows, new),
                    "matmul": lambda: _products(xs, matrices)},
                   repeats=cfg["bound_repeats"])
    tokens_per_s = batch * new / t["generate"]["median_s"]
    decode_flops = 2 * params * tokens_per_s
    matmul_flops = 2 * batch * params / t["matmul"]["median_s"]
    log(f"  batch {batch}: decode {decode_flops / 1e9:.1f} GFLOP/s, matmul "
        f"{matmul_flops / 1e9:.1f} GFLOP/s")
    return {
        "batch": batch,
        "new_per_row": new,
        "prompt_len": prompt_len,
        "matmul_params": params,
        "shapes": [[batch, *map(int, w.shape)] for w in matrices],
        "generate": without_result(t["generate"]),
        "matmul": without_result(t["matmul"]),
        "tokens_per_s": tokens_per_s,
        "decode_flops_per_s": decode_flops,
        "matmul_flops_per_s": matmul_flops,
        "fraction_of_matmul": decode_flops / matmul_flops,
        "method": (
            "decode: eqrope.generate of new_per_row tokens for `batch` rows of prompt_len, "
            "greedy; tokens_per_s = batch * new_per_row / median call time (prefill "
            "included); decode_flops_per_s = 2 * matmul_params * tokens_per_s, where "
            "matmul_params counts every weight matrix a step multiplies by (each block's "
            "wqkv, wo, w_gate_up, w_down and the head; attention scores, norms and the "
            "embedding gather not counted). matmul: one jax.jit computing x @ w for every "
            "such matrix with x of shape (batch, in), float32, FLOP = 2 * batch * "
            "matmul_params per call; timed in rounds with the decode"
        ),
    }
