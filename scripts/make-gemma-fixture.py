#!/usr/bin/env python3
"""Build model/tests/fixture/gemma3.json: what llama.cpp says Gemma 3 270M does.

As scripts/make-fixture.py does for SmolLM2: an independent runtime, llama.cpp through
the pinned `xllamacpp` wheel, on an F32 copy of the model (the Q4_K_M file dequantized
with gguf.quants.dequantize, every tensor F32), an F32 KV cache, flash attention off,
no GPU. A float64 numpy forward pass of the same weights checks the reference (and says
how far llama.cpp's own approximations, its f16 GELU table among them, move the
logprobs).

What the fixture holds:
  meta      runtime and version, model sha256, how the reference was run, special ids
  tokenize  texts and the reference tokenizer's ids (special tokens parsed or not)
  dequant   per quantization type: one tensor's first rows dequantized by gguf
  greedy    chat prompts x steps: token, top-5 [id, logprob], top1-top2 margin; two of
            them long enough (over 600 tokens of context) that the local layers' window
            of 512 slides
  beam      one prompt, width 4: the beams and their scores (gaps >= MIN_GAP)
  numpy     the float64 forward's top-5 for the first greedy step of two prompts

Rerun (model first: scripts/fetch-model.sh gemma3; a few minutes on 2 cores):
    pip install xllamacpp==2026.10.11549 gguf==0.19.0 numpy
    python3 scripts/make-gemma-fixture.py
"""

import importlib.util
import json
import math
import os
import signal
import sys
import tempfile
import time
import urllib.request

os.environ["LLAMA_ATTN_ROT_DISABLE"] = "1"

import numpy as np  # noqa: E402
import gguf  # noqa: E402
import xllamacpp as xlc  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("mkfx", os.path.join(ROOT, "scripts", "make-fixture.py"))
mkfx = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mkfx)

MODEL_DIR = os.environ.get("PAGEDATTN_MODEL_DIR", os.path.join(ROOT, "models"))
MODEL = os.path.join(MODEL_DIR, "gemma-3-270m-q4_k_m.gguf")
MODEL_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
OUT = os.path.join(ROOT, "model", "tests", "fixture", "gemma3.json")

THREADS = 2
N_CTX = 2048
TOPN = 40
MIN_MARGIN = 5e-2   # llama.cpp's GELU goes through an f16 table: keep clear margins
# Logprobs as llama.cpp's n_probs gives them (its f32 softmax over 262,144 tokens,
# off by about 1e-3 in total mass, far inside the tests' tolerance of 2e-2): asking
# for the whole vocabulary each step, to renormalize in f64 as the SmolLM2 fixture
# does, costs a 262,144-entry reply per step.
EXACT = False
MIN_GAP = 5e-2
SHORT_STEPS, LONG_STEPS = 24, 16
BEAM_WIDTH, BEAM_STEPS = 4, 8

SHORT_POOL = [
    "What is the capital of France?",
    "Tell me a story.",
    "Why is the sky blue?",
    "Write a haiku about the ocean.",
    "Give me a simple recipe for pancakes.",
    "What is machine learning?",
    "How does a rainbow form?",
    "Explain photosynthesis in simple terms.",
]

# Long user turns: a text to read, then a question about it (over 600 tokens in all).
PASSAGE = (
    "The lighthouse keeper of Saltmere kept a log for forty years. Every evening he wrote "
    "the weather, the ships that passed, the state of the lamp and the number of gulls on "
    "the north rocks. In the spring of the great storm he wrote that the sea had come over "
    "the wall three times in one night, that the lamp had held, and that a fishing boat "
    "called the Margaret had come into the harbour with her mast broken and her crew of "
    "four all alive. The village paid for a new mast, and the keeper wrote that the town "
    "band played on the quay when she sailed again. In later years the log speaks of the "
    "railway reaching the town, of summer visitors who climbed the tower, of a school "
    "class that came every June, and of his daughter, who learned to trim the wick before "
    "she could read. When the light was made automatic the keeper's last entry was short: "
    "lamp lit, sea calm, gulls on the north rocks, all well. "
)
LONG_POOL = [
    PASSAGE * 4 + "\n\nIn one sentence, what was the name of the boat that came in with a broken mast?",
    PASSAGE * 4 + "\n\nWhat did the keeper write in his last entry?",
    PASSAGE * 4 + "\n\nWho learned to trim the wick?",
    PASSAGE * 5 + "\n\nSummarize the log in two sentences.",
]

