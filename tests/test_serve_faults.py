"""The server under faults, as a real process: a wrong API key, a burst of ten times its
slots, clients that leave, SIGTERM with requests in flight, and fuzzed request bodies. And
the engine thread's own isolation of a failed step, in process, with a fake engine.

Needs the `[serve]` extra (skipped without it).
"""

import asyncio
import collections
import concurrent.futures
import json
import time

import pytest
from _serve import serve, write_checkpoint


pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from eqrope.serving.server._worker import Ticket, Worker  # noqa: E402


SLOTS, WAITING, KEY = 2, 2, "sk-test-key"
LONG = 1024  # positions: a request of ~1000 tokens runs for seconds, long enough to leave
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("guarded"), max_len=LONG)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    args = ("--slots", str(SLOTS), "--max-waiting", str(WAITING), "--max-len", str(LONG), "--api-key", KEY)
    with serve(checkpoint, *args, log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


def metric(server, name: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def idle(server) -> bool:
    return metric(server, "eqrope_requests_running") == 0 and metric(server, "eqrope_kv_cache_usage_ratio") == 0


def wait_idle(server, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not idle(server):
        assert time.monotonic() < deadline, "the server still holds slots or pages"
        time.sleep(0.1)


def test_the_api_key_guards_every_v1_route(server, checkpoint):
    url = server.url + "/v1/completions"
    body = {"prompt": "The cat", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(url, json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    (card,) = client.models.list().data
    assert card.id == checkpoint.name  # the default name: the folder's
    assert client.completions.create(model=card.id, prompt="The cat", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_a_burst_of_ten_times_the_slots_loses_nothing(server):
    """Every request gets its whole answer or a 503 with Retry-After; none a 5xx
    otherwise, none lost; afterwards no slot or page is held."""
    body = {"prompt": "One, two", "max_tokens": 12, "temperature": 0, "ignore_eos": True}

    def send(i):
        r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=120)
        return r.status_code, r.headers.get("retry-after"), r.json()

    with concurrent.futures.ThreadPoolExecutor(10 * SLOTS) as pool:
        answers = list(pool.map(send, range(10 * SLOTS)))
    done = [a for a in answers if a[0] == 200]
    refused = [a for a in answers if a[0] == 503]
    assert len(done) + len(refused) == 10 * SLOTS, [a[0] for a in answers]
    assert done and refused  # the server took what it holds, and said so for the rest
    assert len({a[2]["choices"][0]["text"] for a in done}) == 1  # greedy: one answer
    assert all(a[2]["usage"]["completion_tokens"] == 12 for a in done)
    assert all(r[1] == "1" and r[2]["error"]["code"] == "server_overloaded" for r in refused)
    wait_idle(server)


def test_clients_that_leave_are_cancelled(server):
    """Streaming and plain requests whose clients close the connection early: each is
    cancelled (finish reason "abort") long before its 1000 tokens."""
    body = {"prompt": "The cat", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    tokens = metric(server, "eqrope_generation_tokens_total")
    label = 'eqrope_request_success_total{finished_reason="abort",model_name="guarded0"}'
    aborted = metric_line(server, label)
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, headers=AUTH) as r:
        next(line for line in r.iter_lines() if line)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=0.25)
    wait_idle(server)
    assert metric_line(server, label) - aborted == 2
    assert metric(server, "eqrope_generation_tokens_total") - tokens < 1000


def metric_line(server, name: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
    "stream", "stream_options", "logprobs", "top_logprobs", "echo", "stop", "seed", "presence_penalty",
    "frequency_penalty", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "best_of", "logit_bias", "user", "suffix", "response_format", "tools",
]  # fmt: skip
def mostly(valid, invalid):
    """`valid` 29 times in 30, else `invalid`: a body of many fields is often all valid."""
    return st.integers(0, 29).flatmap(lambda i: invalid if i == 0 else valid)


PLAUSIBLE = {
    "prompt": mostly(st.text(max_size=12) | st.lists(st.integers(0, 319), min_size=1, max_size=6), st.lists(st.integers(-5, 400), max_size=6)),
    "messages": mostly(
        st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]), "content": st.text(max_size=8)}), min_size=1, max_size=3),
        st.lists(JSON, max_size=2),
    ),
    "max_tokens": mostly(st.integers(1, 8), st.integers(-2, 70)), "n": mostly(st.integers(1, 2), st.integers(-1, 5)),
    "logprobs": mostly(st.integers(0, 5) | st.booleans(), st.integers(-1, 25)), "top_logprobs": mostly(st.integers(0, 5), st.integers(-1, 25)),
    "temperature": mostly(st.floats(0, 2), st.floats(-1, 3)), "top_p": mostly(st.floats(0.01, 1), st.floats(-0.5, 1.5)),
    "stop": mostly(st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=3), st.text(max_size=3) | JSON),
    "echo": st.booleans(), "stream": st.booleans(), "top_k": mostly(st.integers(-1, 320), st.integers(-2, 400)),
    "seed": mostly(st.integers(0, 2**32), st.integers(-(2**65), 2**65)), "min_tokens": mostly(st.integers(0, 4), st.integers(-1, 20)),
    "presence_penalty": mostly(st.floats(-2, 2), st.floats(-3, 3)), "repetition_penalty": mostly(st.floats(0.5, 2), st.floats(-1, 3)),
    "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()}), JSON),
}  # fmt: skip


def bodies(chat: bool):
    """Mostly plausible bodies (the checks let many through), some with noise: any field,
    known or not, set to any JSON value."""
    base = {"messages": PLAUSIBLE["messages"]} if chat else {"prompt": PLAUSIBLE["prompt"]}
    optional = {k: v for k, v in PLAUSIBLE.items() if k not in ("prompt", "messages")}
    plausible = st.fixed_dictionaries(base, optional=optional)
    noise = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), JSON, max_size=2)
    return st.tuples(plausible, noise, st.integers(0, 3)).map(lambda t: {**t[0], **t[1]} if t[2] == 0 else t[0])


