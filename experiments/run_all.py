"""The full run behind experiments/results/ and docs/textbook.md.

Runs, one after the other, from the repository root:

1. `rope_check.py` (section 2.2, Figure 2.1);
2. `reversal.py` (sections 2.4 and 2.6: both models, seeds 0 1 2, 1,500 steps of 64);
3. `reversal.py --name base100 --models rotary --rope-base 100` (exercise 2);
4. `reversal.py --name base1e6 --models rotary --rope-base 1e6` (exercise 2);
5. `reversal.py --name holdout --train-lengths 3-8,11-12 --test-lengths 3-8,11-12 9-10`
   (exercise 5, both models);
6. `extrapolation.py` (beyond the chapter: scaling the rotation rates after training).

    python experiments/run_all.py            # train everything (about an hour on 2 cores)
    python experiments/run_all.py --load     # reuse the saved checkpoints, only evaluate

The hour is measured by parts on this project's 2-core machine, shared with other jobs:
parts 1-5 took 1,004 s (`experiments/results/full_run.json`, a run from before
`reversal.py` tested every model on 4,000 more strings; adding those to the committed runs
took 220 s), and part 6 took 2,229 s at a load average of 5 to 9 (`wall_seconds` in
`experiments/results/extrapolation.json`). No single run of this script has timed all six
parts yet; the next one records them in `full_run.json`.

Arguments after the script name are passed to every `reversal.py` run (and `--load` to
`extrapolation.py`). The wall time of each part and of the whole run, with the machine's
CPU count and load, go to `experiments/results/full_run.json` (`full_run_load.json` with
`--load`).
"""

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import jax


PARTS = [
    ("rope_check", ["rope_check.py"]),
    ("main", ["reversal.py"]),
    ("base100", ["reversal.py", "--name", "base100", "--models", "rotary", "--rope-base", "100"]),
    ("base1e6", ["reversal.py", "--name", "base1e6", "--models", "rotary", "--rope-base", "1e6"]),
    (
        "holdout",
        ["reversal.py", "--name", "holdout", "--train-lengths", "3-8,11-12",
         "--test-lengths", "3-8,11-12", "9-10"],
    ),
    ("extrapolation", ["extrapolation.py"]),
]


def main() -> None:
    extra = sys.argv[1:]
    here = Path(__file__).resolve().parent
    results = here / "results"
    results.mkdir(exist_ok=True)
    record = {
        "command": " ".join(["python", "experiments/run_all.py", *extra]),
        "machine": {
            "cpu_count": os.cpu_count(),
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
            "platform": platform.platform(),
            "python": platform.python_version(),
            "jax": jax.__version__,
            "jax_devices": [str(d) for d in jax.devices()],
        },
        "parts": {},
    }
    start = time.perf_counter()
    for name, (script, *args) in PARTS:
        if script == "reversal.py":
            args = args + extra
        elif script == "extrapolation.py" and "--load" in extra:
            args = args + ["--load"]
        print(f"== {name}: python experiments/{script} {' '.join(args)}", flush=True)
        t0 = time.perf_counter()
        # A path relative to the repository root (the working directory), so that each
        # script records its command without the machine's absolute path.
        subprocess.run([sys.executable, f"experiments/{script}", *args], cwd=here.parent, check=True)
        record["parts"][name] = round(time.perf_counter() - t0, 1)
    record["wall_seconds"] = round(time.perf_counter() - start, 1)
    record["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    name = "full_run_load.json" if "--load" in extra else "full_run.json"
    (results / name).write_text(json.dumps(record, indent=2) + "\n")
    print(f"full run: {record['wall_seconds']} s; parts {record['parts']}")


if __name__ == "__main__":
    main()
