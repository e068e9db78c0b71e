#!/usr/bin/env python3
"""Build model/tests/fixture/reference.json: what llama.cpp says SmolLM2-135M-Instruct does.

The Rust tests compare pagedattn's model runner against this file token for token.
It is produced by an independent runtime, llama.cpp, through the prebuilt `xllamacpp`
wheel, on an F32 copy of the model (the Q4_1 file dequantized, every tensor F32), with
an F32 KV cache, flash attention off, 1 CPU thread, no GPU. (On the Q4_1 file llama.cpp
would quantize activations to 8 bits; the F32 copy keeps the comparison to plain f32 math.)

What the fixture holds:
  meta      runtime and version, model sha256, how the reference was run, chat template,
            default system prompt, special token ids, the logprob checks
  speed     llama.cpp's own prefill/decode tokens/s on the ORIGINAL Q4_1 file (informational)
  tokenize  texts and the reference tokenizer's ids (special tokens parsed or not)
  greedy    8 chat prompts x 64 greedy steps: token, top-5 [id, logprob], top1-top2 margin
            (end-of-turn is fed back like any token; every margin >= 1e-2)
  beam      2 prompts, width 4, 16 steps (exact algorithm: beam_search(); gaps >= 1e-2)
  sample    2 prompts, 4 branches x 24 tokens, T 0.8, top-k 40, top-p 0.95, SplitMix64
            (exact algorithm: sample_step(), sample_branches(); u stays >= 1e-3 of the
            kept mass from every boundary, the top-p cut >= 1e-4 from top_p)

Logprobs are the RAW next-token distribution: the server's `n_probs` with
`post_sampling_probs` false is a softmax of the raw logits over the whole vocabulary,
before any sampler (checked: unchanged by sampler settings, sums to 1 over the vocabulary,
matches a float64 numpy forward pass of the same weights). llama.cpp sums that softmax in
f32, losing ~1e-4 of tail mass, so recorded values come from full-vocabulary requests
(n_probs = 49152) renormalized in f64. Prompts and seeds are chosen in a fast pass
(top-48 only); then everything is recomputed with full-vocabulary logprobs and must agree.

Rerun (model first: scripts/fetch-model.sh; about 20-30 min on 2 cores):
    pip install xllamacpp==2026.10.11549 gguf==0.19.0 numpy
    python3 scripts/make-fixture.py
Pinned: xllamacpp 2026.10.11549 (with its llama.cpp), gguf 0.19.0; numpy any recent.
"""

import gc
import hashlib
import json
import math
import os
import platform
import re
import signal
import sys
import tempfile
import time
import urllib.request

# Must be set before llama.cpp creates its KV cache: classic attention, no rotation
# (the rotation only concerns quantized KV caches; we disable it to be explicit).
os.environ["LLAMA_ATTN_ROT_DISABLE"] = "1"

import numpy as np  # noqa: E402
import gguf  # noqa: E402
import xllamacpp as xlc  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_DIR = os.environ.get("PAGEDATTN_MODEL_DIR", os.path.join(ROOT, "models"))
MODEL = os.path.join(MODEL_DIR, "SmolLM2-135M-Instruct.Q4_1.gguf")
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
OUT = os.path.join(ROOT, "model", "tests", "fixture", "reference.json")

THREADS = 1
N_CTX = 2048
TOPN = 40          # top logprobs kept per step (the sampler's candidates)
FAST_N = 48        # fast pass asks for a few more, to sort ties by id ourselves

GREEDY_COUNT, GREEDY_STEPS, MIN_MARGIN = 8, 64, 1e-2
BEAM_COUNT, BEAM_WIDTH, BEAM_STEPS, MIN_GAP = 2, 4, 16, 1e-2
SAMPLE_N, SAMPLE_TOKENS, SAMPLE_T, SAMPLE_TOP_K, SAMPLE_TOP_P = 4, 24, 0.8, 40, 0.95
MIN_BOUNDARY, MIN_TOP_P_CUT, FIRST_SEED, MAX_STREAMS = 1e-3, 1e-4, 1, 400
SAMPLE_COUNT = 2
SAMPLE_POOL = ["Tell me a story.", "Write a short poem about autumn.", "Write a haiku about the ocean.",
               "What should I pack for a weekend camping trip?", "Give me a simple recipe for pancakes."]

