/* gxcuda.h: the ucx engine's CUDA IPC data path, over the CUDA driver API
 * loaded with dlopen (libcuda.so.1), so that the library loads and runs on
 * hosts without CUDA. Every call that needs a context pushes the device's
 * primary context and pops it before returning, so any thread may call
 * (vLLM's model thread, a handshake goroutine, a copy goroutine). */
#ifndef GXCUDA_H
#define GXCUDA_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define GX_CUDA_IPC_HANDLE 64
#define GX_CUDA_UUID       16

/* Errors (besides the driver's own CUresult codes, which are positive). */
enum { GX_CUDA_ERR_UNLOADED = -1, GX_CUDA_ERR_NOMEM = -2 };

/* Loads libcuda.so.1 (or path) and calls cuInit. 0 on success, else a
 * message in err. Idempotent; safe from several threads. */
int gx_cuda_load(const char *path, char *err, size_t errlen);
/* Fills buf with the driver's name and description of rc. */
void gx_cuda_strerror(int rc, char *buf, size_t len);
int gx_cuda_driver_version(int *v);

/* One device of this process: its primary context, a non-blocking stream
 * and the gather kernel (gather.ptx), set up on first use. */
typedef struct gx_cuda_dev {
    int ordinal;
    int sms;
    void *dev;    /* CUdevice, as an int stored in a pointer-sized slot */
    void *ctx;    /* CUcontext (primary, retained) */
    void *stream; /* CUstream */
    void *module; /* CUmodule */
    void *fn;     /* CUfunction gx_gather */
    void *fnb;    /* CUfunction gx_gather_blocks */
    /* The operation tables of one launch at a time: a device buffer grown
     * as needed and kept (no allocation or free per transfer: cuMemFree
     * synchronises the whole device, vLLM's streams included). */
    pthread_mutex_t mu;
    uint64_t scratch;
    size_t scratch_len;
    uint8_t uuid[GX_CUDA_UUID];
} gx_cuda_dev;

/* Opens device ordinal (retains its primary context, creates the stream,
 * loads ptx). On error returns a CUresult or GX_CUDA_ERR_*, with what
 * failed in err. */
int gx_cuda_dev_open(int ordinal, const char *ptx, gx_cuda_dev *d, char *err, size_t errlen);
void gx_cuda_dev_close(gx_cuda_dev *d);

/* Checks that [ptr, ptr+len) is device memory of d's device inside one
 * allocation, and returns that allocation's base and size and its IPC
 * handle (handle: GX_CUDA_IPC_HANDLE bytes). */
int gx_cuda_export(gx_cuda_dev *d, uint64_t ptr, uint64_t len, uint64_t *base, uint64_t *size,
                   uint8_t *handle, char *err, size_t errlen);
/* Maps a peer's allocation (cuIpcOpenMemHandle) into this process. */
int gx_cuda_ipc_open(gx_cuda_dev *d, const uint8_t *handle, uint64_t *mapped);
int gx_cuda_ipc_close(gx_cuda_dev *d, uint64_t mapped);

/* One copy of a gather: len bytes from src to dst (device addresses). */
typedef struct gx_cop {
    uint64_t src, dst, len;
} gx_cop;

/* gx_cuda_gather for a transfer of regions times blocks: host holds nregs
 * region entries (src, dst, src_stride, dst_stride, len: five uint64 each)
 * followed by npairs block pairs (src, dst: two uint32 each); every block
 * pair of every region is copied in pieces of chunk bytes (nchunks per
 * block, enough for the longest region's blocks). */
int gx_cuda_gather_blocks(gx_cuda_dev *d, const void *host, size_t bytes, size_t nregs,
                          size_t npairs, uint64_t chunk, uint64_t nchunks);

/* Uploads n operations to d's scratch buffer, launches the gather kernel
 * over them on d's stream and waits for it. One launch per device at a
 * time. */
int gx_cuda_gather(gx_cuda_dev *d, const gx_cop *ops, size_t n);

#endif
