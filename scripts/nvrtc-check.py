#!/usr/bin/env python3
# Compiles src/cuda/kernels.cu with NVRTC for a spread of shapes (sm_90), the
# way src/cuda/mod.rs does at run time, on a machine without an NVIDIA GPU:
# NVRTC is a library and needs no driver. Not run by CI (a 90 MB download):
#   pip download nvidia-cuda-nvrtc-cu12 --no-deps -d /tmp/nvrtc
#   (cd /tmp/nvrtc && python3 -c "import zipfile,glob; zipfile.ZipFile(glob.glob('*.whl')[0]).extractall('x')")
#   NVRTC_DIR=/tmp/nvrtc python3 scripts/nvrtc-check.py
# LPT and HT follow lanes_per_token / balanced_head_tile in src/gpu/shader.rs.
import os
SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'src', 'cuda', 'kernels.cu')
os.chdir(os.environ.get('NVRTC_DIR', '/tmp/nvrtc'))
import ctypes, sys, itertools
lib = ctypes.CDLL('x/nvidia/cuda_nvrtc/lib/libnvrtc.so.12')
src = open(SRC).read().encode()
sys.path.insert(0,'.')
def lpt(hd):
    d4=hd//4; l=8
    while l>1 and d4%l: l//=2
    return l
def ht(hd, g):
    jn=max(1,hd//4//lpt(hd)); most=max(1,min(8,32//jn)); tiles=-(-g//most); return -(-g//tiles)
fails=0
for hd,g,bs,f16 in [(128,4,16,0),(128,4,16,1),(64,71,16,0),(256,2,32,1),(96,1,8,0),(128,7,16,1),(80,8,16,0)]:
    prog=ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"k.cu", 0, None, None)==0
    opts=[f"-DHEAD_DIM={hd}",f"-DGROUP={g}",f"-DBLOCK_SIZE={bs}",f"-DKV_F16={f16}",f"-DLPT={lpt(hd)}",f"-DHT={ht(hd,g)}","--gpu-architecture=sm_90"]
    arr=(ctypes.c_char_p*len(opts))(*[o.encode() for o in opts])
    r=lib.nvrtcCompileProgram(prog, len(opts), arr)
    n=ctypes.c_size_t(); lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n)); buf=ctypes.create_string_buffer(n.value); lib.nvrtcGetProgramLog(prog, buf)
    print(opts[:6], "OK" if r==0 else f"FAIL {r}", buf.value.decode()[:1500])
    fails += r!=0
sys.exit(fails)