USER_POOL = [
    "Tell me a story.",
    "What is the capital of France?",
    "Give me a simple recipe for pancakes.",
    "Write a Python function that reverses a string.",
    "Explain photosynthesis in simple terms.",
    "What are three tips for staying productive?",
    "How does a rainbow form?",
    "Write a haiku about the ocean.",
    "What is the difference between a list and a tuple in Python?",
    "Explain what a black hole is.",
    "Give me a short workout plan for beginners.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.",
    "How do I make a cup of tea?",
    "What is machine learning?",
    "Write a short poem about autumn.",
    "List five fruits that are high in vitamin C.",
    "How many days are there in a leap year?",
    "Translate 'good morning' into Spanish and French.",
    "Explain how a computer stores numbers.",
    "What should I pack for a weekend camping trip?",
    "Write a SQL query that counts the rows in a table named users.",
]

# Plain-text tokenizer cases (special tokens NOT parsed) ...
TOKENIZE_PLAIN = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "hello",
    " hello",
    "   leading spaces",
    "trailing spaces   ",
    "multiple    spaces   between  words",
    "line one\nline two\n\nline four",
    "tab\tseparated\tvalues\n\t indented",
    "\r\nwindows line end\r\n",
    "12345 3.14159",
    "1 22 333 4444 55555 666666 1234567890",
    "I'm, you'll, they've, don't, IT'S, we'd, she's",
    "Wait... what?! No!!! (really?) [yes] {ok} <tag>",
    "--- *** ### ___ ~~~ ... ,,, ;;; ::: ???",
    "def add(a, b):\n    return a + b\n",
    "for (int i = 0; i < n; ++i) { sum += x[i]; }",
    'fn main() { println!("{}", 42); } // comment',
    "café naïve résumé façade Ångström über straße",
    "你好，世界！我喜欢学习语言模型。",
    "日本語のテキストと한국어 텍스트",
    "emoji: 😀🎉👍🏽 ❤️ 🇫🇷",
    "mixed: abc123DEF_456-ghi.jkl",
    "https://example.com/path?query=1&x=y#frag",
    "user@example.com",
    "<|im_start|>user\nnot special here<|im_end|>",
    "",
    " ",
]
# ... and with special tokens parsed.
TOKENIZE_SPECIAL_EXTRA = [
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def r7(x):
    """Round to 7 significant digits (keeps the JSON small)."""
    return float(f"{x:.7g}")


# ---------------------------------------------------------------------------
# Model file: metadata and the F32 copy


def read_meta(path):
    r = gguf.GGUFReader(path)
    f = r.fields
    tokens = f["tokenizer.ggml.tokens"].contents()
    template = f["tokenizer.chat_template"].contents()
    m = re.search(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", template)
    assert m, "no default system prompt in the chat template"
    return {
        "chat_template": template,
        "default_system": m.group(1),
        "pre": f["tokenizer.ggml.pre"].contents(),
        "tokenizer_model": f["tokenizer.ggml.model"].contents(),
        "add_bos_token": bool(f["tokenizer.ggml.add_bos_token"].contents()),
        "bos_id": int(f["tokenizer.ggml.bos_token_id"].contents()),
        "eos_id": int(f["tokenizer.ggml.eos_token_id"].contents()),
        "vocab_size": len(tokens),
        "ids": {t: tokens.index(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")},
    }


def dequantize_to_f32(src, dst):
    """Write `src` again with the same metadata and every tensor as F32.

    GGUFReader gives each tensor as a numpy array in row-major order, i.e. with the
    ggml dims reversed (ne0 is the last numpy axis); dequantize() keeps that layout
    and GGUFWriter reverses it back, so the ggml shape is unchanged.
    """
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, r.fields["general.architecture"].contents())
    VT = gguf.GGUFValueType
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # written by GGUFWriter itself
        value = field.contents()
        if key == "general.file_type":
            value = int(gguf.LlamaFileType.ALL_F32)
        if field.types[0] == VT.ARRAY:
            w.add_key_value(key, value, VT.ARRAY, sub_type=field.types[1])
        else:
            w.add_key_value(key, value, field.types[0])
    for t in r.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        assert a.shape[::-1] == tuple(int(n) for n in t.shape), (t.name, a.shape, t.shape)
        w.add_tensor(t.name, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r2 = gguf.GGUFReader(dst)
    assert len(r2.tensors) == len(r.tensors)
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in r2.tensors)


# ---------------------------------------------------------------------------
# The reference runtime


def make_params(model_path):
    p = xlc.CommonParams()
    p.model.path = model_path
    p.n_ctx = N_CTX
    p.n_parallel = 1
    p.n_gpu_layers = 0
    p.flash_attn_type = xlc.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_DISABLED
    p.cache_type_k = xlc.ggml_type.GGML_TYPE_F32
    p.cache_type_v = xlc.ggml_type.GGML_TYPE_F32
    p.cpuparams.n_threads = THREADS
    p.cpuparams_batch.n_threads = THREADS
    p.cache_prompt = True
    p.cache_ram_mib = 0  # no host-RAM prompt cache (the slot's own KV cache is reused)
    p.ui = False
    p.warmup = True
    p.verbosity = 0
    return p


RUN_CONFIG = {
    "device": "CPU only (n_gpu_layers 0, CPU-only wheel)",
    "weights": "F32 (Q4_1 file dequantized with gguf.quants.dequantize, metadata unchanged)",
    "kv_cache": "f32 (cache_type_k = cache_type_v = f32)",
    "flash_attn": "disabled",
    "threads": THREADS,
    "n_ctx": N_CTX,
    "n_parallel": 1,
    "env": {"LLAMA_ATTN_ROT_DISABLE": "1"},
    "requests": "POST /completion (llama.cpp server embedded by xllamacpp, loopback) with "
                "token-id prompts, n_predict 1, temperature 0, cache_prompt true: one forward "
                "step per request on top of the slot's cached prefix",
    "logprobs": "n_probs (post_sampling_probs false): softmax of the raw logits over the full "
                "vocabulary; recorded values from n_probs = vocab size, renormalized in f64",
}


class Reference:
    def __init__(self, model_path, vocab):
        self.server = xlc.Server(make_params(model_path))
        self.base = self.server.listening_address
        self.vocab = vocab
        self.cache = {}
        self.requests = 0
        self.seconds = 0.0
        self.max_norm_fix = 0.0

    def close(self):
        del self.server
        gc.collect()

    def post(self, path, body):
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req) as resp:
            return json.loads(resp.read())

    def tokenize(self, text, special):
        r = self.post("/tokenize", {"content": text, "add_special": False,
                                    "parse_special": special})
        return [int(t) for t in r["tokens"]]

    def complete(self, ids, **kw):
        body = {"prompt": list(ids), "n_predict": 1, "temperature": 0.0, "cache_prompt": True}
        body.update(kw)
        return self.server.handle_completions(body)

    def fetch(self, ids, n):
        """One request: the sampled greedy id and n (id, logprob) sorted by logprob
        descending, then id ascending."""
        t0 = time.time()
        # llama.cpp's native /completion over loopback: the same request as complete(),
        # about twice as fast for the full vocabulary (no dict conversion in the binding)
        r = self.post("/completion", {"prompt": list(ids), "n_predict": 1, "temperature": 0.0,
                                      "cache_prompt": True, "n_probs": n})
        self.seconds += time.time() - t0
        self.requests += 1
        c = r["completion_probabilities"][0]
        top = sorted(((int(t["id"]), float(t["logprob"])) for t in c["top_logprobs"]),
                     key=lambda e: (-e[1], e[0]))
        assert len(top) == n, (len(top), n)
        assert all(lp <= 0.0 for _, lp in top), "positive logprob"
        return int(c["id"]), top

    def dist(self, ids, exact):
        """Top TOPN (id, logprob) of the next token after `ids`, sorted by logprob
        descending then id ascending; raw distribution, verified."""
        key = (tuple(ids), exact)
        if key in self.cache:
            return self.cache[key]
        greedy, top = self.fetch(ids, self.vocab if exact else FAST_N)
        if not exact and top[TOPN - 1][1] == top[TOPN][1]:
            greedy, top = self.fetch(ids, self.vocab)  # tie at the cut: sort the whole vocab
        if exact:
            # Whole vocabulary: renormalize in f64 (llama.cpp's f32 sum drops the tail).
            assert len({i for i, _ in top}) == self.vocab
            total = math.fsum(math.exp(lp) for _, lp in top)
            assert abs(total - 1.0) < 1e-3, f"full-vocab probabilities sum to {total}"
            fix = math.log(total)
            self.max_norm_fix = max(self.max_norm_fix, abs(fix))
            top = [(i, lp - fix) for i, lp in top]
        top = top[:TOPN]
        # The greedy token the server sampled (temperature 0) must be our top-1.
        assert dict(top).get(greedy) == top[0][1], (greedy, top[:2])
        assert math.fsum(math.exp(lp) for _, lp in top) <= 1.0 + 1e-6
        self.cache[key] = top
        return top


def verify_raw(ref, ids):
    """Show that n_probs gives the raw distribution: unchanged by any sampler setting,
    sums to 1 over the vocabulary, unlike post-sampling probabilities."""
    def top(**kw):
        c = ref.complete(ids, n_probs=TOPN, **kw)["choices"][0]["logprobs"]["content"][0]
        return [(t["id"], t["logprob"]) for t in c["top_logprobs"]]
    top()  # evaluate the prompt once; later calls re-run just its last token
    base = top()
    for kw in ({"temperature": 0.5, "top_k": 3, "top_p": 0.5, "seed": 1},
               {"temperature": 1.7, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 7},
               {"temperature": 0.8, "repeat_penalty": 1.5, "logit_bias": [[base[0][0], -5.0]]}):
        other = top(**kw)
        assert [i for i, _ in other] == [i for i, _ in base] and all(
            abs(a[1] - b[1]) <= 1e-6 for a, b in zip(other, base)), f"logprobs depend on sampler settings {kw}"
    c = ref.complete(ids, n_probs=5, temperature=0.5, top_k=3, post_sampling_probs=True)
    post = c["choices"][0]["logprobs"]["content"][0]["top_probs"]
    assert len(post) == 3 and abs(sum(t["prob"] for t in post) - 1.0) < 1e-5
    full = ref.dist(ids, exact=True)
    return {"sampler_invariant": True, "top1": full[0], "post_sampling_differs": True}


def numpy_check(f32_path, ids, ref_top):
    """Independent check: a plain float64 numpy forward pass of the same weights must
    give the same log-softmax as the reference (validates dequantization, dim order,
    and that the reference logprobs are raw)."""
    r = gguf.GGUFReader(f32_path)
    W = {t.name: np.asarray(t.data, dtype=np.float64) for t in r.tensors}
    f = r.fields
    n_layer = int(f["llama.block_count"].contents())
    n_head = int(f["llama.attention.head_count"].contents())
    n_kv = int(f["llama.attention.head_count_kv"].contents())
    eps = float(f["llama.attention.layer_norm_rms_epsilon"].contents())
    base = float(f["llama.rope.freq_base"].contents())
    emb = W["token_embd.weight"]
    d = emb.shape[1]
    hd = d // n_head
    T = len(ids)

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    # ggml "normal" rope: rotate adjacent pairs (2i, 2i+1) by pos * base^(-2i/hd)
    ang = np.arange(T)[:, None] * base ** (-np.arange(0, hd, 2) / hd)[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(x):
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
        return out

    mask = np.triu(np.full((T, T), -np.inf), 1)
    x = emb[ids]
    for L in range(n_layer):
        p = f"blk.{L}."
        h = norm(x, W[p + "attn_norm.weight"])
        q = rope((h @ W[p + "attn_q.weight"].T).reshape(T, n_head, hd))
        k = rope((h @ W[p + "attn_k.weight"].T).reshape(T, n_kv, hd))
        v = (h @ W[p + "attn_v.weight"].T).reshape(T, n_kv, hd)
        k = np.repeat(k, n_head // n_kv, axis=1)
        v = np.repeat(v, n_head // n_kv, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", s, v).reshape(T, d) @ W[p + "attn_output.weight"].T
        h = norm(x, W[p + "ffn_norm.weight"])
        g = h @ W[p + "ffn_gate.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * (h @ W[p + "ffn_up.weight"].T)) @ W[p + "ffn_down.weight"].T
    out_w = W.get("output.weight", emb)  # tied embeddings when there is no output.weight
    logits = norm(x[-1], W["output_norm.weight"]) @ out_w.T
    lsm = logits - logits.max()
    lsm = lsm - math.log(np.exp(lsm).sum())
    order = sorted(range(len(lsm)), key=lambda i: (-lsm[i], i))[:TOPN]
    same_top = [i for i in order[:5]] == [i for i, _ in ref_top[:5]]
    diff = max(abs(lsm[i] - lp) for i, lp in ref_top)
    return {"tokens": T, "same_top5": same_top, "max_abs_logprob_diff_top40": float(diff)}


# ---------------------------------------------------------------------------
# Greedy, beam search, sampling


def greedy(ref, prompt, exact):
    ids, tokens, top5, margins = list(prompt), [], [], []
    for _ in range(GREEDY_STEPS):
        top = ref.dist(ids, exact)
        tokens.append(top[0][0])
        top5.append(top[:5])
        margins.append(top[0][1] - top[1][1])
        ids.append(top[0][0])  # end-of-turn is fed back like any token
    return tokens, top5, margins


def beam_search(ref, prompt, exact, width=BEAM_WIDTH, steps=BEAM_STEPS):
    """beams start as [(prompt, 0.0)]; each step every beam (in order) proposes its top
    2*width tokens; candidates (score + lp, beam index, token id) are sorted by score
    descending, ties by beam index then token id ascending; the first `width` become
    the new beams in that order. gap = score[width-1] - score[width] of the sorted list."""
    beams = [([], 0.0)]
    gaps = []
    for _ in range(steps):
        cands = []
        for bi, (toks, score) in enumerate(beams):
            for tid, lp in ref.dist(prompt + toks, exact)[: 2 * width]:
                cands.append((score + lp, bi, tid))
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        gaps.append(cands[width - 1][0] - cands[width][0])
        beams = [(beams[bi][0] + [tid], score) for score, bi, tid in cands[:width]]
    return beams, gaps


class SplitMix64:
    MASK = (1 << 64) - 1

    def __init__(self, seed):
        self.state = seed & self.MASK

    def next_u64(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & self.MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & self.MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & self.MASK
        return z ^ (z >> 31)

    def next_f64(self):
        return (self.next_u64() >> 11) * 2.0 ** -53


def sample_step(top, rng, temperature, top_k, top_p):
    """One draw. Candidates: the top_k (id, lp), sorted lp descending then id ascending;
    z = lp / T; w = exp(z - max z) (f64); keep the smallest prefix whose cumulative sum
    >= top_p * sum(w) (at least one); u = next_f64() * kept_total; pick the first kept
    token whose inclusive cumulative sum > u (else the last kept).

    Returns (token, boundary, cut): boundary = min |cumsum_i - u| / kept_total over the
    kept i; cut = min |prefix / total - top_p| over the two prefixes around the cut
    (the last one left out and the kept one)."""
    cands = top[:top_k]
    z = [lp / temperature for _, lp in cands]
    zmax = max(z)
    w = [math.exp(zi - zmax) for zi in z]
    cums, acc = [], 0.0
    for wi in w:  # plain left-to-right sums (Python >= 3.12's sum() is compensated)
        acc += wi
        cums.append(acc)
    total = acc
    kept = next(i + 1 for i, c in enumerate(cums) if c >= top_p * total)
    prefix = [0.0] + cums
    cut = min(abs(prefix[j] / total - top_p) for j in (kept - 1, kept))
    kept_total = cums[kept - 1]
    u = rng.next_f64() * kept_total
    pick = next((i for i in range(kept) if cums[i] > u), kept - 1)
    boundary = min(abs(cums[i] - u) for i in range(kept)) / kept_total
    return cands[pick][0], boundary, cut


def sample_branches(ref, prompt, seed, exact, n=SAMPLE_N, max_tokens=SAMPLE_TOKENS):
    """Branch b draws from SplitMix64(seed + b), one next_f64 per step, all branches
    starting from the same prompt. Returns (branches, min boundary, min cut)."""
    branches, boundary, cut = [], 1.0, 1.0
    for b in range(n):
        rng = SplitMix64(seed + b)
        ids, out = list(prompt), []
        for _ in range(max_tokens):
            tok, bd, cd = sample_step(ref.dist(ids, exact), rng, SAMPLE_T, SAMPLE_TOP_K, SAMPLE_TOP_P)
            boundary, cut = min(boundary, bd), min(cut, cd)
            out.append(tok)
            ids.append(tok)
        branches.append(out)
    return branches, boundary, cut


# ---------------------------------------------------------------------------
# Speed of the reference on the original Q4_1 file


def measure_speed(system):
    ref = Reference(MODEL, 0)
    try:
        prompt = ref.tokenize(chat_text(system, SPEED_USER), True)
        runs = []
        for _ in range(3):
            r = ref.complete(prompt, n_predict=64, ignore_eos=True, cache_prompt=False)
            t = r["timings"]
            runs.append((t["prompt_per_second"], t["predicted_per_second"], t["prompt_n"], t["predicted_n"]))
    finally:
        ref.close()
    best = max(runs, key=lambda e: e[0] + e[1])
    return {
        "model": os.path.basename(MODEL),
        "threads": THREADS,
        "prefill_tokens": best[2],
        "prefill_tokens_per_s": round(best[0], 1),
        "decode_tokens": best[3],
        "decode_tokens_per_s": round(best[1], 1),
        "runs": 3,
        "note": "best of 3; llama.cpp's own timings; CPU-only xllamacpp wheel (no -march=native); "
                "informational, the machine may have been busy",
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# ---------------------------------------------------------------------------


def chat_text(system, user):
    return (f"<|im_start|>system\n{system}<|im_end|>\n"
            f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")


def dump(fx):
    """Compact JSON: the small dicts (meta, speed) one key per line, list sections one
    entry per line."""
    def enc(v):
        return json.dumps(v, ensure_ascii=False, separators=(",", ":"))
    parts = []
    for k, v in fx.items():
        if isinstance(v, dict) and v:
            body = ",\n".join(f"  {enc(kk)}:{enc(vv)}" for kk, vv in v.items())
            parts.append(f"{enc(k)}:{{\n{body}\n}}")
        elif isinstance(v, list) and v:
            body = ",\n".join("  " + enc(e) for e in v)
            parts.append(f"{enc(k)}:[\n{body}\n]")
        else:
            parts.append(f"{enc(k)}:{enc(v)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def main():
    t_start = time.time()
    # on SIGTERM exit normally, so the temporary F32 copy (540 MB) is removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("error: terminated"))
    if not os.path.exists(MODEL):
        sys.exit(f"error: {MODEL} is missing; run scripts/fetch-model.sh first")
    sha = sha256_file(MODEL)
    if sha != MODEL_SHA256:
        sys.exit(f"error: {MODEL} has sha256 {sha}, expected {MODEL_SHA256}")
    meta = read_meta(MODEL)
    system = meta["default_system"]
    log(f"model ok; pre={meta['pre']} eos={meta['eos_id']} ids={meta['ids']} system={system!r}")

    with tempfile.TemporaryDirectory() as tmp:
        f32 = os.path.join(tmp, "SmolLM2-135M-Instruct.F32.gguf")
        t0 = time.time()
        dequantize_to_f32(MODEL, f32)
        log(f"F32 copy written in {time.time() - t0:.1f}s")
        ref = Reference(f32, meta["vocab_size"])
        with urllib.request.urlopen(ref.base + "/props") as resp:
            props = json.loads(resp.read())
        assert props["model_ftype"] == "all F32", props["model_ftype"]

        def prompt_ids(user):
            return ref.tokenize(chat_text(system, user), True)

        # The server's own rendering of the GGUF template must match ours.
        for user in USER_POOL[:3]:
            rendered = ref.post("/apply-template", {"messages": [{"role": "user", "content": user}]})["prompt"]
            assert rendered == chat_text(system, user), rendered
        p0 = prompt_ids(USER_POOL[0])
        # no BOS: exactly one <|im_start|> opens the prompt (the BOS id is <|im_start|>)
        assert not meta["add_bos_token"] and p0[0] == meta["ids"]["<|im_start|>"] != p0[1]
        # add_special=True must not add anything either (the model has no BOS).
        assert ref.post("/tokenize", {"content": chat_text(system, USER_POOL[0]), "add_special": True,
                                      "parse_special": True})["tokens"] == p0

        # --- tokenizer cases
        tokenize = [{"text": t, "special": False, "ids": ref.tokenize(t, False)} for t in TOKENIZE_PLAIN]
        tokenize.append({"text": chat_text(system, USER_POOL[1]), "special": True,
                         "ids": prompt_ids(USER_POOL[1])})
        tokenize += [{"text": t, "special": True, "ids": ref.tokenize(t, True)} for t in TOKENIZE_SPECIAL_EXTRA]
        assert meta["ids"]["<|im_start|>"] not in tokenize[TOKENIZE_PLAIN.index(
            "<|im_start|>user\nnot special here<|im_end|>")]["ids"]

        # --- logprobs are raw: verify, and check against an independent numpy forward
        raw_check = verify_raw(ref, prompt_ids(USER_POOL[1]))
        np_check = numpy_check(f32, prompt_ids(USER_POOL[1]), ref.dist(prompt_ids(USER_POOL[1]), True))
        log(f"raw logprob checks ok; numpy forward: {np_check}")
        assert np_check["same_top5"] and np_check["max_abs_logprob_diff_top40"] < 1e-3

        # --- fast pass: choose prompts and seeds
        t0 = time.time()
        greedy_pick = []
        for user in USER_POOL:
            toks, _, margins = greedy(ref, prompt_ids(user), exact=False)
            ok = min(margins) >= MIN_MARGIN
            log(f"greedy {'keep' if ok else 'drop'} min margin {min(margins):.4g}  {user!r}")
            if ok:
                greedy_pick.append(user)
                if len(greedy_pick) == GREEDY_COUNT:
                    break
        assert len(greedy_pick) == GREEDY_COUNT, "not enough greedy prompts with clear margins"

        # every gap >= MIN_GAP and the final beams all different; among those, prefer the
        # ones whose beams part earliest (the longest stretch of forked sequences)
        beam_ok = []
        for k, user in enumerate(USER_POOL):
            beams, gaps = beam_search(ref, prompt_ids(user), exact=False)
            seqs = [tuple(t) for t, _ in beams]
            part = min(next(i for i in range(BEAM_STEPS) if a[i] != b[i])
                       for a in seqs for b in seqs if a != b)
            ok = min(gaps) >= MIN_GAP and len(set(seqs)) == BEAM_WIDTH
            log(f"beam {'ok  ' if ok else 'drop'} min gap {min(gaps):.4g} beams part at {part}  {user!r}")
            if ok:
                beam_ok.append((part, k, user))
        assert len(beam_ok) >= BEAM_COUNT, "not enough beam prompts with clear gaps"
        beam_pick = [user for _, _, user in sorted(beam_ok)[:BEAM_COUNT]]

        # Branch b of seed s replays RNG stream s + b, and every branch starts from the
        # same prompt, so judge streams one by one: a seed works when streams
        # seed .. seed + SAMPLE_N - 1 all stay clear of the boundaries.
        seed_pick = {}
        for user in SAMPLE_POOL:
            good = 0
            for stream in range(FIRST_SEED, FIRST_SEED + MAX_STREAMS):
                _, bd, cd = sample_branches(ref, prompt_ids(user), stream, exact=False, n=1)
                good = good + 1 if bd >= MIN_BOUNDARY and cd >= MIN_TOP_P_CUT else 0
                if good == SAMPLE_N:
                    seed_pick[user] = stream - SAMPLE_N + 1
                    break
            log(f"sample {'keep seed %d' % seed_pick[user] if user in seed_pick else 'drop'} "
                f"({stream - FIRST_SEED + 1} streams tried)  {user!r}")
            if len(seed_pick) == SAMPLE_COUNT:
                break
        assert len(seed_pick) == SAMPLE_COUNT, "not enough sample prompts with clear boundaries"
        t_fast = time.time() - t0
        log(f"fast pass {t_fast:.0f}s, {ref.requests} requests")

        # --- exact pass: recompute the chosen ones with full-vocabulary logprobs
        t0 = time.time()
        n_fast = ref.requests
        out_greedy = []
        for user in greedy_pick:
            p = prompt_ids(user)
            toks, top5, margins = greedy(ref, p, exact=True)
            assert toks == greedy(ref, p, exact=False)[0], "exact pass changed a greedy sequence"
            assert min(margins) >= MIN_MARGIN
            # the server's own multi-token greedy run agrees up to its first end-of-generation
            r = ref.complete(p, n_predict=GREEDY_STEPS, n_probs=1)
            own = [int(c["id"]) for c in r["choices"][0]["logprobs"]["content"]]
            assert own == toks[: len(own)] and (len(own) == GREEDY_STEPS or toks[len(own) - 1]
                                                 in (meta["ids"]["<|im_end|>"], meta["ids"]["<|endoftext|>"])), (own, toks)
            out_greedy.append({"user": user, "prompt_ids": p, "tokens": toks,
                               "top5": [[[i, r7(lp)] for i, lp in s] for s in top5],
                               "margins": [r7(m) for m in margins]})
            log(f"greedy exact: min margin {min(margins):.4g}, server run {len(own)} tokens agree  {user!r}")

        out_beam = []
        for user in beam_pick:
            p = prompt_ids(user)
            beams, gaps = beam_search(ref, p, exact=True)
            fast, _ = beam_search(ref, p, exact=False)
            assert [b[0] for b in beams] == [b[0] for b in fast], "exact pass changed the beams"
            assert min(gaps) >= MIN_GAP
            out_beam.append({"user": user, "prompt_ids": p, "width": BEAM_WIDTH, "steps": BEAM_STEPS,
                             "beams": [{"tokens": t, "score": round(s, 7)} for t, s in beams],
                             "min_gap": r7(min(gaps))})
            log(f"beam exact: min gap {min(gaps):.4g}  {user!r}")

        out_sample = []
        for user, seed in seed_pick.items():
            p = prompt_ids(user)
            branches, bd, cd = sample_branches(ref, p, seed, exact=True)
            assert branches == sample_branches(ref, p, seed, exact=False)[0], "exact pass changed samples"
            assert bd >= MIN_BOUNDARY and cd >= MIN_TOP_P_CUT
            out_sample.append({"user": user, "prompt_ids": p, "n": SAMPLE_N, "max_tokens": SAMPLE_TOKENS,
                               "temperature": SAMPLE_T, "top_k": SAMPLE_TOP_K, "top_p": SAMPLE_TOP_P,
                               "seed": seed, "branches": branches, "min_boundary": r7(bd),
                               "min_top_p_cut": r7(cd)})
            log(f"sample exact: seed {seed} boundary {bd:.4g} top-p cut {cd:.4g}  {user!r}")
        t_exact = time.time() - t0
        n_exact = ref.requests - n_fast
        log(f"exact pass {t_exact:.0f}s, {n_exact} requests; max normalizer fix {ref.max_norm_fix:.3g}")
        ref.close()

    speed = measure_speed(system)
    log(f"speed: {speed}")

    fx = {
        "meta": {
            "runtime": "llama.cpp, embedded in the xllamacpp wheel (CPU build)",
            "runtime_version": f"xllamacpp {xlc.__version__} (git {xlc._version.get_versions()['full-revisionid'][:12]}); "
                               f"the wheel reports llama.cpp build_info "
                               f"'b{xlc.BUILD_INFO.get('build_number')}-{xlc.BUILD_INFO.get('commit')}'",
            "gguf_python": f"gguf {pkg_version('gguf')}, numpy {np.__version__}",
            "model_file": os.path.basename(MODEL),
            "model_sha256": sha,
            "run": RUN_CONFIG,
            "chat_template": meta["chat_template"],
            "default_system": system,
            "prompt_format": "<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{USER}<|im_end|>\n<|im_start|>assistant\n",
            "prompt_tokenization": "special tokens parsed, no BOS added (add_bos_token false)",
            "tokenizer_pre": meta["pre"],
            "tokenizer_model": meta["tokenizer_model"],
            "vocab_size": meta["vocab_size"],
            "eos_id": meta["eos_id"],
            "special_ids": meta["ids"],
            "logprob_checks": {"sampler_invariant": raw_check["sampler_invariant"],
                               "post_sampling_differs": raw_check["post_sampling_differs"],
                               "numpy_f64_forward": np_check,
                               "max_normalizer_fix": r7(ref.max_norm_fix)},
            "greedy_rule": "64 steps, argmax (ties impossible: margins >= 1e-2), end-of-turn fed back",
            "beam_rule": "see scripts/make-fixture.py beam_search()",
            "sample_rule": "see scripts/make-fixture.py sample_step(); branch b uses SplitMix64(seed + b)",
            "sample_boundary": "min_boundary = smallest |cumsum_i - u| / kept_total over kept i and "
                               "steps (>= 1e-3); min_top_p_cut = smallest |prefix/total - top_p| over "
                               "the two prefixes around each cut (>= 1e-4: with 96 draws per prompt, "
                               "1e-3 is unreachable since the cut usually falls among tail tokens of "
                               "mass < 1e-3; reference-vs-f64 logprob error is ~1e-5)",
            "logprob_rounding": "7 significant digits",
            "thresholds": {"greedy_min_margin": MIN_MARGIN, "beam_min_gap": MIN_GAP,
                           "sample_min_boundary": MIN_BOUNDARY, "sample_min_top_p_cut": MIN_TOP_P_CUT},
        },
        "speed": speed,
        "tokenize": tokenize,
        "greedy": out_greedy,
        "beam": out_beam,
        "sample": out_sample,
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    text = dump(fx)
    json.loads(text)
    with open(OUT, "w", encoding="utf-8") as f:
        f.write(text)
    log(f"wrote {OUT} ({len(text.encode()) / 1024:.1f} KiB) in {time.time() - t_start:.0f}s total "
        f"(fast pass {t_fast:.0f}s, exact pass {t_exact:.0f}s)")


SPEED_USER = ("I am planning a small vegetable garden in my backyard this spring. The spot gets about "
              "six hours of sun a day and the soil is a bit sandy. Which vegetables would you suggest "
              "for a beginner, how far apart should I plant them, and how often should I water them "
              "during the first few weeks?")


def pkg_version(name):
    from importlib.metadata import version
    return version(name)


if __name__ == "__main__":
    main()
