"""`python -m eqrope.eval ...`: lm-eval's own command line, with the "eqrope" model registered.

lm-eval finds a model by name only among the classes imported into its registry, and its
`lm_eval` command imports its own models only. This entry point imports `eqrope.eval._lm`
(which registers "eqrope") and hands every argument to lm-eval's `cli_evaluate`:

    python -m eqrope.eval --model eqrope --model_args pretrained=DIR,batch_size=8 --tasks hellaswag

lm-eval's main branch (after 0.4.13) also reads the `lm_eval.models` entry point that
pyproject.toml declares, and finds "eqrope" with its own command; this one serves both.
"""


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
    cli_evaluate()


if __name__ == "__main__":
    main()