TOKENIZE_PLAIN = mkfx.TOKENIZE_PLAIN + [
    "<start_of_turn>user\nnot special here<end_of_turn>",
    "    indented code\n\n\n\ttabs",
    "A sentence. Another one!\n\nA new paragraph.",
]
TOKENIZE_SPECIAL = [
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "text<eos>more text",
]

BOS, EOS, EOT = 2, 1, 106


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def chat_text(user):
    return f"<start_of_turn>user\n{user}<end_of_turn>\n<start_of_turn>model\n"


def make_params(model_path):
    p = mkfx.make_params(model_path)
    p.n_ctx = N_CTX
    p.cpuparams.n_threads = THREADS
    p.cpuparams_batch.n_threads = THREADS
    return p


class Reference(mkfx.Reference):
    def __init__(self, model_path, vocab):
        self.server = xlc.Server(make_params(model_path))
        self.base = self.server.listening_address
        self.vocab = vocab
        self.cache = {}
        self.requests = 0
        self.seconds = 0.0
        self.max_norm_fix = 0.0

    def dist(self, ids, exact):
        """As make-fixture.py's, for a vocabulary of 262,144: llama.cpp's f32 sum of the
        full softmax drifts by about 1e-3 here, so the bound on it is looser (the
        recorded values are renormalized in f64 all the same)."""
        key = (tuple(ids), exact)
        if key in self.cache:
            return self.cache[key]
        greedy, top = self.fetch(ids, self.vocab if exact else mkfx.FAST_N)
        if not exact and top[TOPN - 1][1] == top[TOPN][1]:
            greedy, top = self.fetch(ids, self.vocab)
        if exact:
            assert len({i for i, _ in top}) == self.vocab
            total = math.fsum(math.exp(lp) for _, lp in top)
            assert abs(total - 1.0) < 1e-2, f"full-vocab probabilities sum to {total}"
            fix = math.log(total)
            self.max_norm_fix = max(self.max_norm_fix, abs(fix))
            top = [(i, lp - fix) for i, lp in top]
        top = top[:TOPN]
        assert dict(top).get(greedy) == top[0][1], (greedy, top[:2])
        self.cache[key] = top
        return top


def dequant_samples(path):
    """For each quantized type, one tensor's first two rows' first 64 values."""
    r = gguf.GGUFReader(path)
    out, seen = [], set()
    for t in r.tensors:
        ty = t.tensor_type.name
        if ty in seen or ty == "F32":
            continue
        seen.add(ty)
        a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        out.append({"tensor": t.name, "type": ty,
                    "rows": [[mkfx.r7(float(x)) for x in a[i, :64]] for i in range(2)]})
    return out


