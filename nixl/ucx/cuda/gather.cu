// gather.cu: the copy kernel of the ucx engine's CUDA IPC data path
// (nixl/ucx/gxcuda.c). One launch moves every operation of a transfer:
// operation i copies len bytes from src to dst, both device addresses this
// process can reach (its own memory, or a peer's through a CUDA IPC
// mapping). Blocks of the grid take operations in turn; the threads of a
// block copy one operation together, 16 bytes per thread and load when
// both addresses are 16-byte aligned (KV-cache blocks always are), bytewise
// otherwise. The Go side splits long operations into chunks so that the
// work spreads over the grid.
//
// gather.ptx beside this file is generated from it by
// tests/tools/gen_gather_ptx.py (NVRTC; no GPU needed) and embedded in the
// library; the driver compiles the PTX for the device it runs on.

struct gx_cop {
    unsigned long long src, dst, len;
};

extern "C" __global__ void __launch_bounds__(256) gx_gather(const gx_cop *ops, unsigned long long n) {
    for (unsigned long long i = blockIdx.x; i < n; i += gridDim.x) {
        const gx_cop o = ops[i];
        const char *s = (const char *)o.src;
        char *d = (char *)o.dst;
        const unsigned long long len = o.len;
        const unsigned long long t = threadIdx.x, nt = blockDim.x;
        if (((o.src | o.dst) & 15ULL) == 0) {
            const uint4 *s4 = (const uint4 *)s;
            uint4 *d4 = (uint4 *)d;
            const unsigned long long nv = len >> 4;
            unsigned long long j = t;
            for (; j + 3 * nt < nv; j += 4 * nt) {
                const uint4 a = s4[j], b = s4[j + nt], c = s4[j + 2 * nt], e = s4[j + 3 * nt];
                d4[j] = a;
                d4[j + nt] = b;
                d4[j + 2 * nt] = c;
                d4[j + 3 * nt] = e;
            }
            for (; j < nv; j += nt)
                d4[j] = s4[j];
            for (unsigned long long k = (nv << 4) + t; k < len; k += nt)
                d[k] = s[k];
        } else {
            for (unsigned long long k = t; k < len; k += nt)
                d[k] = s[k];
        }
    }
}
