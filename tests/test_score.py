"""`eqrope.score` against hand computations, without lm-eval.

- every scored token against `jax.nn.log_softmax(jax.vmap(model)(row))` on each ragged
  row at its own length (no padding, no buckets), and the greedy flags against `argmax`;
- a shared prefix against scoring each row alone with the prefix written in;
- rolling windows against a transcription of lm-eval's window rule, and with `stride=1`
  against each token scored from exactly the `window` tokens before it;
- one compile per bucket, counted from `jax.monitoring`;
- the errors, a model without a cache, a mesh of 8 CPU devices (in a subprocess), and
  `eqrope.eval` without lm-eval.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqrope
import eqrope.testing
from _compiles import counting
from eqrope.eval._buckets import memory_budget, rows_that_fit
from eqrope.eval._windows import rolling_windows


pytestmark = pytest.mark.usefixtures("precision")

ROOT = Path(__file__).resolve().parents[1]
VOCAB, MAX_LEN = 61, 32


@pytest.fixture(scope="module")
def model():
    return eqrope.RotaryDecoder(VOCAB, 32, 4, 2, MAX_LEN, n_kv_heads=2, key=jax.random.PRNGKey(0))


def _ragged(batch: int, seq: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (batch, seq)).astype(np.int32)
    lengths = rng.integers(2, seq + 1, batch).astype(np.int32)
    lengths[0] = seq
    prompts = np.minimum(rng.integers(1, 6, batch), lengths - 1).astype(np.int32)
    tokens[np.arange(seq)[None, :] >= lengths[:, None]] = 0
    return tokens, prompts, lengths


def _by_hand(model, row: np.ndarray):
    """log p(row[p] | row[:p]) and argmax(...) == row[p] for p = 1 .. len - 1."""
    logits = jax.vmap(model)(jnp.asarray(row[None, :-1]))[0]
    logprobs = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
    targets = row[1:]
    return logprobs[np.arange(len(targets)), targets], np.asarray(jnp.argmax(logits, -1)) == targets


def test_score_equals_a_hand_computation(model):
    tokens, prompts, lengths = _ragged(5, 20)
    got = eqrope.score(model, tokens, prompts, lengths)
    assert got.logprobs.shape == got.greedy.shape == tokens.shape
    assert got.logprobs.dtype == np.float32 and got.total.shape == got.all_greedy.shape == (5,)
    for i in range(5):
        logprobs, greedy = _by_hand(model, tokens[i, : lengths[i]])
        span = slice(prompts[i], lengths[i])
        np.testing.assert_allclose(got.logprobs[i, span], logprobs[prompts[i] - 1 :], atol=2e-5)
        np.testing.assert_array_equal(got.greedy[i, span], greedy[prompts[i] - 1 :])
        outside = np.ones(tokens.shape[1], bool)
        outside[span] = False
        assert (got.logprobs[i, outside] == 0).all() and not got.greedy[i, outside].any()
        np.testing.assert_allclose(got.total[i], logprobs[prompts[i] - 1 :].sum(), rtol=1e-5)
        assert got.all_greedy[i] == greedy[prompts[i] - 1 :].all()


def test_greedy_flags_see_both_outcomes(model):
    """A row that is its own greedy continuation is all greedy; a shuffled one is not."""
    text = np.asarray(eqrope.generate(model, jnp.asarray([3, 1, 4], jnp.int32), 12))
    got = eqrope.score(model, np.stack([text, text[::-1]]), 3)
    assert got.greedy[0, 3:].all() and got.all_greedy.tolist() == [True, False]


def test_one_row_and_defaults(model):
    tokens, _, _ = _ragged(1, 12, seed=1)
    one = eqrope.score(model, tokens[0])
    assert one.logprobs.shape == (12,) and one.total.shape == () and one.all_greedy.shape == ()
    logprobs, _ = _by_hand(model, tokens[0])
    np.testing.assert_allclose(one.logprobs[1:], logprobs, atol=2e-5)
    assert one.logprobs[0] == 0  # prompt_lengths defaults to 1: the first token has no context


def test_a_shared_prefix_equals_each_row_alone(model):
    prefix = np.asarray([5, 9, 2, 7, 7, 1, 30], np.int32)
    tokens, _, lengths = _ragged(6, 10, seed=2)
    prompts = np.asarray([0, 1, 3, 0, 2, 1], np.int32)
    prompts = np.minimum(prompts, lengths - 1)
    shared = eqrope.score(model, tokens, prompts, lengths, prefix=prefix, batch_size=4)
    for i in range(6):
        row = np.concatenate([prefix, tokens[i, : lengths[i]]])
        alone = eqrope.score(model, row, len(prefix) + prompts[i])
        np.testing.assert_allclose(
            shared.logprobs[i, : lengths[i]], alone.logprobs[len(prefix) :], atol=2e-5
        )
        np.testing.assert_array_equal(shared.greedy[i, : lengths[i]], alone.greedy[len(prefix) :])
        np.testing.assert_allclose(shared.total[i], alone.total, rtol=1e-5, atol=1e-5)
    one_token = eqrope.score(model, tokens[:, :1], 0, 1, prefix=prefix[:1])
    for i in range(6):
        alone = eqrope.score(model, np.asarray([prefix[0], tokens[i, 0]]))
        np.testing.assert_allclose(one_token.logprobs[i, 0], alone.logprobs[1], atol=2e-5)


def _lm_eval_windows(tokens: list[int], prefix: int, max_seq_len: int):
    """lm-eval's `get_rolling_token_windows` (context_len=1) and `make_disjoint_window`,
    transcribed: `(inputs, predicted)` of each window."""
    first = min(max_seq_len, len(tokens))
    windows = [([prefix] + tokens[: first - 1], tokens[:first])]
    predicted = first
    while predicted < len(tokens):
        n = min(len(tokens) - predicted, max_seq_len)
        end = predicted + n
        windows.append((tokens[end - max_seq_len - 1 : end - 1], tokens[end - n : end]))
        predicted += n
    return windows


def test_rolling_windows_are_lm_evals_loglikelihood_rolling(model):
    rng = np.random.default_rng(3)
    text = rng.integers(0, VOCAB, 3 * MAX_LEN + 5).tolist()
    row = np.asarray([0, *text], np.int32)  # the prefix token 0, then the text
    got = eqrope.score(model, row, 1, stride=MAX_LEN)
    expected = 0.0
    for inputs, predicted in _lm_eval_windows(text, 0, MAX_LEN):
        logits = model(jnp.asarray(inputs, jnp.int32))
        logprobs = np.asarray(jax.nn.log_softmax(logits, -1))[-len(predicted) :]
        expected += logprobs[np.arange(len(predicted)), predicted].sum()
    np.testing.assert_allclose(got.total, expected, rtol=1e-5)
    assert (got.logprobs[1:] != 0).all()  # every token scored, once


def test_stride_one_gives_each_token_a_full_window(model):
    rng = np.random.default_rng(4)
    row = rng.integers(0, VOCAB, 2 * MAX_LEN).astype(np.int32)
    window = 8
    got = eqrope.score(model, row, stride=1, window=window, batch_size=16)
    # Token p <= window sees row[:p]; a later one exactly row[p - window : p].
    first = jax.nn.log_softmax(model(jnp.asarray(row[:window])), -1)
    contexts = np.stack([row[p - window : p] for p in range(window + 1, len(row))])
    later = jax.nn.log_softmax(jax.vmap(model)(jnp.asarray(contexts))[:, -1], -1)
    expected = [first[p - 1, row[p]] for p in range(1, window + 1)]
    expected += [later[p - window - 1, row[p]] for p in range(window + 1, len(row))]
    np.testing.assert_allclose(got.logprobs[1:], np.asarray(expected), atol=2e-5)


@pytest.mark.parametrize("window", [3, 8, 32])
@pytest.mark.parametrize("stride", [1, 2, 3, 8])
def test_rolling_windows_cover_each_token_once(window, stride):
    if stride > window:
        return
    for length in range(2, 4 * window):
        pieces = rolling_windows(0, length, 1, window, stride)
        scored = [p for piece in pieces for p in range(piece.first, piece.last + 1)]
        assert scored == list(range(1, length))
        for piece in pieces:
            assert piece.last - piece.start <= window and piece.first > piece.start
            assert piece.first - piece.start >= min(piece.first, window - stride + 1)


def test_no_recompile_within_a_bucket(model):
    def compiles(seqs, **kwargs):
        with counting() as c:
            for seq in seqs:
                tokens, prompts, lengths = _ragged(3, seq, seed=seq)
                if "prefix" in kwargs:
                    prompts = np.zeros_like(prompts)
                eqrope.score(model, tokens, prompts, lengths, **kwargs)
        return sum(c.compiles.values())

    compiles([9, 20])  # the 16 and 32 buckets compiled
    assert compiles([12, 16, 10]) == 0  # new lengths in the 16 bucket
    assert compiles([17, 30, 25]) == 0  # and in the 32 bucket
    assert compiles([3, 5]) == 0  # rows shorter than the smallest bucket
    assert compiles([3, 5, 8], prefix=[1, 2, 3]) <= 1  # a prefix: one program ...
    assert compiles([4, 6, 2], prefix=[1, 2, 3, 9]) == 0  # ... for new lengths of both


def test_a_model_without_a_cache(model):
    """Any causal `ids -> logits` with `max_len` and `vocab_size` scores (a wrapper)."""
    tokens, prompts, lengths = _ragged(3, 14, seed=5)
    wrapped = eqrope.score(eqrope.testing.Uncached(model), tokens, prompts, lengths)
    np.testing.assert_allclose(
        wrapped.logprobs, eqrope.score(model, tokens, prompts, lengths).logprobs, atol=1e-6
    )
    with pytest.raises(TypeError, match="cache protocol"):
        eqrope.score(eqrope.testing.Uncached(model), tokens, 0, lengths, prefix=[1])


def test_bfloat16_model_scores_in_float32():
    small = eqrope.RotaryDecoder(
        VOCAB, 32, 4, 1, MAX_LEN, dtype="bfloat16", key=jax.random.PRNGKey(2)
    )
    tokens, prompts, lengths = _ragged(2, 10, seed=6)
    got = eqrope.score(small, tokens, prompts, lengths)
    assert got.logprobs.dtype == np.float32
    logprobs, _ = _by_hand(small, tokens[0, : lengths[0]])
    np.testing.assert_allclose(got.logprobs[0, prompts[0] :], logprobs[prompts[0] - 1 :], atol=1e-5)


def test_bad_inputs_raise_clearly(model):
    tokens, prompts, lengths = _ragged(3, 10)
    with pytest.raises(
        ValueError,
        match=r"row 1 has an empty continuation: prompt_lengths\[1\]=4 >= lengths\[1\]=4",
    ):
        eqrope.score(model, tokens, [1, 4, 1], [10, 4, 5])
    with pytest.raises(ValueError, match=r"tokens holds token ids outside \[0, 61\): \[61\]"):
        eqrope.score(model, np.where(np.arange(10) == 3, VOCAB, tokens), prompts, lengths)
    padded = tokens.copy()
    padded[1, lengths[1] :] = -1  # pads past a row's length are not checked
    eqrope.score(model, padded, prompts, lengths)
    with pytest.raises(ValueError, match="prefix holds token ids outside"):
        eqrope.score(model, tokens, 0, lengths, prefix=[1, -3])
    with pytest.raises(ValueError, match="prompt_lengths must be >= 1"):
        eqrope.score(model, tokens, 0, lengths)
    with pytest.raises(ValueError, match=r"lengths must be in \[1, 10\]"):
        eqrope.score(model, tokens, 1, [10, 11, 3])
    long = np.zeros((2, MAX_LEN + 2), np.int32)
    with pytest.raises(ValueError, match=r"row 0 has 34 tokens .* window=32 .* Pass stride="):
        eqrope.score(model, long)
    eqrope.score(model, long[:, :-1])  # max_len + 1 tokens fit: the last is only predicted
    with pytest.raises(ValueError, match="the prefix and row 0 hold 34 tokens"):
        eqrope.score(model, long[:, :30], 0, prefix=[1, 2, 3, 4])
    with pytest.raises(ValueError, match="stride=9 > window=8"):
        eqrope.score(model, long, window=8, stride=9)
    with pytest.raises(ValueError, match="cannot be combined with prefix"):
        eqrope.score(model, tokens, 0, lengths, prefix=[1], stride=4)
    with pytest.raises(ValueError, match="prompt_lengths has 2 entries but tokens has 3 rows"):
        eqrope.score(model, tokens, [1, 1], lengths)
    with pytest.raises(TypeError, match="traced tokens"):
        jax.jit(lambda t: eqrope.score(model, t).total)(jnp.asarray(tokens))
    with pytest.raises(TypeError, match="integer `max_len`"):
        eqrope.score(lambda ids: ids, tokens)
    with pytest.raises(ValueError, match="window=33, but the model's max_len is 32"):
        eqrope.score(model, tokens, window=33)


def test_rows_that_fit_a_measured_budget(model):
    rows = rows_that_fit(model, 16, limit=64)
    assert rows & (rows - 1) == 0 and 1 <= rows <= 64
    assert rows_that_fit(model, 16, limit=64, budget=1) == 1
    assert rows_that_fit(model, 16, limit=3, budget=2**40) == 2
    assert memory_budget() > 0


MESH_CHECK = """
import json
import jax, jax.numpy as jnp, numpy as np
from jaxtyping import install_import_hook
jax.config.update("jax_numpy_dtype_promotion", "strict")
with install_import_hook("eqrope", "beartype.beartype"):
    import eqrope