def numpy_forward(f32_path, ids):
    """An independent float64 forward of Gemma 3 (as its reference implementation
    defines it): embedding scaled by sqrt(d), per layer RMSNorm, Q/K/V, RMSNorm of each
    Q and K head, NeoX RoPE (base 10,000 on local layers, the file's base on global
    ones), attention with a window of 512 on local layers (every sixth layer is global),
    the post-attention norm, a GELU-tanh gated FFN between its pre and post norms;
    final norm, tied head. Returns the log-softmax of the last position."""
    r = gguf.GGUFReader(f32_path)
    W = {t.name: np.asarray(t.data, dtype=np.float64) for t in r.tensors}
    f = r.fields
    g = lambda k: f["gemma3." + k].contents()  # noqa: E731
    n_layer, n_head, n_kv = int(g("block_count")), int(g("attention.head_count")), int(g("attention.head_count_kv"))
    eps, base = float(g("attention.layer_norm_rms_epsilon")), float(g("rope.freq_base"))
    window = int(g("attention.sliding_window"))
    hd = int(g("attention.key_length"))
    emb = W["token_embd.weight"]
    d = emb.shape[1]
    T = len(ids)

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    def rope(x, b):
        ang = np.arange(T)[:, None] * b ** (-np.arange(0, hd, 2) / hd)[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, c = x[..., : hd // 2], x[..., hd // 2:]
        return np.concatenate([a * cos - c * sin, a * sin + c * cos], axis=-1)

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))

    pos = np.arange(T)
    causal = pos[None, :] <= pos[:, None]
    local = causal & (pos[:, None] - pos[None, :] < window)
    x = emb[ids] * math.sqrt(d)
    for L in range(n_layer):
        p = f"blk.{L}."
        is_global = (L + 1) % 6 == 0
        h = norm(x, W[p + "attn_norm.weight"])
        q = norm((h @ W[p + "attn_q.weight"].T).reshape(T, n_head, hd), W[p + "attn_q_norm.weight"])
        k = norm((h @ W[p + "attn_k.weight"].T).reshape(T, n_kv, hd), W[p + "attn_k_norm.weight"])
        v = (h @ W[p + "attn_v.weight"].T).reshape(T, n_kv, hd)
        b = base if is_global else 10000.0
        q, k = rope(q, b), rope(k, b)
        k = np.repeat(k, n_head // n_kv, axis=1)
        v = np.repeat(v, n_head // n_kv, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        s = np.where((causal if is_global else local)[None], s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", s, v).reshape(T, n_head * hd) @ W[p + "attn_output.weight"].T
        x = x + norm(o, W[p + "post_attention_norm.weight"])
        h = norm(x, W[p + "ffn_norm.weight"])
        ff = (gelu(h @ W[p + "ffn_gate.weight"].T) * (h @ W[p + "ffn_up.weight"].T)) @ W[p + "ffn_down.weight"].T
        x = x + norm(ff, W[p + "post_ffw_norm.weight"])
    logits = norm(x[-1], W["output_norm.weight"]) @ emb.T
    lsm = logits - logits.max()
    return lsm - math.log(np.exp(lsm).sum())


def greedy(ref, prompt, steps, exact):
    ids, tokens, top5, margins = list(prompt), [], [], []
    for _ in range(steps):
        top = ref.dist(ids, exact)
        tokens.append(top[0][0])
        top5.append(top[:5])
        margins.append(top[0][1] - top[1][1])
        ids.append(top[0][0])
    return tokens, top5, margins


def main():
    t_start = time.time()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("error: terminated"))
    if not os.path.exists(MODEL):
        sys.exit(f"error: {MODEL} is missing; run scripts/fetch-model.sh gemma3 first")
    sha = mkfx.sha256_file(MODEL)
    if sha != MODEL_SHA256:
        sys.exit(f"error: {MODEL} has sha256 {sha}, expected {MODEL_SHA256}")
    vocab = len(gguf.GGUFReader(MODEL).fields["tokenizer.ggml.tokens"].contents())
    mkfx.TOPN = TOPN
    with tempfile.TemporaryDirectory() as tmp:
        # GEMMA_F32: an F32 copy made by an earlier run, kept (1 GB) to save the time.
        f32 = os.environ.get("GEMMA_F32") or os.path.join(tmp, "gemma-3-270m.F32.gguf")
        if not os.path.exists(f32):
            t0 = time.time()
            mkfx.dequantize_to_f32(MODEL, f32)
            log(f"F32 copy written in {time.time() - t0:.1f}s")
        ref = Reference(f32, vocab)
        with urllib.request.urlopen(ref.base + "/props") as resp:
            props = json.loads(resp.read())
        assert props["model_ftype"] == "all F32", props["model_ftype"]

        def prompt_ids(user):
            return [BOS] + ref.tokenize(chat_text(user), True)

        tokenize = [{"text": t, "special": False, "ids": ref.tokenize(t, False)} for t in TOKENIZE_PLAIN]
        tokenize += [{"text": t, "special": True, "ids": ref.tokenize(t, True)} for t in TOKENIZE_SPECIAL]
        tokenize.append({"text": chat_text(SHORT_POOL[0]), "special": True,
                         "ids": ref.tokenize(chat_text(SHORT_POOL[0]), True)})

        # Greedy cases: short prompts and long ones, kept where every margin is clear.
        cases = []
        for pool, steps, want in ((SHORT_POOL, SHORT_STEPS, 3), (LONG_POOL, LONG_STEPS, 2)):
            kept = 0
            for user in pool:
                ids = prompt_ids(user)
                toks, _, margins = greedy(ref, ids, steps, exact=False)
                ok = min(margins) >= MIN_MARGIN
                log(f"greedy {'keep' if ok else 'drop'} {len(ids)} tokens, min margin {min(margins):.4g}: {user[-60:]!r}")
                if ok:
                    toks, top5, margins = greedy(ref, ids, steps, exact=EXACT)
                    assert min(margins) >= MIN_MARGIN
                    cases.append({"user": user, "prompt_ids": ids, "tokens": toks,
                                  "top5": [[[i, mkfx.r7(lp)] for i, lp in t] for t in top5],
                                  "margins": [mkfx.r7(m) for m in margins]})
                    kept += 1
                    if kept == want:
                        break
            assert kept == want, f"only {kept} clear prompts of {want}"
        assert sum(1 for c in cases if len(c["prompt_ids"]) + len(c["tokens"]) > 600) >= 2

        # One beam search sharing a prompt.
        beam = None
        for user in SHORT_POOL:
            ids = prompt_ids(user)
            beams, gaps = mkfx.beam_search(ref, ids, False, BEAM_WIDTH, BEAM_STEPS)
            if min(gaps) >= MIN_GAP and len({tuple(t) for t, _ in beams}) == BEAM_WIDTH:
                beams, gaps = mkfx.beam_search(ref, ids, EXACT, BEAM_WIDTH, BEAM_STEPS)
                assert min(gaps) >= MIN_GAP
                beam = {"user": user, "prompt_ids": ids, "width": BEAM_WIDTH, "steps": BEAM_STEPS,
                        "beams": [{"tokens": t, "score": mkfx.r7(s)} for t, s in beams],
                        "min_gap": mkfx.r7(min(gaps))}
                log(f"beam on {user!r}: min gap {min(gaps):.4g}")
                break
        assert beam, "no beam prompt with clear gaps"

        # The float64 forward against the reference, on a short and a long prompt.
        numpy_rows = []
        for c in (cases[0], cases[-1]):
            lsm = numpy_forward(f32, c["prompt_ids"])
            order = sorted(range(len(lsm)), key=lambda i: (-lsm[i], i))[:5]
            ref_top = c["top5"][0]
            diff = max(abs(lsm[i] - lp) for i, lp in ref_top)
            numpy_rows.append({"tokens": len(c["prompt_ids"]),
                               "top5": [[i, mkfx.r7(float(lsm[i]))] for i in order],
                               "same_top5_as_reference": order == [i for i, _ in ref_top],
                               "max_abs_logprob_diff_top5": mkfx.r7(float(diff))})
            log(f"numpy at {len(c['prompt_ids'])} tokens: same top5 {order == [i for i, _ in ref_top]}, "
                f"max |diff| {diff:.3g}")
        ref_fix = ref.max_norm_fix
        ref.close()
        dequant = dequant_samples(MODEL)

    fx = {
        "meta": {
            "runtime": "llama.cpp (xllamacpp)", "xllamacpp": mkfx.pkg_version("xllamacpp"),
            "gguf": mkfx.pkg_version("gguf"), "model": os.path.basename(MODEL), "model_sha256": MODEL_SHA256,
            "run": {"weights": "F32 (the Q4_K_M file dequantized with gguf.quants.dequantize)",
                    "logprobs": "n_probs = 48 (llama.cpp's own f32 softmax, not renormalized)",
                    "kv_cache": "f32", "flash_attn": "disabled", "threads": THREADS, "n_ctx": N_CTX,
                    "env": {"LLAMA_ATTN_ROT_DISABLE": "1"}},
            "chat": "<bos><start_of_turn>user\\n{user}<end_of_turn>\\n<start_of_turn>model\\n",
            "bos_id": BOS, "eos_id": EOS, "end_of_turn_id": EOT, "vocab_size": vocab,
            "min_margin": MIN_MARGIN, "min_gap": MIN_GAP,
            "seconds": round(time.time() - t_start, 1),
            "max_renormalization": mkfx.r7(ref_fix),
        },
        "tokenize": tokenize,
        "dequant": dequant,
        "greedy": cases,
        "beam": [beam],
        "numpy": numpy_rows,
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        f.write(mkfx.dump(fx))
    log(f"wrote {OUT} in {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
