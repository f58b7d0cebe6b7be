#!/usr/bin/env bash
# Issue 45, item 5: bench/serve.py on a GPU, at the SmolLM2-135M and Qwen2.5-0.5B shapes
# (random float32 weights, the long-tail workload), one JSON per shape.
#
#   bash bench/gpu_serve_check.sh [OUT]     # default OUT: bench/results/latest/gpu
#
# Needs JAX with a GPU backend (pip install -U "jax[cuda12]") and eqrope installed (or
# PYTHONPATH=src); PYTHON picks the interpreter. Writes OUT/<shape>/serve_gpu.json and
# OUT/<shape>/log.txt, and OUT/summary.json with each shape's targets. Stops at once,
# writing nothing, where JAX's default backend is not a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/latest/gpu}
PYTHON=${PYTHON:-python}

"$PYTHON" -c 'import jax, sys; b = jax.default_backend(); print("backend", b, jax.devices()); sys.exit(b != "gpu")' || {
  echo "gpu_serve_check: JAX's default backend is not a GPU; install jax[cuda12] on a GPU machine." >&2
  exit 2
}
for shape in smollm2 qwen2.5-0.5b; do
  mkdir -p "$OUT/$shape"
  echo "== $shape" >&2
  "$PYTHON" bench/serve.py --shape "$shape" --out "$OUT/$shape" 2>&1 | tee "$OUT/$shape/log.txt"
done
"$PYTHON" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
summary = {}
for shape in ("smollm2", "qwen2.5-0.5b"):
    result = json.loads((out / shape / "serve_gpu.json").read_text())
    summary[shape] = {"machine": result["machine"], "shape": result["shape"], "targets": result["targets"],
                      "tokens_per_s": result["continuous"]["engine"]["tokens_per_s"]}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(f"wrote {out / 'summary.json'}")
PY