model = eqrope.RotaryDecoder(64, 64, 8, 2, 32, n_kv_heads=4, key=jax.random.PRNGKey(0))
rng = np.random.default_rng(0)
tokens = rng.integers(0, 64, (6, 20)).astype(np.int32)
lengths = rng.integers(4, 21, 6).astype(np.int32)
report = {}
for data, tensor in ((8, 1), (2, 4)):
    mesh = eqrope.make_mesh(data, tensor)
    sharded = eqrope.shard(model, mesh)
    pairs = ((model, None), (sharded, mesh))
    plain = [eqrope.score(m, tokens, 2, lengths, mesh=k) for m, k in pairs]
    shared = [eqrope.score(m, tokens, 0, lengths, prefix=[1, 2, 3], mesh=k) for m, k in pairs]
    text = tokens.reshape(-1)[:100]
    long = [eqrope.score(m, text, stride=16, window=16, mesh=k) for m, k in pairs]
    runs = (plain, shared, long)
    report[f"{data}x{tensor}"] = [float(np.abs(a.logprobs - b.logprobs).max()) for a, b in runs]
    report[f"{data}x{tensor} greedy"] = all((a.greedy == b.greedy).all() for a, b in runs)
print(json.dumps(report))
"""


@pytest.mark.multidevice
def test_on_a_mesh_equals_one_device(precision):
    if precision == "x64":
        pytest.skip("the subprocess runs once, in the default precision")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    proc = subprocess.run(
        [sys.executable, "-c", MESH_CHECK],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    import json

    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for mesh in ("8x1", "2x4"):
        assert max(report[mesh]) < 1e-5, report
        assert report[f"{mesh} greedy"]


BLOCKED = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "lm_eval" or name.startswith("lm_eval."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
import eqrope, eqrope.eval
assert eqrope.score is eqrope.eval.score
try:
    eqrope.eval.LM
except ImportError as e:
    print("ImportError:", e)
"""


def test_eval_imports_without_lm_eval(precision):
    if precision == "x64":
        pytest.skip("a subprocess; once is enough")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(BLOCKED)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ImportError:" in proc.stdout and "pip install eqrope[eval]" in proc.stdout
