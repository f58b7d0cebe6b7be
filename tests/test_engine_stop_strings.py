"""Stop strings matched on the text inside the engine's compiled loop (issue 43), opt-in
with `max_stop_strings=`.

Each request is compared with `eqrope.generate` of it alone (the static-cache path, with
the same `StopStrings`), on the byte-level BPE checkpoint of `tests/_serve.py`, for
strings the model writes with other tokens than the string's own encoding; the finish
reason with a byte search of the decoded text (`test_stop_strings._search`).
"""

import jax
import numpy as np
import pytest

import eqrope
from eqrope import GenerationConfig as Config

from _compiles import counting
from test_stop_strings import NEW, PROMPT, _crossing_strings, _free, _search, checkpoint, model, tok  # noqa: F401


# max_len 128 (the checkpoint's); 4 slots, one decode bucket: one program per engine.
ENGINE = {"slots": 4, "decode_buckets": (4,), "max_len": 128, "page_size": 16, "prefill_chunk": 32, "decode_steps": 8}
OTHER = "One, two"  # a second prompt, for text of some variety


@pytest.fixture(scope="module")
def engine(model):
    return eqrope.Engine(model, max_stop_strings=2, **ENGINE)


@pytest.fixture(scope="module")
def cases(model, tok):
    """(prompt ids, new tokens without a stop, three crossing strings) of two prompts."""
    out = []
    for text in (PROMPT, OTHER):
        ids, new = _free(model, tok, text)
        strings = _crossing_strings(tok, new, 3, text)
        assert len(strings) == 3
        out.append((ids, new, strings))
    return out


def _reference(model, tok, ids, stop, key, **settings):
    """`generate` alone: the new tokens, and the finish reason read from the text."""
    out = eqrope.generate(
        model, ids, NEW, eos_id=list(tok.eos_ids), stop=stop, key=key, return_logprobs=True, **settings
    )
    new = np.asarray(out.tokens)[len(ids) : int(out.lengths)].tolist()
    strings = [s.encode() for entry in stop or () for s in getattr(entry, "strings", ())]
    sequences = [list(entry) for entry in stop or () if not hasattr(entry, "strings")]
    spelled = tok.token_bytes()
    written = ids.tolist() + new
    if new[-1] in tok.eos_ids:
        reason = "eos"
    elif _search(spelled, written, strings) or any(written[-len(s) :] == s for s in sequences):
        reason = "stop"
    else:
        reason = "length"
    return new, reason


def test_each_request_stops_where_generate_alone_stops(engine, model, tok, cases):
    requests = []  # (ids, stop, settings)
    for ids, new, strings in cases:
        for s in strings:
            requests.append((ids, [eqrope.StopStrings(tok, [s])], {}))
        requests.append((ids, None, {}))  # a neighbour without stop strings
        requests.append((ids, [eqrope.StopStrings(tok, strings[1:])], {}))  # two strings, the earlier wins
        requests.append((ids, [new[40:42], eqrope.StopStrings(tok, [strings[2]])], {}))  # with a sequence
        requests.append((ids, [eqrope.StopStrings(tok, [strings[0]])], {"temperature": 0.7}))
    keys = [jax.random.key(i) for i in range(len(requests))]
    configs = [Config(max_new=NEW, eos_id=list(tok.eos_ids), stop=stop, **kw) for _, stop, kw in requests]
    out = engine.generate([ids for ids, _, _ in requests], configs, keys=keys)
    reasons = []
    for (ids, stop, kw), key, completion in zip(requests, keys, out):
        new, reason = _reference(model, tok, ids, stop, key, **kw)
        assert completion.tokens.tolist() == new, stop
        assert completion.finish_reason == reason, stop
        reasons.append(reason)
    assert reasons.count("stop") >= 8  # the strings do stop the text, early
    assert "length" in reasons  # and the neighbours without them run on


def test_refused_with_the_argument_that_raises_it(model, tok, cases):
    ids = cases[0][0]

    def stop(*strings):
        return Config(max_new=4, stop=[eqrope.StopStrings(tok, list(strings))])

    off = eqrope.Engine(model, **ENGINE)
    with pytest.raises(ValueError, match=r"build the Engine with max_stop_strings=1 or more"):
        off.submit(ids, stop("cat"))
    small = eqrope.Engine(model, max_stop_strings=1, max_stop_string_bytes=8, max_stop_string_tokens=4, **ENGINE)
    with pytest.raises(ValueError, match=r"2 stop strings, .*\(1\); build the Engine with max_stop_strings=2 or"):
        small.submit(ids, stop("cat", "dog"))
    with pytest.raises(ValueError, match=r"build the Engine with max_stop_string_bytes=9 or more"):
        small.submit(ids, stop("the mat. "))
    # A string of one byte: every token that holds it can end a match.
    holding = sum(b"e" in b for b in tok.token_bytes())
    assert holding > 4
    with pytest.raises(ValueError, match=rf"build the Engine with max_stop_string_tokens={holding} or more"):
        small.submit(ids, stop("e"))
    with pytest.raises(ValueError, match="max_stop_strings must be an int >= 0"):
        eqrope.Engine(model, max_stop_strings=-1, **ENGINE)


def _decode_tables(engine) -> list[tuple]:
    """The shapes of the stop-string tables each decode call of `engine` stacks."""
    shapes, decode = [], engine.runner.decode

    def spy(rows, live, tables, sampling, *args):
        shapes.append(np.shape(sampling.stop_text.at))
        return decode(rows, live, tables, sampling, *args)

    engine.runner.decode = spy
    return shapes


def test_off_by_default_the_tables_stay_tiny(model, tok, cases):
    ids = cases[0][0]
    off = eqrope.Engine(model, **ENGINE)
    shapes = _decode_tables(off)
    off.generate([ids, ids], Config(max_new=6))
    assert shapes and set(shapes) == {(4, 1, 1, 1)}
    # On: every slot's table has the capacities' shape, rounded up to powers of two.
    on = eqrope.Engine(model, max_stop_strings=3, max_stop_string_bytes=10, max_stop_string_tokens=200, **ENGINE)
    shapes = _decode_tables(on)
    on.generate([ids, ids], [Config(max_new=6), Config(max_new=6, stop=[eqrope.StopStrings(tok, ["cat"])])])
    assert shapes and set(shapes) == {(4, 256, 4, 16)}


def test_other_strings_compile_nothing(engine, tok, cases):
    (ids, _, strings), (other, _, more) = cases
    engine.warmup()
    engine.generate([ids], Config(max_new=NEW, stop=[eqrope.StopStrings(tok, [strings[0]])]))  # the host's check
    with counting() as c:
        for s in (*strings[1:], *more):
            engine.generate([ids, other], Config(max_new=NEW, stop=[eqrope.StopStrings(tok, [s])]))
        engine.generate([other], Config(max_new=NEW, stop=[eqrope.StopStrings(tok, more[:2])]))
    assert sum(c.compiles.values()) == 0, dict(c.compiles)
