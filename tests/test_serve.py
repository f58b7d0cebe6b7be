"""`python -m eqrope.serve` as a real process on 127.0.0.1, driven by clients nobody here
wrote: the `openai` package and httpx. Answers are compared with `eqrope.generate` (the
static-batch path, not the engine) and `eqrope.score` on the same checkpoint, read
independently in this process.

Needs the `[serve]` extra and the `openai` package (skipped without them).
"""

import json
import time

import jax
import numpy as np
import pytest

import eqrope

from _serve import serve, write_checkpoint


openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

MAX_LEN = 128
PROMPTS = ["The cat sat", "One, two, three,", "héllo wörld", "JSON: {"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("served"), max_len=MAX_LEN)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    with serve(checkpoint, "--slots", "4", "--max-len", str(MAX_LEN), "--served-model-name", "served", log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s
    assert s.process.returncode == 0, s.text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local(checkpoint):
    """The checkpoint read here, as a user would: the model and its tokenizer."""
    return eqrope.from_hf(checkpoint), eqrope.Tokenizer.from_pretrained(checkpoint)


def greedy(local, ids, max_new, eos=(1,)):
    """`eqrope.generate`'s greedy tokens for one prompt, up to and including an EOS."""
    model, _ = local
    out = np.asarray(eqrope.generate(model, np.asarray(ids, np.int32), max_new, eos_id=list(eos) or None))
    new = out[len(ids) :].tolist()
    return new[: new.index(eos[0]) + 1] if eos and eos[0] in new else new


def text_of(local, tokens):
    return local[1].decode([t for t in tokens if t != 1], skip_special_tokens=True)


def test_greedy_completions_equal_generate(client, local):
    _, tok = local
    for prompt in PROMPTS:
        got = client.completions.create(model="served", prompt=prompt, max_tokens=12, temperature=0)
        want = greedy(local, tok.encode(prompt), 12)
        assert got.choices[0].text == text_of(local, want)
        assert got.usage.completion_tokens == len(want)
        assert got.usage.prompt_tokens == len(tok.encode(prompt))
        assert got.choices[0].finish_reason == ("stop" if want[-1] == 1 else "length")


def test_a_batch_of_token_prompts_answers_each_by_index(client, local):
    _, tok = local
    ids = [tok.encode(p) for p in PROMPTS]
    got = client.completions.create(model="served", prompt=ids, max_tokens=6, temperature=0)
    assert [c.index for c in got.choices] == list(range(len(ids)))
    for choice, prompt in zip(got.choices, ids):
        assert choice.text == text_of(local, greedy(local, prompt, 6))


def test_chat_uses_the_checkpoints_template(client, local):
    _, tok = local
    messages = [{"role": "user", "content": "What color is the sky?"}]
    got = client.chat.completions.create(model="served", messages=messages, max_tokens=10, temperature=0)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == text_of(local, greedy(local, ids, 10))
    assert got.usage.prompt_tokens == len(ids)


def test_streaming_gives_the_same_text_in_pieces(client):
    kwargs = dict(model="served", prompt="The cat sat", max_tokens=20, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] is not None
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    chat = client.chat.completions.create(
        model="served", messages=[{"role": "user", "content": "hi"}], max_tokens=15, temperature=0, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in chat]
    plain = client.chat.completions.create(
        model="served", messages=[{"role": "user", "content": "hi"}], max_tokens=15, temperature=0
    )
    assert "".join(pieces) == plain.choices[0].message.content


def test_raw_stream_is_server_sent_events_ending_in_done(server):
    body = {"prompt": "héllo", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    pieces = [json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]]
    # A piece that split a multi-byte character would hold a U+FFFD that the whole text
    # does not: the pieces join to the whole text, replacement characters included.
    assert "".join(pieces) == whole


def test_n_samples_follow_the_seed(client):
    kwargs = dict(model="served", prompt="One, two", max_tokens=12, temperature=1.0, n=3, seed=7, extra_body={"ignore_eos": True})
    first = [c.text for c in client.completions.create(**kwargs).choices]
    again = [c.text for c in client.completions.create(**kwargs).choices]
    other = [c.text for c in client.completions.create(**{**kwargs, "seed": 8}).choices]
    assert first == again
    assert len(set(first)) == 3
    assert first != other


def test_sampled_tokens_equal_the_engine_with_the_seeds_key(client, local):
    model, tok = local
    prompt = tok.encode("The dog")
    got = client.completions.create(
        model="served", prompt=prompt, max_tokens=10, temperature=0.9, seed=11, extra_body={"top_k": 20, "ignore_eos": True}
    )
    engine = eqrope.Engine(model, slots=1, max_len=MAX_LEN)
    cfg = eqrope.GenerationConfig(max_new=10, temperature=0.9, top_k=20)
    (want,) = engine.generate([np.asarray(prompt, np.int32)], cfg, keys=[jax.random.key(11)])
    assert got.choices[0].text == tok.decode(want.tokens, skip_special_tokens=True)


def test_echo_logprobs_are_the_models(client, local):
    model, tok = local
    prompt = tok.encode("The cat sat on the mat")
    got = client.completions.create(
        model="served", prompt=prompt, max_tokens=1, temperature=0, logprobs=3, echo=True
    ).choices[0]
    lp = got.logprobs
    new = greedy(local, prompt, 1, eos=())
    ids = prompt + new
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = eqrope.score(model, np.asarray(ids, np.int32)).logprobs[1:]
    np.testing.assert_allclose(lp.token_logprobs[1:], want, atol=1e-4)
    # The greedy token is the top one where it was generated; each dict has k (+1) entries.
    assert max(lp.top_logprobs[-1].values()) == pytest.approx(lp.token_logprobs[-1], abs=1e-6)
    # Each dict maps token strings to log-probabilities (k, plus the token itself; tokens
    # whose strings coincide, such as partial characters, share a key): its best entry is
    # the model's best at that position.
    logits = np.asarray(model(np.asarray(ids, np.int32)), np.float64)
    best = (logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)).max(-1)
    np.testing.assert_allclose([max(d.values()) for d in lp.top_logprobs[1:]], best[:-1], atol=1e-4)
    assert all(1 <= len(d) <= 4 for d in lp.top_logprobs[1:])
    assert got.text.startswith(tok.decode(prompt, skip_special_tokens=True))


