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

// GX_UNROLL: 16-byte loads each thread has in flight before it stores.
#ifndef GX_UNROLL
#define GX_UNROLL 4
#endif
// GX_THREADS: the most threads a block is launched with (gxcuda.c: 512).
#ifndef GX_THREADS
#define GX_THREADS 512
#endif

// gx_copy: the threads of one block copy len bytes from s to d together.
__device__ __forceinline__ void gx_copy(const char *s, char *d, unsigned long long len) {
    const unsigned long long t = threadIdx.x, nt = blockDim.x;
    if ((((unsigned long long)s | (unsigned long long)d) & 15ULL) == 0) {
        const uint4 *s4 = (const uint4 *)s;
        uint4 *d4 = (uint4 *)d;
        const unsigned long long nv = len >> 4;
        unsigned long long j = t;
        for (; j + (GX_UNROLL - 1) * nt < nv; j += GX_UNROLL * nt) {
            uint4 r[GX_UNROLL];
#pragma unroll
            for (int u = 0; u < GX_UNROLL; u++)
                r[u] = s4[j + u * nt];
#pragma unroll
            for (int u = 0; u < GX_UNROLL; u++)
                d4[j + u * nt] = r[u];
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

struct gx_cop {
    unsigned long long src, dst, len;
};

extern "C" __global__ void __launch_bounds__(GX_THREADS) gx_gather(const gx_cop *ops, unsigned long long n) {
    for (unsigned long long i = blockIdx.x; i < n; i += gridDim.x) {
        const gx_cop o = ops[i];
        gx_copy((const char *)o.src, (char *)o.dst, o.len);
    }
}

// gx_gather_blocks is the same copy for a transfer given as regions times
// blocks (a KV cache's layers and K/V planes times a request's blocks):
// item (r, k, c) copies chunk c of block pair k of region r, from
// src_base + src_block * src_stride to dst_base + dst_block * dst_stride
// (bytes, both within region r). The host sends a few kilobytes (the
// region table and the block pairs) instead of one entry per descriptor.
struct gx_creg {
    unsigned long long src, dst, src_stride, dst_stride, len;
};
struct gx_cpair {
    unsigned int src, dst;
};

extern "C" __global__ void __launch_bounds__(GX_THREADS)
    gx_gather_blocks(const gx_creg *regs, unsigned long long nregs, const gx_cpair *pairs, unsigned long long npairs,
                     unsigned long long chunk, unsigned long long nchunks) {
    const unsigned long long per_region = npairs * nchunks, items = nregs * per_region;
    for (unsigned long long i = blockIdx.x; i < items; i += gridDim.x) {
        const unsigned long long r = i / per_region, rest = i - r * per_region;
        const unsigned long long k = rest / nchunks, c = rest - k * nchunks;
        const gx_creg g = regs[r];
        const gx_cpair p = pairs[k];
        const unsigned long long off = c * chunk;
        if (off >= g.len)
            continue;
        const unsigned long long len = g.len - off < chunk ? g.len - off : chunk;
        gx_copy((const char *)(g.src + (unsigned long long)p.src * g.src_stride + off),
                (char *)(g.dst + (unsigned long long)p.dst * g.dst_stride + off), len);
    }
}
