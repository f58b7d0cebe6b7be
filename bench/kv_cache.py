"""What the KV cache buys, what bounds a decode step, and how far eqrope is from the floor.

    python bench/kv_cache.py            # --quick, the default: about 5 minutes on 2 cores
    python bench/kv_cache.py --full     # more repeats and sizes
    python bench/kv_cache.py --tiny --out /tmp/x   # tiny sizes, 1 repeat (for the tests)
    python bench/kv_cache.py --save     # update the committed bench/results/

Writes `kv_cache_cpu.json` and PNG figures to `--out` (default `bench/results/latest/`,
ignored by git, so a run leaves the checkout clean; `--save` writes to the committed
`bench/results/` instead) and prints a short table. The sections, in the order they run:

1. the seed's protocol (model (65, 64, 4, 2, 256), key 0, prompt 0..7, 100 new tokens,
   greedy; one warm-up then 5 timed repeats per path), with the seed's JSON keys
   `cache.median_s`, `no_cache.median_s` and `speedup_median`;
2. first call (`first_call`): where the seed protocol's first call goes (trace, lower,
   XLA compile, run), and the XLA compiles of new prompt lengths and `max_new` within
   one cache length, with their time beside a repeat call; and (`first_call.fresh`,
   bench/first_call.py) the first call in a fresh process, cold and with JAX's
   persistent compilation cache warm, beside the floor's cold one;
3. the floor (`floor`): a minimal JAX decoder of the same architecture and arrays
   (`_floor.py`) with per-block weights and caches and a Python `for` over the blocks,
   timed beside `eqrope.generate` on the seed protocol, with the same decoder over
   stacked blocks in a `lax.scan` as a second line; equal tokens;
4. long `max_len` (`long_max_len`): 10 tokens on the seed's sizes built for 131072
   positions against 256, and the peak RSS growth of such a call on a model whose full
   cache is 1 GiB, in a fresh process;
5. the textbook chapter's growth protocol (section 2.6, Figure 2.3): seconds to generate
   N tokens from a 4-token prompt, with and without the cache;
6. time of one isolated decode step at position 100 as `max_len` grows;
7. time to first token: one-pass `model.prefill` against feeding the prompt token by token;
8. tokens/s for a batch of prompts;
9. what bounds a step, inside `generate`: batch 1 (N=512) bytes/s against an XLA pass
   over the step's working set and over 256 MiB (`roofline_in_generate`), and batch 32
   FLOP/s against XLA's matmuls at the step's shapes (`batch_matmul`);
10. bytes of the cache, from `eqrope.cache_nbytes` and from the arrays, and the isolated
    step's roofline (section 6's step over a numpy copy's bandwidth);
11. compile time against depth: the first call with 2 and with 24 blocks.

Sections 1, 5, 7 and 8 are in `_protocols.py`, 2 and 11 in `_first_call.py`, 3 in
`_floor.py`, 4 in `_long_cache.py`, 6 and 10 in `_roofline.py`, 9 in `_bounds.py`; the
table, targets and figures in `_report.py`. Targets are reported (target, measured,
met), never asserted.
"""

import argparse
import time

import jax

import eqrope
from _bounds import batch_matmul, roofline_in_generate
from _first_call import depth_record, first_call_breakdown, new_lengths
from first_call import seed_first_calls
from _floor import floor_protocol
from _long_cache import long_max_len_time, peak_memory
from _protocols import SEED_MODEL, batch_protocol, growth_protocol, prefill_protocol, seed_protocol
from _report import plot, table, targets
from _roofline import cache_memory, copy_bandwidth, roofline, step_cost
from _timing import (add_output_arguments, compile_seconds, log, machine_info, results_folder,
                     write_json)


# The chapter's growth model (section 2.6): vocab 256, width 256, 4 heads, 4 blocks.
GROWTH_MODEL = eqrope.DecoderConfig(vocab_size=256, d_model=256, n_heads=4, n_blocks=4,
                                    max_len=1024, d_ff=1024)

