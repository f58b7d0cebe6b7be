"""Structured output inside the compiled loop (issue 41): `generate(..., constraint=...)`.

Checked against what the traced table does not touch:

- outlines-core's own `Index` over a tiny vocabulary (its allowed tokens, next states and
  final states), walked in Python beside a hand loop over `model(ids)` (greedy) and beside
  sampled runs (every generated token inside its allowed set);
- a hand computation of the constrained log-probabilities from `model(ids)`;
- a call without `constraint` (free rows must be bitwise the same);
- a naive search for the end-of-thinking sequence.
"""

import logging

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compiles import counting
from _models import random_model

import eqrope
from eqrope.generation._automaton import Automaton
from eqrope.generation._constraint import advance
from eqrope.generation._constraint_table import constraint_of
from eqrope.testing import Uncached

# outlines-core is the [structured] extra's; CI's newcomer path collects without it.
outlines_core = pytest.importorskip("outlines_core")

VOCAB, MAX_LEN, EOS = 29, 24, 0
# The tiny vocabulary outlines-core sees: token i + 1 spells TOKENS[i]; 0 is EOS, and
# the ids 16 .. 28 spell nothing it knows (never allowed).
TOKENS = ["a", "b", "0", "1", "2", "ab", "12", "{", "}", '"', ":", " ", "x", "y", "z"]
REGEXES = [r"[ab]{1,3}[0-2]+", r"(ab|12)+", r"x[yz]{2}", r'\{"a":[0-2]\}', r"[012]{2,4}", r"(a|b)z?"]


@pytest.fixture(scope="module")
def model():
    return random_model(0, VOCAB, 32, 4, 2, MAX_LEN, n_kv_heads=2, d_ff=64)


def index(regex: str) -> outlines_core.Index:
    return outlines_core.Index(regex, outlines_core.Vocabulary(EOS, {t: [i + 1] for i, t in enumerate(TOKENS)}))


