"""`python -m eqrope.eval ...`: lm-eval's own command line, with the "eqrope" model registered.

lm-eval finds a model by name only among the classes imported into its registry, and its
`lm_eval` command imports its own models only. This entry point imports `eqrope.eval._lm`
(which registers "eqrope") and hands every argument to lm-eval's `cli_evaluate`:

    python -m eqrope.eval --model eqrope --model_args pretrained=DIR,batch_size=8 --tasks hellaswag

lm-eval's main branch (after 0.4.13) also reads the `lm_eval.models` entry point that
pyproject.toml declares, and finds "eqrope" with its own command; this one serves both. A
`batch_size` in `--model_args` is also passed as `--batch_size`, so that lm-eval's summary
reports the batch size the run uses.
"""

import argparse
import json
import sys


def main() -> None:
    try:
        from lm_eval.__main__ import cli_evaluate

        from . import _lm  # noqa: F401 (registers the "eqrope" model)
    except ImportError as e:
        if e.name is None or e.name.split(".")[0] != "lm_eval":
            raise
        raise SystemExit(
            "python -m eqrope.eval runs lm-evaluation-harness, which is not installed; "
            "install it with `pip install eqrope[eval]`."
        ) from e
    sys.argv[1:] = with_model_batch_size(sys.argv[1:])
    cli_evaluate()


def with_model_batch_size(argv: list[str]) -> list[str]:
    """`argv` with `--batch_size N` added where `--model eqrope`'s `--model_args` holds
    `batch_size=N`.

    eqrope's model runs with `--model_args`' batch size (it wins over `--batch_size`,
    whose default of 1 lm-eval always passes), but lm-eval's summary and results report
    its own `--batch_size`; the last `--batch_size` wins, so the two agree.
    """
    from lm_eval.utils import simple_parse_args_string

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--model", "-M")  # lm-eval 0.4.13's flags
    parser.add_argument("--model_args", "-a", nargs="+", action="append", default=[])
    known = parser.parse_known_args(argv)[0]
    if known.model != "eqrope":
        return argv
    model_args = {}
    for value in (v for values in known.model_args for v in values):
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        model_args.update(parsed if isinstance(parsed, dict) else simple_parse_args_string(value))
    if "batch_size" not in model_args:
        return argv
    return [*argv, "--batch_size", str(model_args["batch_size"])]


if __name__ == "__main__":
    main()
