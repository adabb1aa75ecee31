"""`optc serve --data-parallel-size 2` as a live process on random:tiny, on a local Ray instance of its own (one
per module: 2 logical CPUs, one replica each): greedy text as one engine's, both replicas serve, the requests of
one prefix land on one replica, /metrics labels each series with its replica, auth and errors as a single
server's; a SIGKILLed replica's request in flight ends with an error, the server answers right again within
120 s (Ray restarts the replica); SIGTERM ends the server with nothing left running. Bad option combinations
exit 2 before Ray starts."""

from __future__ import annotations

import os
import re
import signal
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("ray")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from typer.testing import CliRunner  # noqa: E402

from optc.cli import app  # noqa: E402
from optc.runtime import Engine, SamplingParams  # noqa: E402
from optc.runtime.server.replicas import _descendants  # noqa: E402
from optc.runtime.server.routing import prefix_chain  # noqa: E402
from optc.testing import serve_process  # noqa: E402

KEY = "secret"
# 6 prefixes of 3 blocks (16 tokens each: the tiny tokenizer spends a token per byte), 3 questions each
PREFIXES = [f"Document {i}: " + "abcdefghij"[i] * 40 for i in range(6)]
PROMPTS = [p + q for p in PREFIXES for q in (" What?", " Why not?", " Who is it?")]


@pytest.fixture(scope="module")
def server(tiny_artifact):
    with tempfile.TemporaryFile("w+") as log, serve_process(tiny_artifact, "--data-parallel-size", "2", "--api-key",
                                                            KEY, log=log, timeout=180) as (url, process):
        yield url, process, log


def test_replicas_give_one_engines_text_and_keep_a_prefix_on_one_replica(server, tiny_artifact):
    url, _, _ = server
    params = SamplingParams(max_tokens=6, temperature=0.0)
    want = [out.text for out in Engine.load(tiny_artifact).generate(PROMPTS, params)]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=60, max_retries=0)
    complete = lambda prompt: client.completions.create(model="a", prompt=prompt, max_tokens=6,  # noqa: E731
                                                       temperature=0).choices[0].text
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        assert list(pool.map(complete, PROMPTS)) == want
    assert all(n > 0 for n in _finished(url).values()) and len(_finished(url)) == 2  # both replicas served
    for prefix in PREFIXES:  # each prefix again, one request at a time: always the same replica
        served = set()
        for question in (" Again?", " And then?"):
            before = _finished(url)
            complete(prefix + question)
            served |= {r for r, n in _finished(url).items() if n > before.get(r, 0)}
        assert len(served) == 1, prefix
    chunks = list(client.completions.create(model="a", prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want[0]
    assert httpx.post(f"{url}/v1/completions", json={"model": "a", "prompt": "x"}).status_code == 401
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="a", prompt=[1] * 600, max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=4)


def test_a_killed_replica_is_replaced_and_the_server_answers_right(server, tiny_artifact):
    url, process, _ = server
    want = Engine.load(tiny_artifact).generate([PROMPTS[0]], SamplingParams(max_tokens=6))[0].text
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=60, max_retries=0)
    replicas = [pid for pid in _descendants(process.pid) if b"ServeReplica" in _cmdline(pid)]
    assert len(replicas) == 2
    ids = set(_finished(url))
    readers = []
    for prefix in ("Long one", "Long two"):  # two new prefixes in flight at once: one on each replica
        stream = client.completions.create(model="a", prompt=prefix + " x" * 20, max_tokens=440, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        received, failed, done = threading.Event(), threading.Event(), threading.Event()
        threading.Thread(target=_read, args=(stream, received, failed, done), daemon=True).start()
        readers.append((received, failed, done))
    assert all(received.wait(60) for received, _, _ in readers)
    os.kill(replicas[0], signal.SIGKILL)
    start = time.monotonic()
    assert all(done.wait(60) for _, _, done in readers)
    assert sorted(failed.is_set() for _, failed, _ in readers) == [False, True]  # the other replica served on
    answers = []
    while time.monotonic() - start < 120 and len(answers) < 5:
        try:
            answers.append(client.completions.create(model="a", prompt=PROMPTS[0], max_tokens=6,
                                                     temperature=0).choices[0].text)
        except openai.APIError:
            time.sleep(0.5)
    assert answers == [want] * 5
    while time.monotonic() - start < 120 and (len(_finished(url)) < 2 or set(_finished(url)) == ids):
        time.sleep(1)
    assert len(_finished(url)) == 2 and set(_finished(url)) != ids  # Ray started a replica in the dead one's place


def test_sigterm_leaves_nothing_running(server):
    _, process, log = server
    descendants = _descendants(process.pid)
    assert len(descendants) >= 4  # Ray's GCS, raylet, controller, replicas
    process.send_signal(signal.SIGTERM)
    assert process.wait(90) == 0, _tail(log)
    time.sleep(1)
    assert [pid for pid in descendants if _is_running(pid)] == [], _tail(log)


@pytest.mark.parametrize("args, message", [
    (["--ray-address", "127.0.0.1:6379"], "--ray-address needs --data-parallel-size"),
    (["--max-replicas", "3"], "--max-replicas needs --data-parallel-size"),
    (["-dp", "2", "--min-replicas", "3"], "1 <= --min-replicas (3) <= --data-parallel-size (2)"),
    (["-dp", "2", "--max-replicas", "1"], "--data-parallel-size (2) <= --max-replicas (1)"),
])
def test_bad_replica_options_exit_2(tiny_artifact, args, message):
    result = CliRunner().invoke(app, ["serve", str(tiny_artifact), *args])
    assert result.exit_code == 2
    assert message in result.output


def test_prefix_chain_hashes_whole_blocks_of_the_prefix():
    a, b = prefix_chain(list(range(40)), 16), prefix_chain(list(range(32)) + [9] * 8, 16)
    assert len(a) == 2 and a == b  # the partial third block does not count
    assert prefix_chain([1] + list(range(1, 32)), 16)[1] != a[1]  # a block's hash covers the blocks before it
    assert prefix_chain(list(range(15)), 16) == [] and len(prefix_chain(list(range(400)), 16)) == 8


def _finished(url: str) -> dict[str, float]:
    """Finished requests per replica (the `replica` label of /metrics)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    counts: dict[str, float] = {}
    for _, replica, value in re.findall(
            r'optc:request_success_total\{finished_reason="(\w+)",model_name="[^"]*",replica="(\w+)"\} (\S+)', text):
        counts[replica] = counts.get(replica, 0.0) + float(value)
    return counts


def _read(stream, received: threading.Event, failed: threading.Event, done: threading.Event) -> None:
    try:
        for _ in stream:
            received.set()
    except openai.APIError:
        failed.set()
    finally:
        done.set()


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _is_running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _tail(log) -> str:
    log.seek(0)
    return log.read()[-3000:]
