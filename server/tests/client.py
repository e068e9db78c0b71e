"""Clients against a running `pagedattn serve`: the official `openai`
package for the API, the standard library's http.client for what a
client library hides (status codes, headers, a connection cut mid-stream).

Run by server/tests/openai.rs (and cli/tests/serve.rs) against servers
they start; each mode exits non-zero on the first failed check and prints
one line per passed one.

  client.py main   --base URL --key-a KEY --key-b KEY --fixture PATH
  client.py load   --base URL --fixture PATH --streams N --limit N
  client.py until-end --base URL
"""

import argparse
import asyncio
import http.client
import json
import sys
import threading
import time
import urllib.parse

import openai

ARGS = None


def say(msg):
    print(msg, flush=True)


def check(cond, what):
    if not cond:
        raise AssertionError(what)


# ---------------------------------------------------------------- raw HTTP


def raw(method, path, body=None, key=None, headers=None, timeout=600):
    """One request; returns (status, headers dict, parsed JSON or text)."""
    u = urllib.parse.urlparse(ARGS.base)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    h = {"Content-Type": "application/json"}
    if key:
        h["Authorization"] = f"Bearer {key}"
    h.update(headers or {})
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    c.request(method, path, body=data, headers=h)
    r = c.getresponse()
    text = r.read().decode()
    hdrs = {k.lower(): v for k, v in r.getheaders()}
    c.close()
    try:
        return r.status, hdrs, json.loads(text)
    except json.JSONDecodeError:
        return r.status, hdrs, text


def metrics():
    status, _, text = raw("GET", "/metrics")
    check(status == 200, f"/metrics answered {status}")
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        out[name] = float(value)
    return out


def metric(name):
    return metrics().get(name, 0.0)


class RawStream:
    """A streamed request read line by line on its own connection."""

    def __init__(self, path, body, key=None):
        u = urllib.parse.urlparse(ARGS.base)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
        h = {"Content-Type": "application/json"}
        if key:
            h["Authorization"] = f"Bearer {key}"
        self.conn.request("POST", path, body=json.dumps(body).encode(), headers=h)
        self.resp = self.conn.getresponse()
        self.comments = 0

    def events(self):
        """The `data:` payloads, parsed (None for [DONE]); counts comments."""
        while True:
            line = self.resp.fp.readline()
            if not line:
                return
            line = line.decode().rstrip("\r\n")
            if line.startswith(":"):
                self.comments += 1
            elif line.startswith("data: "):
                payload = line[len("data: "):]
                if payload == "[DONE]":
                    yield None
                    return
                yield json.loads(payload)

    def close(self):
        # Cut the connection as a client that leaves does.
        self.conn.sock.close()
        self.conn.close()


# ------------------------------------------------------------ main checks


def client(key):
    return openai.OpenAI(base_url=ARGS.base + "/v1", api_key=key, max_retries=0, timeout=600)


def model_name(c):
    return c.models.list().data[0].id


def ids_of(logprobs_tokens):
    return [int(t.split(":", 1)[1]) for t in logprobs_tokens]


def test_models_and_auth(fx):
    c = client(ARGS.key_a)
    models = c.models.list().data
    check(len(models) == 1 and models[0].owned_by == "pagedattn", f"models: {models}")
    for key in ["sk-wrong-key-000", None]:
        status, _, body = raw("POST", "/v1/completions", {"prompt": "hi"}, key=key)
        check(status == 401 and body["error"]["type"] == "authentication_error", f"{key}: {status} {body}")
    try:
        client("sk-wrong-key-000").completions.create(model=model_name(c), prompt="hi")
        check(False, "a wrong key was served")
    except openai.AuthenticationError:
        pass
    say("ok: /v1/models, and 401 for a missing or wrong key")


