"""Streaming redaction is exact through a real `serve`: for each family of the corpus,
a tool writes a case one byte per write(2) (`dd bs=1`), the call streams its output
(call.output), and no notification, nor the result, holds any of the case's secrets;
what was streamed is what the result holds. Also a key in a removed diff hunk and a
PEM key longer than any window."""

import os

import pytest

import corpus
from serve_helpers import ServeProc
from stockade_testlib import FIXTURES, PLUGINS, state_directory

SECRETS_POLICY = os.path.join(FIXTURES, "redact_secrets.lua")

RPC_TIMEOUT = 120


def first_case_per_family():
    """The first case of each family of the written half, and of each rule (source) of
    the held-out half, so that every rule the held-out cases exercise streams too."""
    seen = {}
    for c in corpus.load("positives.jsonl"):
        if c["family"] not in seen and len(c["text"]) <= 20000:
            seen[c["family"]] = c
    cases = [seen[f] for f in sorted(seen)]
    held = {}
    for c in corpus.load("heldout-positives.jsonl"):
        if c["source"] not in held and len(c["text"]) <= 20000 and not corpus.deliberate_miss(c):
            held[c["source"]] = c
    return cases + [held[s] for s in sorted(held)]


CASES = first_case_per_family()
STREAMED = []      # per case: did its output come in more than one notification


@pytest.fixture(scope="module")
def session(request, stockade, tmp_path_factory):
    with state_directory("stockade-rd-") as state:
        srv = ServeProc(stockade, state, SECRETS_POLICY,
                        log_dir=str(tmp_path_factory.mktemp("log")),
                        extra_env={"STOCKADE_PLUGIN_PATH": os.environ.get(
                            "STOCKADE_PLUGIN_PATH", PLUGINS)})
        try:
            yield srv.client.open_session()
        finally:
            srv.stop()


# Ordinary text before each case, so that the stream has something to deliver before
# the secret arrives: more than one notification shows the reads were small.
LEAD = ("ordinary output line\n" * 100).encode()


def byte_by_byte(session, text):
    data = LEAD + text.encode()
    h = session.start_call("sh", ["-c", "dd bs=1 status=none"], stdin=data, stream=True)
    chunks = list(h.output(timeout=RPC_TIMEOUT))
    r = h.result(RPC_TIMEOUT)
    assert r.ok, r
    streamed = b"".join(ch.data for ch in chunks if ch.stream == "stdout")
    assert streamed == r.stdout, "the stream and the result differ"
    assert r.stdout.startswith(LEAD), r.stdout[:200]
    return chunks, r


@pytest.mark.parametrize("case", CASES, ids=[c["family"] + ":" + c["source"][:60] for c in CASES])
def test_family_byte_by_byte(session, case):
    chunks, r = byte_by_byte(session, case["text"])
    assert r.redactions >= 1, r
    for s in case["secrets"]:
        b = s.encode()
        assert b not in r.stdout, f"{case['family']}: a secret came out: {r.stdout[:400]!r}"
        tail = b[-8:]
        assert all(tail not in ch.data for ch in chunks), f"{case['family']}: a notification held its tail"
    STREAMED.append(len(chunks) > 1)


def test_the_cases_streamed():
    """The premise of the tests above: the outputs came in several notifications. When
    the tool outruns the supervisor's reads one case may come in one piece; most must
    not."""
    if not STREAMED:
        pytest.skip("the byte-by-byte cases did not run in this session (-k?)")
    assert sum(STREAMED) * 2 >= len(STREAMED), f"only {sum(STREAMED)}/{len(STREAMED)} cases streamed"


def test_long_key_in_a_removed_hunk_byte_by_byte(session):
    keys = [c for c in corpus.load("positives.jsonl")
            if c["family"] == "private-key" and "16384" in c["source"] and "'-'" in c["source"]]
    assert keys, "the corpus has no RSA-16384 key in a removed hunk"
    chunks, r = byte_by_byte(session, keys[0]["text"])
    assert len(keys[0]["text"]) > 12000
    assert b"[REDACTED:private-key]" in r.stdout, r.stdout[:300]
    for s in keys[0]["secrets"]:
        assert s.encode() not in r.stdout
