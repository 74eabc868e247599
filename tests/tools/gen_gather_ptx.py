#!/usr/bin/env python3
"""Generate nixl/ucx/cuda/gather.ptx from gather.cu with NVRTC.

NVRTC compiles CUDA C to PTX on any machine, without a GPU or a driver:

    python3 -m venv /tmp/nvrtc && /tmp/nvrtc/bin/pip install 'nvidia-cuda-nvrtc-cu12==12.8.*'
    /tmp/nvrtc/bin/python tests/tools/gen_gather_ptx.py

The PTX targets compute_70 (Volta and newer) and declares PTX ISA 7.0 (CUDA
11.0), the oldest that every instruction in it needs, so that any driver
from CUDA 11.0 on can compile it for its device. The result is committed;
the library embeds it (nixl/ucx/cuda.go).
"""

import ctypes
import glob
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "..", "nixl", "ucx", "cuda", "gather.cu")
OUT = os.path.join(HERE, "..", "..", "nixl", "ucx", "cuda", "gather.ptx")


def load_nvrtc() -> ctypes.CDLL:
    import nvidia.cuda_nvrtc  # type: ignore[import-not-found]

    (d,) = nvidia.cuda_nvrtc.__path__
    libs = sorted(glob.glob(os.path.join(d, "lib", "libnvrtc.so.*")))
    if not libs:
        sys.exit(f"no libnvrtc.so.* under {d}")
    return ctypes.CDLL(libs[0])


def main() -> int:
    nv = load_nvrtc()
    src = open(SRC, "rb").read()
    prog = ctypes.c_void_p()
    rc = nv.nvrtcCreateProgram(ctypes.byref(prog), src, b"gather.cu", 0, None, None)
    if rc:
        sys.exit(f"nvrtcCreateProgram: {rc}")
    opts = [b"--gpu-architecture=compute_70", b"-default-device", b"--std=c++17"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = nv.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    nv.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    nv.nvrtcGetProgramLog(prog, log)
    if rc:
        sys.exit(f"nvrtcCompileProgram: {rc}\n{log.value.decode()}")
    nv.nvrtcGetPTXSize(prog, ctypes.byref(n))
    ptx = ctypes.create_string_buffer(n.value)
    nv.nvrtcGetPTX(prog, ptx)
    text = ptx.value.decode()
    # Lower the declared ISA version: nothing in the kernel needs a newer one.
    text, k = re.subn(r"^\.version \d+\.\d+$", ".version 7.0", text, count=1, flags=re.M)
    if k != 1:
        sys.exit("no .version line in the PTX")
    text = "".join(line + "\n" for line in text.splitlines() if not line.startswith("//"))
    with open(OUT, "w") as f:
        f.write("// Generated from gather.cu by tests/tools/gen_gather_ptx.py; do not edit.\n")
        f.write(text)
    print(f"wrote {os.path.relpath(OUT)} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