def test_greedy_matches_the_fixture(fx):
    """Greedy tokens through the server, the prompts as token ids (one
    request holding all eight), equal llama.cpp's."""
    c = client(ARGS.key_a)
    g = fx["greedy"]
    r = c.completions.create(
        model=model_name(c),
        prompt=[x["prompt_ids"] for x in g],
        max_tokens=64,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    check(len(r.choices) == len(g), f"{len(r.choices)} choices")
    for ch in r.choices:
        want = g[ch.index]["tokens"]
        got = ids_of(ch.logprobs.tokens)
        check(got == want, f"prompt {ch.index}: {got[:12]}... != {want[:12]}...")
        check(ch.finish_reason == "length", ch.finish_reason)
    check(r.usage.completion_tokens == 64 * len(g), r.usage)
    check(r.usage.prompt_tokens == sum(len(x["prompt_ids"]) for x in g), r.usage)
    # Streamed, one of them: the same tokens, token by token.
    x = g[0]
    stream = c.completions.create(
        model=model_name(c),
        prompt=x["prompt_ids"],
        max_tokens=64,
        temperature=0,
        logprobs=0,
        stream=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    got = []
    for chunk in stream:
        for ch in chunk.choices:
            if ch.logprobs:
                got += ids_of(ch.logprobs.tokens)
    check(got == x["tokens"], "streamed greedy tokens differ")
    say(f"ok: greedy tokens of {len(g)} prompts x 64 equal the fixture's, whole and streamed")


def test_samples_match_the_fixture_and_the_seed(fx):
    c = client(ARGS.key_a)
    for s in fx["sample"]:
        args = dict(
            model=model_name(c),
            prompt=s["prompt_ids"],
            n=s["n"],
            max_tokens=s["max_tokens"],
            temperature=s["temperature"],
            top_p=s["top_p"],
            seed=s["seed"],
            logprobs=0,
            # The fixture samples without a repetition penalty; the
            # server's default for a sampled request has one.
            extra_body={
                "top_k": s["top_k"],
                "repetition_penalty": 1.0,
                "ignore_eos": True,
                "return_tokens_as_token_ids": True,
            },
        )
        r = c.completions.create(**args)
        for ch in r.choices:
            check(ids_of(ch.logprobs.tokens) == s["branches"][ch.index], f"{s['user']}: branch {ch.index}")
        again = c.completions.create(**args)
        check([x.text for x in again.choices] == [x.text for x in r.choices], "same seed, other text")
    say(f"ok: {len(fx['sample'])} sampled requests (n = 4) equal the fixture's branches; the same seed gives the same text")


def test_samples_share_the_prompt_blocks(fx):
    """n = 4 streamed: while it runs, /metrics shows the prompt's blocks
    shared by the four sequences."""
    s = RawStream(
        "/v1/completions",
        {
            "prompt": fx["greedy"][2]["prompt_ids"],
            "n": 4,
            "max_tokens": 48,
            "temperature": 1.0,
            "seed": 5,
            "ignore_eos": True,
            "stream": True,
        },
        key=ARGS.key_a,
    )
    shared = 0
    seen = set()
    for ev in s.events():
        if ev is None:
            break
        seen.update(ch["index"] for ch in ev["choices"])
        if len(seen) == 4 and shared == 0:
            shared = metric("pagedattn_kv_blocks_shared")
    check(seen == {0, 1, 2, 3}, f"choices {seen}")
    # 38 prompt tokens: 2 full blocks held by all four sequences.
    check(shared >= 2, f"kv_blocks_shared {shared} while 4 samples ran")
    say(f"ok: n = 4 streamed; /metrics showed {shared:.0f} KV blocks shared while it ran")


def test_beams_match_the_fixture(fx):
    c = client(ARGS.key_a)
    for b in fx["beam"]:
        r = c.completions.create(
            model=model_name(c),
            prompt=b["prompt_ids"],
            n=b["width"],
            max_tokens=b["steps"],
            temperature=0,
            logprobs=0,
            extra_body={"use_beam_search": True, "ignore_eos": True, "return_tokens_as_token_ids": True},
        )
        got = [ids_of(ch.logprobs.tokens) for ch in sorted(r.choices, key=lambda ch: ch.index)]
        check(got == [x["tokens"] for x in b["beams"]], f"{b['user']}: beams differ")
        status, _, body = raw(
            "POST",
            "/v1/completions",
            {"prompt": "x", "n": 2, "use_beam_search": True, "temperature": 0.7},
            key=ARGS.key_a,
        )
        check(status == 400 and body["error"]["param"] == "use_beam_search", f"{status} {body}")
    say(f"ok: beam search (width 4) gives the fixture's {len(fx['beam'])} beam sets; sampling values with beams are refused")


def test_chat(fx):
    c = client(ARGS.key_a)
    msgs = [
        {"role": "system", "content": "You answer in one sentence."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    r = c.chat.completions.create(model=model_name(c), messages=msgs, max_tokens=40, temperature=0)
    ch = r.choices[0]
    check(ch.message.role == "assistant" and ch.message.content, f"{ch}")
    check(ch.finish_reason in ("stop", "length"), ch.finish_reason)
    check("<|im_end|>" not in ch.message.content, ch.message.content)
    check(r.usage.prompt_tokens > 10 and r.usage.completion_tokens > 0, r.usage)
    streamed = ""
    finish = None
    for chunk in c.chat.completions.create(
        model=model_name(c), messages=msgs, max_completion_tokens=40, temperature=0, stream=True
    ):
        for x in chunk.choices:
            streamed += x.delta.content or ""
            finish = x.finish_reason or finish
    check(streamed == ch.message.content, f"stream {streamed!r} != {ch.message.content!r}")
    check(finish == ch.finish_reason, f"{finish} != {ch.finish_reason}")
    # The chat template's rendering, as /tokenize gives it.
    status, _, tok = raw("POST", "/tokenize", {"messages": msgs}, key=ARGS.key_a)
    check(status == 200 and tok["count"] == r.usage.prompt_tokens, f"{status} {tok} {r.usage}")
    say(f"ok: chat whole and streamed agree ({ch.finish_reason}): {ch.message.content[:60]!r}")


def test_logprobs(fx):
    c = client(ARGS.key_a)
    r = c.completions.create(model=model_name(c), prompt="The sky is", max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    check(len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens, f"{lp}")
    check(all(x <= 0 for x in lp.token_logprobs), lp.token_logprobs)
    check(all(1 <= len(t) <= 4 for t in lp.top_logprobs), lp.top_logprobs)
    check(lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset), lp.text_offset)
    # Greedy: the chosen token is the most likely one.
    for tok, top in zip(lp.token_logprobs, lp.top_logprobs):
        check(abs(max(top.values()) - tok) < 1e-9, f"{tok} vs {top}")
    r = c.chat.completions.create(
        model=model_name(c),
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    check(len(content) == 5 and all(len(e.top_logprobs) == 2 for e in content), f"{content}")
    check(all(e.bytes is not None for e in content), "bytes")
    n = 0
    for chunk in c.chat.completions.create(
        model=model_name(c),
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        for x in chunk.choices:
            if x.logprobs and x.logprobs.content:
                n += len(x.logprobs.content)
    check(n == 5, f"{n} streamed logprobs")
    status, _, body = raw("POST", "/v1/completions", {"prompt": "x", "logprobs": 21}, key=ARGS.key_a)
    check(status == 400 and body["error"]["param"] == "logprobs", f"{status} {body}")
    say("ok: logprobs (completions top-3, chat top-2, streamed) consistent with greedy; 21 refused")


def greedy_text(c, prompt_ids, n):
    r = c.completions.create(
        model=model_name(c), prompt=prompt_ids, max_tokens=n, temperature=0, extra_body={"ignore_eos": True}
    )
    return r.choices[0].text


def test_stop_strings(fx):
    c = client(ARGS.key_a)
    x = fx["greedy"][0]
    full = greedy_text(c, x["prompt_ids"], 40)
    # A stop string from the middle of the greedy answer.
    words = full.split(" ")
    stop = " " + words[len(words) // 2]
    cut = full.index(stop)
    r = c.completions.create(
        model=model_name(c), prompt=x["prompt_ids"], max_tokens=40, temperature=0, stop=[stop, "\u2603never"]
    )
    ch = r.choices[0]
    check(ch.text == full[:cut], f"{ch.text!r} != {full[:cut]!r}")
    check(ch.finish_reason == "stop" and ch.model_extra.get("stop_reason") == stop, f"{ch}")
    streamed = ""
    for chunk in c.completions.create(
        model=model_name(c), prompt=x["prompt_ids"], max_tokens=40, temperature=0, stop=stop, stream=True
    ):
        streamed += "".join(y.text for y in chunk.choices)
    check(streamed == full[:cut], f"streamed {streamed!r} != {full[:cut]!r}")
    # A stop token id: the answer ends before it.
    want = x["tokens"]
    r = c.completions.create(
        model=model_name(c),
        prompt=x["prompt_ids"],
        max_tokens=40,
        temperature=0,
        extra_body={"stop_token_ids": [want[5]], "ignore_eos": True},
    )
    ch = r.choices[0]
    k = want.index(want[5])
    check(ch.finish_reason == "stop" and ch.model_extra.get("stop_reason") == want[5], f"{ch}")
    check(r.usage.completion_tokens == k + 1, f"{r.usage} (stop at token {k})")
    say(f"ok: stop string {stop!r} ends the answer before it (whole and streamed); a stop token id too")


def test_penalties_and_echo(fx):
    c = client(ARGS.key_a)
    x = fx["greedy"][0]
    plain = greedy_text(c, x["prompt_ids"], 48)
    r = c.completions.create(
        model=model_name(c),
        prompt=x["prompt_ids"],
        max_tokens=48,
        temperature=0,
        extra_body={"repetition_penalty": 1.5, "ignore_eos": True},
    )
    check(r.choices[0].text != plain, "a repetition penalty of 1.5 changed nothing")
    r2 = c.completions.create(
        model=model_name(c),
        prompt=x["prompt_ids"],
        max_tokens=48,
        temperature=0,
        frequency_penalty=1.0,
        presence_penalty=0.5,
        extra_body={"ignore_eos": True},
    )
    check(r2.choices[0].text != plain, "frequency and presence penalties changed nothing")
    r = c.completions.create(model=model_name(c), prompt="Once upon a time", max_tokens=4, temperature=0, echo=True)
    check(r.choices[0].text.startswith("Once upon a time"), r.choices[0].text)
    say("ok: repetition, frequency and presence penalties change greedy text; echo returns the prompt first")


def cached(key, prompt, salt=None):
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    if salt:
        body["cache_salt"] = salt
    status, _, r = raw("POST", "/v1/completions", body, key=key)
    check(status == 200, f"{status} {r}")
    return r["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_tenants_do_not_share_cached_prompts(fx):
    prompt = " ".join(f"tenant-probe word{i}" for i in range(40))
    check(cached(ARGS.key_a, prompt) == 0, "cold")
    hit = cached(ARGS.key_a, prompt)
    check(hit >= 64, f"alice's second request hit {hit} tokens")
    check(cached(ARGS.key_b, prompt) == 0, "bob hit alice's cached prompt")
    check(cached(ARGS.key_a, prompt, salt="other") == 0, "a cache_salt shares the tenant's namespace")
    check(cached(ARGS.key_b, prompt) >= 64, "bob's own second request missed")
    # Streamed usage reports the same.
    s = RawStream(
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}},
        key=ARGS.key_a,
    )
    usage = [ev["usage"] for ev in s.events() if ev and ev.get("usage")]
    check(len(usage) == 1 and usage[0]["prompt_tokens_details"]["cached_tokens"] >= 64, f"{usage}")
    say(f"ok: a prompt cached by one tenant ({hit} tokens) is a hit for it, never for the other or another salt")


def test_bad_input(fx):
    big = {"prompt": "x " * 700000}
    cases = [
        (b"{not json", 400, None, "not valid JSON"),
        (b"[1, 2]", 400, None, "JSON object"),
        ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens", "invalid type"),
        ({"prompt": "x", "n": -1}, 400, "n", "invalid value"),
        ({"prompt": "x", "model": "gpt-4o"}, 404, "model", "does not exist"),
        ({"prompt": "x", "n": 999}, 400, "n", "1..="),
        ({"prompt": "x", "n": 999, "use_beam_search": True}, 400, "n", "1..="),
        ({"prompt": "x", "max_tokens": 10000}, 400, "max_tokens", "context of 8192"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "nothing to generate"),
        ({"prompt": [1] * 9000}, 400, "prompt", "context of 8192"),
        ({"prompt": "x", "temperature": 101}, 400, "temperature", "outside"),
        ({"prompt": "x", "temperature": -0.5}, 400, "temperature", "outside"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p", "outside"),
        ({"prompt": "x", "top_k": -3}, 400, "top_k", "outside"),
        ({"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty", "outside"),
        ({"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", "outside"),
        ({"prompt": "x", "stop": [""]}, 400, "stop", "1..="),
        ({"prompt": "x", "stop_token_ids": [10 ** 6]}, 400, "stop_token_ids", "vocabulary"),
        ({"prompt": [10 ** 6]}, 400, "prompt", "vocabulary"),
        ({"prompt": ""}, 400, "prompt", "empty"),
        ({"prompt": []}, 400, "prompt", "empty"),
        ({"prompt": "a\u0004b"}, 400, "prompt", "U+0004"),
        ({"max_tokens": 3}, 400, "prompt", "required"),
        (big, 413, None, "over the limit"),
    ]
    for body, status, param, text in cases:
        got, hdrs, r = raw("POST", "/v1/completions", body, key=ARGS.key_a)
        check(got == status, f"{str(body)[:60]}: {got} {r}")
        e = r["error"]
        check(text in e["message"], f"{str(body)[:60]}: {e}")
        check(param is None or e["param"] == param, f"{str(body)[:60]}: param {e['param']}")
        check(set(e) == {"message", "type", "param", "code"}, f"{e}")
    chat_cases = [
        ({"messages": []}, "messages", "empty"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "not one of"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content", "text parts"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs", "needs logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "logprobs", "boolean"),
    ]
    for body, param, text in chat_cases:
        got, _, r = raw("POST", "/v1/chat/completions", body, key=ARGS.key_a)
        check(got == 400 and r["error"]["param"] == param and text in r["error"]["message"], f"{body}: {got} {r}")
    # Unknown fields are ignored (vLLM's and guidellm's extras).
    got, _, r = raw(
        "POST",
        "/v1/completions",
        {"prompt": "x", "max_tokens": 2, "min_p": 0.1, "guided_json": None, "skip_special_tokens": True, "user": "u"},
        key=ARGS.key_a,
    )
    check(got == 200, f"{got} {r}")
    got, _, r = raw("GET", "/v1/nothing-here")
    check(got == 404 and "no route" in r["error"]["message"], f"{got} {r}")
    # And the server still serves.
    status, _, h = raw("GET", "/health")
    check(status == 200, f"/health {status} {h}")
    check(greedy_text(client(ARGS.key_a), fx["greedy"][1]["prompt_ids"], 8), "a request after the matrix")
    say(f"ok: {len(cases) + len(chat_cases) + 2} bad inputs each refused with its status, field and limit; the server serves on")


def test_disconnect(fx):
    """A client cuts its stream: its request is aborted within a step and
    its blocks come back; a concurrent greedy stream is unchanged."""
    x = fx["greedy"][3]
    other = {}

    def run_other():
        c = client(ARGS.key_b)
        toks = []
        for chunk in c.completions.create(
            model=model_name(c),
            prompt=x["prompt_ids"],
            max_tokens=64,
            temperature=0,
            logprobs=0,
            stream=True,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        ):
            for ch in chunk.choices:
                if ch.logprobs:
                    toks += ids_of(ch.logprobs.tokens)
        other["tokens"] = toks

    aborted_before = metric('pagedattn_requests_finished_total{reason="abort"}')
    t = threading.Thread(target=run_other)
    t.start()
    s = RawStream(
        "/v1/completions",
        {"prompt": "Write a very long story about a lighthouse.", "max_tokens": 2000, "n": 2,
         "ignore_eos": True, "stream": True},
        key=ARGS.key_a,
    )
    got = 0
    for ev in s.events():
        got += 1
        if got == 6:
            break
    held = metric("pagedattn_kv_blocks_used")
    s.close()
    cut = time.monotonic()
    while metric('pagedattn_requests_finished_total{reason="abort"}') <= aborted_before:
        check(time.monotonic() - cut < 5, "the cut stream was not aborted within 5 s")
        time.sleep(0.02)
    seconds = time.monotonic() - cut
    t.join()
    check(other.get("tokens") == x["tokens"], "the concurrent stream's tokens changed")
    deadline = time.monotonic() + 5
    while metric("pagedattn_kv_blocks_used") > 0 or metric("pagedattn_requests_running") > 0:
        check(time.monotonic() < deadline, "blocks still held after both ended")
        time.sleep(0.05)
    say(f"ok: a stream cut mid-way (holding part of {held:.0f} blocks) was aborted {seconds:.2f} s later; the concurrent stream's 64 tokens equal the fixture's; no block left held")


def readme_curl_body():
    """The JSON body of README.md's first curl, exactly as a newcomer sends it."""
    import os
    import re

    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    m = re.search(r"curl -N localhost:8000(/v1/\S+) -d '(\{.*?\})'", readme)
    check(m, "README.md has no curl line")
    return m.group(1), json.loads(m.group(2))


def test_first_contact(fx):
    """README's curl, sent as written: it ends (stop, or length at the
    default cap) with text that is not one token looping."""
    path, body = readme_curl_body()
    s = RawStream(path, body, key=ARGS.key_a)
    text, finish, chunks = "", None, 0
    for ev in s.events():
        if ev is None:
            break
        for ch in ev["choices"]:
            text += ch["delta"].get("content") or ""
            finish = ch.get("finish_reason") or finish
        chunks += 1
    check(finish in ("stop", "length"), f"finish {finish}")
    words = text.split()
    check(len(words) >= 5, f"too little text: {text!r}")
    # Not stuck: no single word is a third of the text.
    top = max(words.count(w) for w in set(words))
    check(top <= max(3, len(words) // 3), f"one word {top} times of {len(words)}: {text[:200]!r}")
    _, _, tok = raw("POST", "/tokenize", {"prompt": text}, key=ARGS.key_a)
    check(tok["count"] <= 260, f"{tok['count']} tokens: past the default cap of 256")
    say(f"ok: README's curl ({path}) ended ({finish}) after {chunks} chunks, {tok['count']} tokens: {text[:80]!r}")


def test_logit_bias_and_min_p(fx):
    c = client(ARGS.key_a)
    g = fx["greedy"][0]
    first = g["tokens"][0]
    other = g["tokens"][1] if g["tokens"][1] != first else g["tokens"][2]
    base = dict(model=model_name(c), prompt=g["prompt_ids"], max_tokens=4, temperature=0, logprobs=0)
    ids = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    # +100: only that token can be chosen, at every step.
    r = c.completions.create(**base, logit_bias={str(other): 100}, extra_body=ids)
    got = ids_of(r.choices[0].logprobs.tokens)
    check(got == [other] * 4, f"+100 on {other}: {got}")
    # -100: the greedy choice is banned; the first token changes.
    r = c.completions.create(**base, logit_bias={str(first): -100}, extra_body=ids)
    got = ids_of(r.choices[0].logprobs.tokens)
    check(first not in got, f"-100 on {first}: {got}")
    # And on chat, through the client's own parameter.
    msgs = [{"role": "user", "content": "Say hi"}]
    _, _, tok = raw("POST", "/tokenize", {"prompt": " banana"}, key=ARGS.key_a)
    banana = tok["tokens"][0]
    r = c.chat.completions.create(model=model_name(c), messages=msgs, max_tokens=3, temperature=0,
                                  logit_bias={str(banana): 100})
    _, _, want = raw("POST", "/detokenize", {"tokens": [banana] * 3}, key=ARGS.key_a)
    check(r.choices[0].message.content == want["prompt"], f"chat +100: {r.choices[0].message.content!r}")
    # min_p = 1 keeps only the most likely token: a hot sample is greedy.
    r = c.completions.create(model=model_name(c), prompt=g["prompt_ids"], max_tokens=16, temperature=1.5,
                             seed=7, logprobs=0, extra_body={"min_p": 1.0, "repetition_penalty": 1.0, **ids})
    check(ids_of(r.choices[0].logprobs.tokens) == g["tokens"][:16], "min_p = 1 at temperature 1.5 is not greedy")
    say(f"ok: logit_bias +100 forces token {other}, -100 bans {first} (both routes); min_p = 1 at temperature 1.5 equals greedy")


def test_refused_and_accepted_fields(fx):
    """What the server does not do is a 400 naming the field, never a
    silent no-op: tool calling and structured outputs as LangChain's
    bind_tools and with_structured_output send them."""
    c = client(ARGS.key_a)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    schema = {
        "type": "json_schema",
        "json_schema": {"name": "Answer", "schema": {"type": "object", "properties": {"a": {"type": "string"}}}, "strict": True},
    }
    refused = [
        ("tools", dict(tools=[weather])),
        ("tools", dict(tools=[weather], tool_choice="auto")),
        ("tool_choice", dict(tool_choice={"type": "function", "function": {"name": "get_weather"}})),
        ("parallel_tool_calls", dict(parallel_tool_calls=True)),
        ("response_format", dict(response_format=schema)),
        ("response_format", dict(response_format={"type": "json_object"})),
        ("functions", dict(functions=[weather["function"]])),
        ("reasoning_effort", dict(reasoning_effort="low")),
    ]
    for field, kw in refused:
        try:
            c.chat.completions.create(model=model_name(c), messages=msgs, max_tokens=4, **kw)
            check(False, f"{field} was not refused")
        except openai.BadRequestError as e:
            err = e.body if isinstance(e.body, dict) else {}
            check(err.get("param") == field and "not supported" in err.get("message", ""), f"{field}: {e.body}")
    for field, body in [
        ("best_of", {"prompt": "x", "best_of": 3}),
        ("suffix", {"prompt": "x", "suffix": "end"}),
        ("logit_bias", {"prompt": "x", "logit_bias": {"5": 300}}),
        ("logit_bias", {"prompt": "x", "logit_bias": {"99999999": 1}}),
        ("logit_bias", {"prompt": "x", "logit_bias": {"abc": 1}}),
        ("min_p", {"prompt": "x", "min_p": 1.5}),
        ("cache_salt", {"prompt": "x", "cache_salt": ""}),
        ("use_beam_search", {"prompt": "x", "n": 2, "use_beam_search": True, "logit_bias": {"5": 1}}),
        ("use_beam_search", {"prompt": "x", "n": 2, "use_beam_search": True, "min_p": 0.2}),
    ]:
        got, _, r = raw("POST", "/v1/completions", body, key=ARGS.key_a)
        check(got == 400 and r["error"]["param"] == field, f"{body}: {got} {r}")
    # What asks for nothing here is served: empty tools, "none", text,
    # and the fields that change nothing in a local server.
    r = c.chat.completions.create(
        model=model_name(c), messages=msgs, max_tokens=2, tools=[], tool_choice="none",
        response_format={"type": "text"}, user="u-1", store=False, metadata={"k": "v"},
        service_tier="auto", parallel_tool_calls=False,
    )
    check(r.choices[0].finish_reason in ("stop", "length"), f"{r}")
    say(f"ok: {len(refused)} tool-calling and structured-output requests (LangChain's shapes) and 9 bad values each 400 with the field named; harmless values served")


def main_mode(fx):
    tests = [
        test_models_and_auth,
        test_first_contact,
        test_greedy_matches_the_fixture,
        test_samples_match_the_fixture_and_the_seed,
        test_samples_share_the_prompt_blocks,
        test_beams_match_the_fixture,
        test_chat,
        test_logprobs,
        test_stop_strings,
        test_penalties_and_echo,
        test_tenants_do_not_share_cached_prompts,
        test_bad_input,
        test_logit_bias_and_min_p,
        test_refused_and_accepted_fields,
        test_disconnect,
    ]
    for t in tests:
        start = time.monotonic()
        t(fx)
        say(f"   ({t.__name__}: {time.monotonic() - start:.1f} s)")


# ------------------------------------------------------------- load mode


async def load_mode(fx):
    """`--streams` concurrent greedy streams on a small pool: every one
    completes with the tokens the fixture has for its prompt (so queueing
    and preemption changed nothing), no block is left held, and queueing
    and preemption show in /metrics while it runs. Then more requests
    than the server holds at once: the excess gets 429 with Retry-After."""
    import httpx2 as httpx

    n = ARGS.streams
    g = fx["greedy"]
    rss = []  # the server's resident set, sampled (with --pid)

    def rss_now():
        try:
            with open(f"/proc/{ARGS.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            return None
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=n + 64, max_keepalive_connections=n + 64), timeout=600)
    c = openai.AsyncOpenAI(base_url=ARGS.base + "/v1", api_key="none", max_retries=0, http_client=http)
    name = (await c.models.list()).data[0].id
    out_len = ARGS.out_len
    peak = {"waiting": 0.0, "preemptions": 0.0, "swapped": 0.0, "running": 0.0}
    finished = [0]
    stop_watch = asyncio.Event()

    async def watch():
        while not stop_watch.is_set():
            m = await asyncio.to_thread(metrics)
            peak["waiting"] = max(peak["waiting"], m.get("pagedattn_requests_waiting", 0))
            peak["preemptions"] = max(peak["preemptions"], m.get("pagedattn_preemptions_total", 0))
            peak["swapped"] = max(peak["swapped"], m.get("pagedattn_requests_swapped", 0))
            peak["running"] = max(peak["running"], m.get("pagedattn_requests_running", 0))
            if ARGS.pid:
                rss.append((finished[0], rss_now()))
            await asyncio.sleep(0.25)

    async def one(i):
        x = g[i % len(g)]
        toks = []
        stream = await c.completions.create(
            model=name,
            prompt=x["prompt_ids"],
            max_tokens=out_len,
            temperature=0,
            logprobs=0,
            stream=True,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        )
        async for chunk in stream:
            for ch in chunk.choices:
                if ch.logprobs:
                    toks += ids_of(ch.logprobs.tokens)
        check(toks == x["tokens"][:out_len], f"stream {i}: tokens differ from the fixture's")
        finished[0] += 1

    watcher = asyncio.create_task(watch())
    start = time.monotonic()
    streams = asyncio.gather(*(one(i) for i in range(n)))
    # One more stream, raw, behind all of them: it waits in the queue, and
    # keep-alive comments reach it meanwhile.
    await asyncio.sleep(0.5)
    late = {}

    def wait_behind():
        x = g[0]
        s = RawStream(
            "/v1/completions",
            {"prompt": x["prompt_ids"], "max_tokens": 4, "temperature": 0, "stream": True},
        )
        first = None
        for ev in s.events():
            if ev is not None and first is None and any(ch["text"] for ch in ev["choices"]):
                first = s.comments
        late["comments_before_text"] = first

    behind = asyncio.to_thread(wait_behind)
    await asyncio.gather(streams, behind)
    took = time.monotonic() - start
    check((late.get("comments_before_text") or 0) >= 1, f"no keep-alive while queued: {late}")
    stop_watch.set()
    await watcher
    m = metrics()
    check(m["pagedattn_requests_running"] == 0 and m["pagedattn_requests_waiting"] == 0, f"{m}")
    check(m["pagedattn_kv_blocks_used"] == 0, f"{m['pagedattn_kv_blocks_used']} blocks leaked")
    check(peak["waiting"] > 0, "nothing ever queued: the pool was not small")
    say(
        f"ok: {n} concurrent streams of {out_len} tokens on a pool of {m['pagedattn_kv_blocks_total']:.0f} blocks all finished in {took:.1f} s "
        f"with the fixture's tokens; peak running {peak['running']:.0f}, waiting {peak['waiting']:.0f}, swapped {peak['swapped']:.0f}; "
        f"preemptions {m['pagedattn_preemptions_total']:.0f}; no block leaked"
    )
    if ARGS.expect_preemption:
        check(peak["preemptions"] > 0 and peak["swapped"] > 0, f"no preemption or swap seen: {peak}")
    if ARGS.pid:
        # Flat after warm-up: the last samples within 10 % (plus 16 MiB) of
        # the level once a tenth of the streams had finished.
        warm = [r for f, r in rss if r and f >= n // 10]
        check(warm, "no RSS samples after warm-up")
        say(f"ok: server RSS {warm[0]:.0f} MiB once {n // 10} streams had finished, {max(warm):.0f} MiB at most after, {warm[-1]:.0f} MiB at the end")
        check(max(warm) <= warm[0] * 1.1 + 16, f"RSS grew: {warm[0]:.0f} -> {max(warm):.0f} MiB")
    if ARGS.no_burst:
        return

    # Over the limit: 429 with Retry-After, the rest served.
    over = ARGS.limit + 24

    async def tiny(i):
        r = await http.post(
            ARGS.base + "/v1/completions",
            json={"prompt": g[i % len(g)]["prompt_ids"], "max_tokens": 2, "temperature": 0},
        )
        return r.status_code, r.headers.get("retry-after"), r.json()

    # While the burst is served, /metrics counts every admitted request:
    # those the engine has not yet taken count as waiting.
    burst_peak = {"waiting": 0.0, "held": 0.0}
    burst_done = asyncio.Event()

    async def watch_burst():
        while not burst_done.is_set():
            m = await asyncio.to_thread(metrics)
            w = m.get("pagedattn_requests_waiting", 0)
            held = w + m.get("pagedattn_requests_running", 0) + m.get("pagedattn_requests_swapped", 0)
            burst_peak["waiting"] = max(burst_peak["waiting"], w)
            burst_peak["held"] = max(burst_peak["held"], held)
            await asyncio.sleep(0.05)

    burst_watcher = asyncio.create_task(watch_burst())
    results = await asyncio.gather(*(tiny(i) for i in range(over)))
    burst_done.set()
    await burst_watcher
    # The watcher sees the queue at some moment after the burst came in;
    # the engine serves 16 at a time, 2 tokens each, so most are still
    # waiting then.
    check(burst_peak["waiting"] >= 32, f"a burst of {over}: /metrics never showed them waiting: {burst_peak}")
    codes = [r[0] for r in results]
    refused = [r for r in results if r[0] == 429]
    check(set(codes) <= {200, 429}, f"codes {sorted(set(codes))}")
    check(refused, f"{over} requests at once against a limit of {ARGS.limit}: none refused")
    check(all(r[1] == "1" and r[2]["error"]["type"] == "rate_limit_error" for r in refused), f"{refused[0]}")
    check(codes.count(200) >= ARGS.limit - 16, f"only {codes.count(200)} served")
    await c.close()
    m = metrics()
    check(m["pagedattn_kv_blocks_used"] == 0 and m["pagedattn_requests_running"] == 0, "leak after the burst")
    say(
        f"ok: {over} requests at once: {len(refused)} got 429 with Retry-After, {codes.count(200)} served, nothing leaked; "
        f"/metrics showed up to {burst_peak['waiting']:.0f} waiting, {burst_peak['held']:.0f} in all"
    )

    # A prompt longer than the pool (but within the context).
    total = int(m["pagedattn_kv_blocks_total"]) * 16
    status, _, r = raw("POST", "/v1/completions", {"prompt": [100] * (total + 10), "max_tokens": 4})
    check(status == 400 and "pool holds" in r["error"]["message"], f"{status} {r}")
    say(f"ok: a stream queued behind them got {late['comments_before_text']} keep-alive comments before its first token")
    say(f"ok: a prompt of {total + 10} tokens, past the pool of {total}, gets 400: {r['error']['message'][:80]}")


# ---------------------------------------------------------- until-end


def until_end_mode():
    """Streams a long request and says how it ended (the SIGTERM test)."""
    s = RawStream(
        "/v1/completions",
        {"prompt": "Tell me everything about the sea.", "max_tokens": 4000, "ignore_eos": True, "stream": True},
    )
    chunks, error, done = 0, None, False
    for ev in s.events():
        if ev is None:
            done = True
            break
        if "error" in ev:
            error = ev["error"]
        else:
            chunks += 1
            if chunks == 3:
                say("streaming")
    say(f"ended: chunks {chunks}, error {json.dumps(error)}, done {json.dumps(done)}")


def main():
    global ARGS
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["main", "load", "until-end"])
    p.add_argument("--base", required=True)
    p.add_argument("--key-a")
    p.add_argument("--key-b")
    p.add_argument("--fixture")
    p.add_argument("--streams", type=int, default=200)
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--out-len", type=int, default=16)
    p.add_argument("--pid", type=int, default=0, help="the server's pid: sample its RSS")
    p.add_argument("--expect-preemption", action="store_true")
    p.add_argument("--no-burst", action="store_true", help="skip the 429 burst")
    ARGS = p.parse_args()
    fx = json.load(open(ARGS.fixture)) if ARGS.fixture else None
    try:
        if ARGS.mode == "main":
            main_mode(fx)
        elif ARGS.mode == "load":
            asyncio.run(load_mode(fx))
        else:
            until_end_mode()
    except AssertionError as e:
        print(f"FAILED: {e}", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
