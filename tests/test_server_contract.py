"""The server's request contract at its edges, each input named (tests/test_server_fuzz.py generates the
rest): numbers that are NaN, infinite, out of OpenAI's range or of the wrong JSON type, chat content as a
list of parts, bodies over the size limit (413, before the body is read) and clients too slow to send
their headers or their body (408). One live `optc serve` of random:tiny with a small body limit and a
short client timeout."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from optc.runtime import Engine, SamplingParams  # noqa: E402
from optc.testing import serve_process  # noqa: E402

MAX_BODY = 65536
TIMEOUT_S = 2.0
CHAT = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def server(tiny_artifact):
    args = ("--served-model-name", "tiny", "--max-body-bytes", str(MAX_BODY), "--client-timeout", str(TIMEOUT_S))
    with serve_process(tiny_artifact, *args) as (url, process):
        yield url


def post_raw(url: str, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(f"{url}{path}", content=raw, headers={"Content-Type": "application/json"}, timeout=30)


# (raw JSON of the field's value, the field): each a 400 naming the field
BAD_NUMBERS = [
    ("1e999", "temperature"), ("-1e999", "temperature"), ("NaN", "temperature"), ("Infinity", "temperature"),
    ("2.5", "temperature"), ("-0.5", "temperature"), ("1e308", "temperature"), ('"0.5"', "temperature"),
    ("true", "temperature"), ("[0.5]", "temperature"),
    ("NaN", "top_p"), ("0", "top_p"), ("1.5", "top_p"), ("-Infinity", "top_p"),
    ("-2", "top_k"), ("1.5", "top_k"), ('"5"', "top_k"), ("1" + "0" * 30, "top_k"),
    ("-1", "max_tokens"), ("1.5", "max_tokens"), ('"8"', "max_tokens"), ("1e999", "max_tokens"),
    ("1000000000000", "max_tokens"), ("true", "max_tokens"),
    ("-1", "logprobs"), ("21", "logprobs"), ("2.0", "logprobs"),
    ("1.0", "seed"), ("18446744073709551616", "seed"), ('"7"', "seed"),
    ("NaN", "presence_penalty"), ("1e999", "frequency_penalty"), ("2.5", "presence_penalty"),
    ("0", "n"), ("17", "n"), ("1.0", "n"),
    ('"yes"', "stream"), ("1", "echo"), ("null", "ignore_eos"), ("0", "return_token_ids"),
    ("5", "stop"), ('[""]', "stop"), ("[1, 2]", "stop"), ('{"a": 1}', "prompt"), ("[[[1]]]", "prompt"),
    ('{"include_usage": 1}', "stream_options"),
]


@pytest.mark.parametrize("raw, field", BAD_NUMBERS, ids=[f"{f}={r}" for r, f in BAD_NUMBERS])
def test_a_bad_completion_field_is_400_naming_it(server, raw, field):
    body = f'{{"model": "tiny", "prompt": "x", "max_tokens": 2, "{field}": {raw}}}'.encode()
    if field == "max_tokens":
        body = f'{{"model": "tiny", "prompt": "x", "max_tokens": {raw}}}'.encode()
    response = post_raw(server, "/v1/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"], error


@pytest.mark.parametrize("raw, field", [("3", "temperature"), ("NaN", "top_p"), ("0", "max_tokens"),
                                        ("0", "max_completion_tokens"), ("21", "top_logprobs"), ('"1"', "logprobs"),
                                        ("1e999", "temperature")])
def test_a_bad_chat_field_is_400_naming_it(server, raw, field):
    body = f'{{"model": "tiny", "messages": {json.dumps(CHAT)}, "{field}": {raw}}}'.encode()
    response = post_raw(server, "/v1/chat/completions", body)
    assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text


def test_openai_range_ends_are_accepted(server):
    for temperature, top_p in ((0, 1), (2, 1e-9), (2.0, 1.0)):
        body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "temperature": temperature, "top_p": top_p,
                "seed": 3}
        response = httpx.post(f"{server}/v1/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text


def test_text_parts_are_the_string_content(server, tiny_artifact):
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]}]
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    as_parts = httpx.post(f"{server}/v1/chat/completions", json=body | {"messages": parts}, timeout=30)
    as_string = httpx.post(f"{server}/v1/chat/completions", json=body | {"messages": CHAT}, timeout=30)
    assert as_parts.status_code == 200 and as_string.status_code == 200, as_parts.text
    engine = Engine.load(tiny_artifact)
    expected = engine.generate(["hello there"], SamplingParams(max_tokens=6, ignore_eos=True), chat=True)[0].text
    assert as_parts.json()["choices"][0]["message"]["content"] == expected
    assert as_string.json()["choices"][0]["message"]["content"] == expected


@pytest.mark.parametrize("part, words", [
    ({"type": "image_url", "image_url": {"url": "http://x/y.png"}}, "'image_url'"),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "'input_audio'"),
    ({"type": "file", "file": {"file_id": "f"}}, "'file'"),
    ({"type": "text"}, "'text'"),  # a text part without its text
    ({"type": "text", "text": 5}, "'text'"),
    ({"text": "no type"}, "type"),
])
def test_a_content_part_that_is_not_text_is_400_naming_its_type(server, part, words):
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, part]}]
    response = httpx.post(f"{server}/v1/chat/completions", json={"model": "tiny", "messages": messages}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and words in error["message"], error


@pytest.mark.parametrize("raw, words", [
    (b"{" * 60_000, "JSON"),  # unterminated
    (b"[" * 30_000 + b"]" * 30_000, "too deeply"),
    (b'{"model": "tiny", "prompt": "\xff\xfe"}', "JSON"),  # not UTF-8
    (b'{"model": "tiny", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", "JSON"),  # > 4300 digits
    (b"[1, 2]", "JSON object"), (b"", "JSON"),
])
def test_malformed_bodies_are_400(server, raw, words):
    response = post_raw(server, "/v1/completions", raw)
    assert response.status_code == 400 and words in response.json()["error"]["message"], response.text


def _exchange(url: str, chunks: list[bytes], pause_s: float = 0.0, read_timeout: float = 10.0) -> bytes:
    """Send `chunks` on a raw connection (pausing `pause_s` after all but the last), then read the answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=read_timeout) as s:
        for i, chunk in enumerate(chunks):
            s.sendall(chunk)
            if i < len(chunks) - 1:
                time.sleep(pause_s)
        answer = b""
        while True:
            try:
                data = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not data:
                break
            answer += data
    return answer