def test_chat_logprobs_have_the_top_tokens(client):
    got = client.chat.completions.create(
        model="served", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = got.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)  # greedy


def test_stop_strings_match_the_text_across_tokens(client, local):
    _, tok = local
    prompt = "One, two, three,"
    full = client.completions.create(model="served", prompt=prompt, max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    # A stop string that starts inside one token and ends inside a later one.
    ids = greedy(local, tok.encode(prompt), 30, eos=())
    pieces = [tok.decode([t]) for t in ids]
    k = next(i for i in range(1, len(pieces)) if len(pieces[i - 1]) >= 1 and len(pieces[i]) >= 1 and pieces[i - 1] + pieces[i] in text)
    start = len(tok.decode(ids[: k - 1])) + len(pieces[k - 1]) - 1
    stop = text[start : start + 2]
    got = client.completions.create(
        model="served", prompt=prompt, max_tokens=30, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    cut = text.find(stop)
    assert got.choices[0].text == text[:cut]
    assert got.choices[0].finish_reason == "stop"
    # completion_tokens counts through the token that completed the stop string.
    through = next(i for i in range(len(ids) + 1) if stop in tok.decode(ids[:i]))
    assert got.usage.completion_tokens == through


def test_tokenize_and_detokenize_are_the_tokenizers(server, local):
    _, tok = local
    for prompt in PROMPTS:
        r = httpx.post(server.url + "/tokenize", json={"prompt": prompt, "add_special_tokens": False}).json()
        assert r["tokens"] == tok.encode(prompt, add_special_tokens=False) and r["count"] == len(r["tokens"])
        back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()["prompt"]
        assert back == tok.decode(r["tokens"])
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == "</s>" and info["chat_template"] == tok.chat_template


def test_lm_evals_remote_tokenizer_reads_the_server(server, local):
    utils = pytest.importorskip("lm_eval.utils")
    assert utils.check_remote_tokenizer_support(server.url + "/v1/completions")
    remote = utils.RemoteTokenizer(server.url + "/v1/completions")
    assert remote.eos_token_id == 1
    assert remote.encode("The cat") == local[1].encode("The cat", add_special_tokens=False)


def test_models_lists_the_served_name(client):
    (card,) = client.models.list().data
    assert card.id == "served"


def metrics(server) -> dict:
    out = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_count_the_tokens_and_go_back_to_zero(server, client):
    before = metrics(server)
    got = client.completions.create(
        model="served", prompt=["a b", "c d e"], max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    after = metrics(server)
    label = '{model_name="served"}'
    assert after[f"eqrope_generation_tokens_total{label}"] - before[f"eqrope_generation_tokens_total{label}"] == 14
    assert after[f"eqrope_prompt_tokens_total{label}"] - before[f"eqrope_prompt_tokens_total{label}"] == got.usage.prompt_tokens
    assert after[f"eqrope_requests_running{label}"] == 0 and after[f"eqrope_kv_cache_usage_ratio{label}"] == 0
    assert after[f"eqrope_time_to_first_token_seconds_count{label}"] - before.get(f"eqrope_time_to_first_token_seconds_count{label}", 0) == 2
    assert f"eqrope_inter_token_latency_seconds_count{label}" in after


BAD = [
    ({"prompt": "x", "max_tokens": "8"}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 8.5}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "n": 99}, 400, "n"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "x", "stop": [""]}, 400, "stop"),
    ({"prompt": "x", "stop": 5}, 400, "stop"),
    ({"prompt": [0, 5, 99999]}, 400, "prompt"),
    ({"prompt": [[]]}, 400, "prompt"),
    ({"prompt": "x " * 200, "max_tokens": 4}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": MAX_LEN}, 400, "prompt"),
    ({"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ({"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ({"prompt": "x", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ({"prompt": "x", "response_format": {"type": "json_object"}}, 400, "response_format"),  # no --constraint-capacity
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ({"max_tokens": 3}, 400, "prompt"),
    ([1, 2], 400, None),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD)
def test_bad_fields_get_a_4xx_naming_them(server, body, status, param):
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert error["message"]


def test_bad_chat_fields_and_non_json_get_400s(server):
    url = server.url + "/v1/chat/completions"
    for body in ({"messages": "hi"}, {"messages": []}, {"messages": [{"role": "user", "content": 5}]},
                 {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
                 {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}):  # fmt: skip
        r = httpx.post(url, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] is not None, (body, r.text)
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(url, content=b"\xff\xfe", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert httpx.get(server.url + "/v1/nothing").status_code == 404
    assert httpx.get(server.url + "/v1/completions").json()["error"]["code"] == "method_not_allowed"


def test_openai_client_raises_its_own_errors(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="served", prompt="x", temperature=-2)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="x")


def test_a_client_that_leaves_frees_its_slot(server):
    body = {"prompt": "The cat", "max_tokens": 100, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        next(line for line in r.iter_lines() if line)  # the first chunk: the request runs
    label = '{model_name="served"}'
    for _ in range(200):  # bounded: about 20 s
        m = metrics(server)
        if m[f"eqrope_requests_running{label}"] == 0 and m[f"eqrope_kv_cache_usage_ratio{label}"] == 0:
            break
        time.sleep(0.1)
    assert m[f"eqrope_requests_running{label}"] == 0 and m[f"eqrope_kv_cache_usage_ratio{label}"] == 0
    assert m[f'eqrope_request_success_total{{finished_reason="abort",model_name="served"}}'] >= 1
