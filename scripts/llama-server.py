#!/usr/bin/env python3
"""llama.cpp's own server on the same GGUF, for `pagedattn loadgen --llama-cpp`.

It runs the server embedded in the pinned `xllamacpp` wheel (the runtime the
fixture script uses), CPU only, with parallel slots and continuous batching,
its KV cache in f16 and unified across the slots (one pool of --ctx tokens
shared by all of them, the closest llama.cpp comes to paging), prints its
address, and serves until SIGINT/SIGTERM.

    pip install xllamacpp==2026.10.11549
    python3 scripts/llama-server.py --ctx 640 --parallel 16
"""

import argparse
import os
import signal
import sys
import threading

import xllamacpp as xlc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--ctx", type=int, default=640, help="KV tokens, shared by the slots")
    ap.add_argument("--parallel", type=int, default=16, help="slots (sequences at once)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    a = ap.parse_args()
    p = xlc.CommonParams()
    p.model.path = a.model
    p.n_ctx = a.ctx
    p.n_parallel = a.parallel
    p.kv_unified = True
    p.n_gpu_layers = 0
    p.cache_type_k = xlc.ggml_type.GGML_TYPE_F16
    p.cache_type_v = xlc.ggml_type.GGML_TYPE_F16
    p.cpuparams.n_threads = a.threads
    p.cpuparams_batch.n_threads = a.threads
    p.ui = False
    p.warmup = True
    p.verbosity = 0
    server = xlc.Server(p)
    print(f"llama.cpp (xllamacpp {xlc.__version__}) listening on {server.listening_address}", flush=True)
    stop = threading.Event()
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda *_: stop.set())
    stop.wait()
    del server
    sys.exit(0)


if __name__ == "__main__":
    main()