def test_a_body_over_the_limit_is_413_before_it_is_read(server):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000\r\n\r\n")
    t0 = time.monotonic()
    answer = _exchange(server, [head])  # no body follows: the answer cannot wait for it
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert time.monotonic() - t0 < TIMEOUT_S  # answered at once, not after the client timeout
    assert b"1000000000 bytes" in answer and str(MAX_BODY).encode() in answer


def test_a_chunked_body_is_413_once_it_passes_the_limit(server):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunk = b"%x\r\n%s\r\n" % (MAX_BODY // 2 + 1, b" " * (MAX_BODY // 2 + 1))
    answer = _exchange(server, [head, chunk, chunk])  # the last chunk (0) never comes
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


def test_a_body_at_the_limit_is_read(server):
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 1, "user": ""})
    body = body[:-2] + " " * (MAX_BODY - len(body)) + body[-2:]  # padded with spaces to exactly MAX_BODY bytes
    assert len(body.encode()) == MAX_BODY
    assert post_raw(server, "/v1/completions", body.encode()).status_code == 200


def test_slow_headers_are_cut_off_with_408(server):
    t0 = time.monotonic()
    answer = _exchange(server, [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"])  # the headers never end
    elapsed = time.monotonic() - t0
    assert answer.startswith(b"HTTP/1.1 408") and b"headers" in answer, answer[:200]
    assert TIMEOUT_S - 0.2 <= elapsed < TIMEOUT_S + 5


def test_a_slow_body_is_cut_off_with_408(server):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n")
    t0 = time.monotonic()
    answer = _exchange(server, [head, b'{"model": '], pause_s=0.1)  # 10 of 100 bytes, then nothing
    elapsed = time.monotonic() - t0
    assert b" 408 " in answer.split(b"\r\n")[0] and b"10 bytes came" in answer, answer[:300]
    assert TIMEOUT_S - 0.2 <= elapsed < TIMEOUT_S + 5


def test_the_server_still_serves_after_the_edges(server):
    response = httpx.post(f"{server}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                          timeout=30)
    assert response.status_code == 200 and httpx.get(f"{server}/health").status_code == 200