def table(allowed: list[set], nexts: list[dict], accepting: list[bool], vocab: int = VOCAB) -> Automaton:
    """An `Automaton` from each state's allowed ids, next states and acceptance."""
    words = -(-vocab // 32)
    bits = np.zeros((len(allowed), words), np.uint32)
    for s, ids in enumerate(allowed):
        for t in ids:
            bits[s, t // 32] |= np.uint32(1 << (t % 32))
    default, start, tokens, follow = np.zeros(len(allowed), np.int32), [0], [], []
    for s, moves in enumerate(nexts):
        values = list(moves.values())
        default[s] = max(set(values), key=values.count) if values else 0
        for t in sorted(moves):
            if moves[t] != default[s]:
                tokens.append(t)
                follow.append(moves[t])
        start.append(len(tokens))
    i32 = lambda x: np.asarray(x, np.int32)
    return Automaton(bits, default, i32(start), i32(tokens), i32(follow), np.asarray(accepting), vocab)


def from_outlines(idx: outlines_core.Index) -> Automaton:
    """outlines-core's index as an `Automaton` (its start state first; EOS left out)."""
    moves = idx.get_transitions()
    order = [idx.get_initial_state()] + sorted(set(moves) - {idx.get_initial_state()})
    number = {s: i for i, s in enumerate(order)}
    final = idx.get_final_states()
    nexts = [{t: number[n] for t, n in moves.get(s, {}).items() if t != EOS} for s in order]
    return table([set(m) for m in nexts], nexts, [s in final for s in order])


@eqx.filter_jit
def _full(model, ids):
    return model(ids)


def last_logits(model, text: list[int]) -> np.ndarray:
    """`model(text)[-1]`, run padded to `max_len` (the model is causal)."""
    padded = jnp.zeros((MAX_LEN,), jnp.int32).at[: len(text)].set(jnp.asarray(text, jnp.int32))
    return np.asarray(_full(model, padded)[len(text) - 1], np.float32)


def prompts(n: int, seq: int = 4, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, VOCAB, size=(n, seq)).astype(np.int32)


def walk(idx, new: list[int]) -> tuple[int, bool]:
    """outlines' state after `new` (each token checked against its allowed set), and
    whether the text ended with EOS."""
    state = idx.get_initial_state()
    for t in new:
        assert t in idx.get_allowed_tokens(state), (new, t)
        if t == EOS:
            return state, True
        state = idx.get_next_state(state, t)
    return state, False


# -- free rows -------------------------------------------------------------------------------


@pytest.mark.parametrize("settings", [dict(), dict(num_samples=2), dict(temperature=[1.0, 0.7])])
def test_free_rows_are_bitwise_those_of_an_unconstrained_call(model, settings):
    ids, key = prompts(2), jax.random.key(3)
    kwargs = {**dict(eos_id=EOS, temperature=1.0, key=key, return_logprobs=True), **settings}
    plain = eqrope.generate(model, ids, 8, **kwargs)
    mixed = eqrope.generate(model, ids, 8, constraint=[from_outlines(index(REGEXES[0])), None], **kwargs)
    for field in ("tokens", "logprobs", "model_logprobs", "lengths"):
        assert np.array_equal(np.asarray(getattr(plain, field))[1], np.asarray(getattr(mixed, field))[1]), field
    # ... and the constrained row did change (the mask ran).
    assert not np.array_equal(np.asarray(plain.tokens)[0], np.asarray(mixed.tokens)[0])


# -- against outlines-core and the uncached model --------------------------------------------


def test_greedy_equals_a_hand_loop_over_outlines_index(model):
    ids = prompts(len(REGEXES), seed=1)
    out = eqrope.generate(model, ids, 10, eos_id=EOS, constraint=[from_outlines(index(r)) for r in REGEXES])
    for row, regex in enumerate(REGEXES):
        idx, text = index(regex), list(ids[row])
        state = idx.get_initial_state()
        for _ in range(10):
            allowed = idx.get_allowed_tokens(state)  # EOS among them exactly in final states
            logits = last_logits(model, text)
            masked = np.full_like(logits, -np.inf)
            masked[allowed] = logits[allowed]
            token = int(np.argmax(masked))
            text.append(token)
            if token == EOS:
                break
            state = idx.get_next_state(state, token)
        got = np.asarray(out[row])[: len(text)].tolist()
        assert got == text, (regex, got, text)


def test_a_1d_prompt_and_a_shared_automaton_decode_as_their_batch_rows(model):
    ids, a = prompts(2, seed=3), from_outlines(index(REGEXES[4]))
    batch = np.asarray(eqrope.generate(model, ids, 8, eos_id=EOS, constraint=[a, a]))  # one table entry
    for row in range(2):
        alone = np.asarray(eqrope.generate(model, ids[row], 8, eos_id=EOS, constraint=[a]))
        assert np.array_equal(alone, batch[row]), row
    assert not np.array_equal(batch, np.asarray(eqrope.generate(model, ids, 8, eos_id=EOS)))


def test_sampled_rows_stay_inside_outlines_allowed_sets(model):
    regexes = REGEXES * 2
    ids = prompts(len(regexes), seed=2)
    out = eqrope.generate(
        model, ids, 16, eos_id=EOS, temperature=1.5, key=jax.random.key(0), num_samples=3,
        constraint=[from_outlines(index(r)) for r in regexes], return_logprobs=True,
    )  # fmt: skip
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    ended = 0
    for row, regex in enumerate(regexes):
        idx = index(regex)
        for j in range(3):
            new = tokens[row, j, ids.shape[1] : lengths[row, j]].tolist()
            state, eos = walk(idx, new)
            if eos:
                ended += 1
                assert idx.is_final_state(state), (regex, new)
            else:  # cut by max_new: a valid prefix
                assert len(new) == 16, (regex, new)
    assert ended > len(regexes)  # most rows finish


def test_logprobs_are_those_of_the_masked_distribution(model):
    ids, automaton, temperature = prompts(1, seed=4)[0], from_outlines(index(REGEXES[1])), 1.5
    out = eqrope.generate(
        model, ids, 6, eos_id=EOS, temperature=temperature, key=jax.random.key(1),
        constraint=automaton, return_logprobs=True,
    )  # fmt: skip
    idx, state, n = index(REGEXES[1]), index(REGEXES[1]).get_initial_state(), len(ids)
    for pos in range(n, int(out.lengths)):
        text = np.asarray(out.tokens)[:pos].tolist()
        token = int(out.tokens[pos])
        logits = last_logits(model, text).astype(np.float64) / temperature
        allowed = idx.get_allowed_tokens(state)
        masked = np.full_like(logits, -np.inf)
        masked[allowed] = logits[allowed]
        expected = masked[token] - np.log(np.sum(np.exp(masked[allowed])))
        own = logits[token] - np.log(np.sum(np.exp(logits)))
        assert np.isclose(float(out.logprobs[pos]), expected, atol=1e-4), pos
        assert np.isclose(float(out.model_logprobs[pos]), own, atol=1e-4), pos
        if token != EOS:
            state = idx.get_next_state(state, token)


def test_next_states_equal_a_linear_search_of_the_exceptions():
    rng = np.random.default_rng(0)
    vocab, states = 200, 9
    nexts = []
    for s in range(states):  # from no exception to most of the vocabulary
        ids = rng.choice(vocab, size=rng.integers(1, vocab), replace=False)
        nexts.append({int(t): int(rng.integers(0, states)) for t in ids})
    a = table([set(m) for m in nexts], nexts, [True] * states, vocab=vocab)
    c = constraint_of(a, None, (16, 4096), batch=1, batched=False, samples=None, vocab=vocab)
    state = rng.integers(0, states, size=500)
    token = np.array([rng.choice(list(nexts[s])) for s in state])
    got = jax.jit(advance)(c.table, jnp.asarray(state + 1, jnp.int32), jnp.asarray(token, jnp.int32), jnp.ones(500, bool))
    assert (np.asarray(got) - 1).tolist() == [nexts[s][t] for s, t in zip(state, token)]


# -- compiles ----------------------------------------------------------------------------------


def test_new_automata_within_the_capacity_compile_nothing(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="eqrope")
    # The line names what differs from the closest program compiled before: with no other
    # test's programs in the record, that is the unconstrained call just before.
    monkeypatch.setattr("eqrope.generation._compile_lines._SEEN", {})
    # A model of a width no other test uses (JAX's compiled programs are the worker's, and
    # test_generate's model has this module's shape): its first call is a new program.
    model = random_model(0, VOCAB, 32, 4, 2, MAX_LEN, n_kv_heads=2, d_ff=96)
    ids = prompts(3, seed=5)
    eqrope.generate(model, ids, 6, eos_id=EOS)
    caplog.clear()
    eqrope.generate(model, ids, 6, eos_id=EOS, constraint=[from_outlines(index(REGEXES[0])), None, None])
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiling generate")]
    assert len(lines) == 1 and "new: the constraint capacity (states x exceptions) none -> 64x1024" in lines[0], lines
    with counting() as c:
        for i, regex in enumerate(REGEXES[1:]):
            automata = [from_outlines(index(regex)), None, from_outlines(index(REGEXES[i]))]
            eqrope.generate(model, ids, 6, eos_id=EOS, constraint=automata, temperature=1.0, key=jax.random.key(i))
    assert c.traces["generate_program"] == 0, c.traces


# -- EOS, stuck rows, THINK ------------------------------------------------------------------


def test_eos_only_in_accepting_states(model):
    ids = prompts(1, seed=6)[0]
    free = [int(t) for t in np.asarray(eqrope.generate(model, ids, 3))[len(ids) :]]
    eos = free[0]  # the token greedy decoding picks first: make it the EOS id
    other = next(t for t in range(1, VOCAB) if t != eos)
    # State 0 lists the EOS id among its bits but does not accept; state 1 accepts and
    # allows nothing else: the row must write `other`, then end with EOS.
    a = table([{eos, other}, set()], [{eos: 1, other: 1}, {}], [False, True])
    out = np.asarray(eqrope.generate(model, ids, 5, eos_id=eos, constraint=a))
    assert out[len(ids) :].tolist() == [other, eos, eos, eos, eos]  # padded with the EOS id


def test_a_row_with_no_token_left_ends_without_nan(model):
    ids = prompts(2, seed=7)
    a = table([{3}, set()], [{3: 1}, {}], [False, True])
    # No EOS id: after 3 the row has nothing left; with min_new the accepting state's EOS
    # is held back too. Both end with nothing added, and finite log-probabilities.
    for kwargs in (dict(), dict(eos_id=EOS, min_new=4)):
        out = eqrope.generate(model, ids, 6, constraint=a, return_logprobs=True, pad_id=9, **kwargs)
        assert np.asarray(out.lengths).tolist() == [5, 5]
        assert np.asarray(out.tokens)[:, 4:].tolist() == [[3, 9, 9, 9, 9, 9]] * 2
        assert np.all(np.isfinite(np.asarray(out.logprobs)))


def _naive_think(think: list[int], new: list[int]) -> int | None:
    """Where the first occurrence of `think` in `new` ends (exclusive), or None."""
    for end in range(len(think), len(new) + 1):
        if new[end - len(think) : end] == think:
            return end
    return None


@pytest.mark.parametrize("think", [[1, 1, 2], [1, 2, 1, 2, 3], [2]])
def test_think_enters_the_schema_after_the_first_end_of_thinking(think):
    a = from_outlines(index(REGEXES[0]))
    c = constraint_of(a, think, None, batch=1, batched=False, samples=None, vocab=VOCAB)
    schema_start = 1  # the automaton's states follow FREE
    step = jax.jit(advance)
    rng = np.random.default_rng(0)
    for _ in range(40):
        new = rng.integers(1, 4, size=12).tolist()
        end = _naive_think(think, new)
        state = jnp.asarray(c.start)
        for i, t in enumerate(new):
            if end is not None and i == end:
                assert int(state[0]) == schema_start, (think, new)
                break
            assert int(state[0]) != schema_start, (think, new, i)
            state = step(c.table, state, jnp.asarray([t], jnp.int32), jnp.asarray([True]))
        else:
            assert (int(state[0]) == schema_start) == (end == len(new)), (think, new)


def test_think_then_schema_in_generate(model):
    ids = prompts(1, seed=8)[0]
    # While thinking everything but EOS is allowed: the greedy text of a call that holds EOS back.
    free = np.asarray(eqrope.generate(model, ids, 6, eos_id=EOS, min_new=6))[len(ids) :].tolist()
    think = free[2:4]
    end = _naive_think(think, free)
    out = np.asarray(eqrope.generate(model, ids, 14, eos_id=EOS, constraint=from_outlines(index(REGEXES[2])), think_end=think))
    new = out[len(ids) :].tolist()
    assert new[:end] == free[:end]
    state, eos = walk(index(REGEXES[2]), new[end:])
    assert eos and index(REGEXES[2]).is_final_state(state), new


# -- errors ------------------------------------------------------------------------------------


class _Schema:
    """A duck-typed schema: `compile(tokenizer, vocab=...)` gives an Automaton."""

    def __init__(self):
        self.calls = []

    def compile(self, tokenizer, vocab):
        self.calls.append((tokenizer, vocab))
        return table([{3}, set()], [{3: 1}, {}], [False, True], vocab=vocab)


def test_errors_name_the_argument_and_the_fix(model):
    ids, a = prompts(2), from_outlines(index(REGEXES[0]))
    cases = [
        (dict(constraint=table([{3}], [{3: 0}], [True], vocab=VOCAB + 3)), ValueError, "vocab=29"),
        (dict(constraint="[ab]+"), TypeError, "constraint must be an eqrope Automaton"),
        (dict(constraint=[a, _Schema()]), TypeError, "constraint[1].compile(tokenizer, vocab=model.vocab_size)"),
        (dict(constraint=[a]), ValueError, "one entry per prompt"),
        (dict(constraint=a, constraint_capacity=(4, 1024)), ValueError, "constraint_capacity=("),
        (dict(constraint=a, think_end=[]), ValueError, "think_end is empty"),
        (dict(constraint=a, think_end=[VOCAB]), ValueError, "think_end[0]"),
        (dict(think_end=[3]), ValueError, "pass constraint= too"),
        (dict(constraint=a, draft="prompt_lookup"), ValueError, "pass draft=None"),
        (dict(constraint=a._replace(exc_next=a.exc_next + 100)), ValueError, "exc_next holds a state outside"),
    ]
    for kwargs, error, words in cases:
        with pytest.raises(error, match=None) as info:
            eqrope.generate(model, ids, 4, eos_id=EOS, **kwargs)
        assert words in str(info.value), (kwargs, str(info.value))
    with pytest.raises(ValueError, match="cache protocol"):
        eqrope.generate(Uncached(model), ids, 4, constraint=a)


def test_generate_text_compiles_a_duck_typed_schema(model):
    tokenizers = pytest.importorskip("tokenizers")
    words = {f"w{i}": i for i in range(VOCAB - 4)}
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="w1"))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok = eqrope.Tokenizer(raw, eos_ids=(0,))
    schema = _Schema()
    texts = eqrope.generate_text(model, tok, ["w5 w6", "w7"], 5, constraint=[schema, None])
    assert schema.calls == [(tok, VOCAB)]
    assert texts[0] == "w3"  # 3, then the accepting state allows only EOS
