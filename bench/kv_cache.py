"""What the KV cache buys, and how close a decode step gets to this machine's memory bandwidth.

    python bench/kv_cache.py            # --quick, the default: under two minutes on 2 cores
    python bench/kv_cache.py --full     # more repeats and sizes (several minutes)
    python bench/kv_cache.py --tiny --out /tmp/x   # tiny sizes, 1 repeat (for the tests)
    python bench/kv_cache.py --save     # update the committed bench/results/

Writes `kv_cache_cpu.json` and PNG figures to `--out` (default `bench/results/latest/`,
ignored by git, so a run leaves the checkout clean; `--save` writes to the committed
`bench/results/` instead) and prints a short table. The sections follow issue 4:

1. the seed's protocol (model (65, 64, 4, 2, 256), key 0, prompt 0..7, 100 new tokens,
   greedy; one warm-up then 5 timed repeats per path), with the seed's JSON keys
   `cache.median_s`, `no_cache.median_s` and `speedup_median`;
2. the textbook chapter's growth protocol (section 2.6, Figure 2.3): seconds to generate
   N tokens from a 4-token prompt, with and without the cache;
3. time to first token: one-pass `model.prefill` against feeding the prompt token by token;
4. tokens/s for a batch of prompts;
5. bytes of the cache, from `eqrope.cache_nbytes` and from the arrays;
6. time of one decode step at position 100 as `max_len` grows;
7. the roofline: the bytes a batch-1 decode step must read over its time, beside this
   machine's measured copy bandwidth.

Sections 1 to 4 are in `_protocols.py`, 5 to 7 in `_roofline.py`, the table, targets and
figures in `_report.py`. Targets are reported (target, measured, met), never asserted.
"""

import argparse
import time

import jax

import eqrope
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
    ),
}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", dest="mode", const="quick",
                      help="the default: under two minutes on a 2-core CPU")
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
    section("growth protocol")
    growth_model = eqrope.RotaryDecoder.from_config(cfg["growth"], key=jax.random.PRNGKey(0))
    result["growth"] = growth_protocol(cfg, growth_model)
    section("decode step against max_len")
    result["step_vs_max_len"], steps = step_cost(cfg, growth_model)
    section("prefill")
    result["prefill"] = prefill_protocol(cfg, growth_model, steps[growth_model.max_len][1])
    section("batch")
    result["batch"] = batch_protocol(cfg, growth_model)
    section("roofline and memory")
    copy = copy_bandwidth(cfg["copy_mb"] * 2**20, cfg["copy_repeats"])
    step = result["step_vs_max_len"]["by_max_len"][str(growth_model.max_len)]
    result["roofline"] = roofline(growth_model, step, copy, result["growth"])
    seed_model = eqrope.RotaryDecoder.from_config(SEED_MODEL, key=jax.random.PRNGKey(0))
    result["cache_memory"] = cache_memory(seed_model, growth_model, steps, cfg["batches"])

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