CASES = st.booleans().flatmap(lambda chat: st.tuples(st.just(chat), bodies(chat), st.integers(0, 19)))


STATUSES = collections.Counter()


@pytest.fixture(scope="module")
def fresh_connections():
    """One client whose every request opens a connection of its own, as `httpx.post` does,
    without building a client (and its TLS context, ~25 ms of CPU) per request."""
    with httpx.Client(timeout=120, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        yield client


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(case=CASES)
def test_fuzzed_bodies_get_a_2xx_or_a_4xx_in_openais_shape(server, fresh_connections, case):
    chat, body, cut = case
    raw = cut == 0  # one body in twenty is cut short: not JSON
    url = server.url + ("/v1/chat/completions" if chat else "/v1/completions")
    name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    if body.get(name) is None or (type(body[name]) is int and body[name] > 8):  # keep the run short
        body[name] = 8
    content = json.dumps(body).encode() if not raw else json.dumps(body)[:-1].encode()
    r = fresh_connections.post(url, content=content, headers={**AUTH, "content-type": "application/json"})
    STATUSES[r.status_code] += 1
    assert r.status_code < 500 or r.status_code == 503, (body, r.status_code, r.text)
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    elif body.get("stream") is True:
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text, r.text
    else:
        assert r.json()["usage"]["total_tokens"] >= 1


def test_fuzzing_left_the_server_up_and_idle(server):
    # The bodies reached past the checks too: many ran, and many were refused.
    assert STATUSES[200] >= 50 and STATUSES[400] >= 50 and sum(STATUSES.values()) >= 500, STATUSES
    assert httpx.get(server.url + "/health").status_code == 200
    wait_idle(server)


def test_sigterm_drains_the_requests_in_flight_and_exits_0(checkpoint, tmp_path):
    body = {"prompt": "The cat", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    # The module server's flags (but the queue's and the key's): its programs, compiled or
    # reading the session's cache (tests/_serve.py).
    with serve(checkpoint, "--slots", str(SLOTS), "--max-len", str(LONG), "--no-warmup", log_dir=tmp_path) as s:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(httpx.post, s.url + "/v1/completions", json=body, timeout=120) for _ in range(2)]
            time.sleep(0.5)  # both requests are in (their first chunk runs)
            code = s.stop()
            answers = [f.result() for f in futures]
        assert code == 0, s.text()
        assert [a.status_code for a in answers] == [200, 200]
        assert all(a.json()["usage"]["completion_tokens"] == 40 for a in answers)
        with pytest.raises(httpx.ConnectError):  # it takes nothing more
            httpx.post(s.url + "/v1/completions", json=body, timeout=5)


# -- the engine's thread, in process -------------------------------------------------------


class FakeEngine:
    """Runs requests one token per step; a step that would serve `bad` raises."""

    def __init__(self, bad: int):
        self.bad, self.requests, self.ids = bad, {}, iter(range(10**6))

    def submit(self, prompt, config, key=None, constraint=None):
        rid = next(self.ids)
        self.requests[rid] = config.max_new
        return rid

    def has_work(self):
        return bool(self.requests)

    def step(self):
        from eqrope.serving import Event
        import numpy as np

        if self.bad in self.requests:
            raise RuntimeError("a device fault")
        events = []
        for rid in list(self.requests):
            self.requests[rid] -= 1
            done = self.requests[rid] == 0
            if done:
                del self.requests[rid]
            events.append(Event(rid, 0, np.asarray([7], np.int32), np.zeros(1, np.float32), done, "length" if done else None))
        return events

    def cancel(self, rid, sample=None):
        self.requests.pop(rid)


def test_a_failed_step_fails_its_requests_and_the_engine_serves_the_next():
    import eqrope

    async def main():
        engines = []

        def make():
            engines.append(FakeEngine(bad=1 if not engines else -1))
            return engines[-1]

        worker = Worker(make)
        worker.start()
        loop = asyncio.get_running_loop()
        queue = asyncio.Queue()
        config = eqrope.GenerationConfig(max_new=3)
        for tag in range(2):  # request 1 faults the engine's step: both in flight fail
            worker.submit(Ticket(loop, queue, tag, [1, 2], config, seed=0))
        failed = [await queue.get() for _ in range(2)]
        worker.submit(Ticket(loop, queue, "after", [1, 2], config, seed=0))
        events = [await queue.get() for _ in range(3)]
        worker.stop()
        return failed, events, len(engines)

    failed, events, built = asyncio.run(main())
    assert all(type(item).__name__ == "APIError" and item.status == 500 and "a device fault" in item.message for _, item in failed)
    assert [tag for tag, _ in events] == ["after"] * 3 and events[-1][1].finished
    assert built == 2


def test_every_int64_seed_has_a_key_of_its_own():
    import jax
    import numpy as np

    from eqrope.serving.server._worker import seed_key

    data = lambda seed: tuple(np.asarray(jax.random.key_data(seed_key(seed))).tolist())
    seeds = [0, 1, 7, 2**32 - 1, 2**32, 2**32 + 7, 2**40, 2**63 - 1, -1, -(2**63), -(2**32)]
    assert len({data(s) for s in seeds}) == len(seeds)
    for seed in (0, 7, 2**31, 2**32 - 1):  # as jax.random.key below 2**32
        assert data(seed) == tuple(np.asarray(jax.random.key_data(jax.random.key(seed))).tolist())