MODES = {
    "quick": dict(
        seed_new=100, seed_repeats=5,
        growth=GROWTH_MODEL, growth_prompt=4,
        growth_n=(64, 128, 256, 512), growth_repeats=2,
        uncached_n=(64, 128, 256), uncached_repeats=1,
        prefill_lengths=(16, 64, 256), prefill_repeats=3,
        batches=(1, 8, 32), batch_new=128, batch_repeats=1,
        step_max_lens=(256, 1024, 4096, 8192), step_calls=50,
        copy_mb=256, copy_repeats=5,
        floor_repeats=20, long_max_len=131072, long_new=10, long_repeats=10,
        memory_max_len=2**20, memory_warm_ups=(256, 512), copy_call_bytes=2**30,
        bound_repeats=3, bound_batch=32,
        depths=(2, 24), fresh_repeats=3,
    ),
    "full": dict(
        seed_new=100, seed_repeats=5,
        growth=GROWTH_MODEL, growth_prompt=4,
        growth_n=(64, 128, 256, 512), growth_repeats=5,
        uncached_n=(64, 128, 256, 512), uncached_repeats=2,
        prefill_lengths=(16, 64, 256), prefill_repeats=10,
        batches=(1, 8, 32, 128), batch_new=128, batch_repeats=3,
        step_max_lens=(256, 1024, 4096, 8192), step_calls=300,
        copy_mb=256, copy_repeats=10,
        floor_repeats=50, long_max_len=131072, long_new=10, long_repeats=20,
        memory_max_len=2**20, memory_warm_ups=(256, 512), copy_call_bytes=2**30,
        bound_repeats=5, bound_batch=32,
        depths=(2, 24), fresh_repeats=5,
    ),
    "tiny": dict(
        # The seed's model stands in for the growth model, so that the compiled programs
        # of the seed section are reused (the tests' run is mostly compile time).
        seed_new=8, seed_repeats=1,
        growth=SEED_MODEL, growth_prompt=4,
        growth_n=(4, 8), growth_repeats=1,
        uncached_n=(4, 8), uncached_repeats=1,
        prefill_lengths=(8,), prefill_repeats=1,
        batches=(1, 2), batch_new=4, batch_repeats=1,
        step_max_lens=(256, 384), step_calls=3,
        copy_mb=8, copy_repeats=1,
        # A 4096-row model for the long case, with 8 new tokens so that the 256-row model
        # reuses the seed section's program; a 64 MiB cache and one warm-up for the
        # memory subprocess.
        floor_repeats=1, long_max_len=4096, long_new=8, long_repeats=1,
        memory_max_len=2**16, memory_warm_ups=(256,), copy_call_bytes=2**24,
        bound_repeats=1, bound_batch=2,
        # The fresh-process first calls are bench/first_call.py --tiny's part of the tests.
        depths=(2, 3), fresh_repeats=0,
    ),
}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", dest="mode", const="quick",
                      help="the default: a few minutes on a 2-core CPU")
    size.add_argument("--full", action="store_const", dest="mode", const="full",
                      help="more repeats, N=512 without the cache, batch 128")
    size.add_argument("--tiny", action="store_const", dest="mode", const="tiny",
                      help="tiny sizes and 1 repeat, for the tests")
    add_output_arguments(parser, "folder for kv_cache_cpu.json and the PNGs")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG figures")
    args = parser.parse_args(argv)
    mode = args.mode or "quick"
    cfg = MODES[mode]
    out = args.out if args.out is not None else results_folder(args.save)
    start = time.perf_counter()

    sizes = {k: v.to_dict() if isinstance(v, eqrope.DecoderConfig) else v for k, v in cfg.items()}
    result = {"mode": mode, "machine": machine_info(), "sizes": sizes}
    sections = {}
    clock = [time.perf_counter()]

    def section(name):
        now = time.perf_counter()
        if sections or name is None:
            sections[list(sections)[-1] if sections else "setup"] = now - clock[0]
        if name is not None:
            sections[name] = None
            log(f"[{mode}] {name} ({now - start:.0f} s)")
        clock[0] = now

    section("seed protocol")
    result.update(seed_protocol(cfg))
    section("first call and new lengths")
    seed_model = eqrope.RotaryDecoder.from_config(SEED_MODEL, key=jax.random.PRNGKey(0))
    result["first_call"] = {"breakdown": first_call_breakdown(result["cache"]),
                            "new_lengths": new_lengths(cfg, seed_model)}
    if cfg["fresh_repeats"]:
        section("first call in a fresh process")
        result["first_call"]["fresh"] = seed_first_calls(cfg["fresh_repeats"])
    section("floor")
    result["floor"] = floor_protocol(cfg, seed_model)
    section("long max_len")
    result["long_max_len"] = long_max_len_time(cfg)
    result["long_max_len"]["peak_memory"] = peak_memory(cfg["memory_max_len"], cfg["long_new"],
                                                        cfg["memory_warm_ups"])
    section("growth protocol")
    growth_model = eqrope.RotaryDecoder.from_config(cfg["growth"], key=jax.random.PRNGKey(0))
    result["growth"] = growth_protocol(cfg, growth_model)
    section("decode step against max_len")
    result["step_vs_max_len"], steps = step_cost(cfg, growth_model)
    section("prefill")
    result["prefill"] = prefill_protocol(cfg, growth_model, steps[growth_model.max_len][1])
    section("batch")
    result["batch"] = batch_protocol(cfg, growth_model)
    section("what bounds a step")
    result["roofline_in_generate"] = roofline_in_generate(cfg, growth_model)
    result["batch_matmul"] = batch_matmul(cfg, growth_model)
    section("roofline and memory")
    copy = copy_bandwidth(cfg["copy_mb"] * 2**20, cfg["copy_repeats"])
    step = result["step_vs_max_len"]["by_max_len"][str(growth_model.max_len)]
    result["roofline"] = roofline(growth_model, step, copy, result["growth"])
    result["cache_memory"] = cache_memory(seed_model, growth_model, steps, cfg["batches"])
    section("compile against depth")
    result["first_call"]["depth"] = depth_record(cfg, SEED_MODEL)

    section(None)
    result["section_wall_s"] = sections
    result["compile_total"] = compile_seconds()
    result["wall_s"] = time.perf_counter() - start
    result["targets"] = targets(result)
    out.mkdir(parents=True, exist_ok=True)
    if not args.no_plots:
        result["figures"] = plot(result, out)
    path = write_json(out / "kv_cache_cpu.json", result)
    print(table(result))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
