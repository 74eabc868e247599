//go:build cgo && !gonixl_noucx

/* gxcuda.c: see gxcuda.h. Only the CUDA driver API entry points used here
 * are declared, with the driver's ABI types spelt out (no CUDA headers at
 * build time). */
#include "gxcuda.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUmodule;
typedef void *CUfunction;
typedef unsigned long long CUdeviceptr;
typedef struct {
    char reserved[GX_CUDA_IPC_HANDLE];
} CUipcMemHandle;
typedef struct {
    char bytes[GX_CUDA_UUID];
} CUuuid;

enum {
    CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,
    CU_MEMORYTYPE_DEVICE = 2,
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
    CU_STREAM_NON_BLOCKING = 1,
    CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1,
};

static struct {
    pthread_once_t once;
    int rc;
    char err[512];
    void *h;
    CUresult (*init)(unsigned);
    CUresult (*driver_get_version)(int *);
    CUresult (*get_error_name)(CUresult, const char **);
    CUresult (*get_error_string)(CUresult, const char **);
    CUresult (*device_get)(CUdevice *, int);
    CUresult (*device_get_attribute)(int *, int, CUdevice);
    CUresult (*device_get_uuid)(CUuuid *, CUdevice);
    CUresult (*primary_ctx_retain)(CUcontext *, CUdevice);
    CUresult (*primary_ctx_release)(CUdevice);
    CUresult (*ctx_push)(CUcontext);
    CUresult (*ctx_pop)(CUcontext *);
    CUresult (*pointer_get_attribute)(void *, int, CUdeviceptr);
    CUresult (*mem_get_address_range)(CUdeviceptr *, size_t *, CUdeviceptr);
    CUresult (*ipc_get_mem_handle)(CUipcMemHandle *, CUdeviceptr);
    CUresult (*ipc_open_mem_handle)(CUdeviceptr *, CUipcMemHandle, unsigned);
    CUresult (*ipc_close_mem_handle)(CUdeviceptr);
    CUresult (*module_load_data)(CUmodule *, const void *);
    CUresult (*module_unload)(CUmodule);
    CUresult (*module_get_function)(CUfunction *, CUmodule, const char *);
    CUresult (*stream_create)(CUstream *, unsigned);
    CUresult (*stream_destroy)(CUstream);
    CUresult (*stream_synchronize)(CUstream);
    CUresult (*mem_alloc)(CUdeviceptr *, size_t);
    CUresult (*mem_free)(CUdeviceptr);
    CUresult (*memcpy_htod)(CUdeviceptr, const void *, size_t);
    CUresult (*launch_kernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                              unsigned, unsigned, CUstream, void **, void **);
} C = {.once = PTHREAD_ONCE_INIT};

static const char *load_path;

static void load_once(void)
{
    const char *p = load_path && *load_path ? load_path : "libcuda.so.1";
    C.h = dlopen(p, RTLD_NOW | RTLD_LOCAL);
    if (!C.h) {
        const char *e = dlerror();
        snprintf(C.err, sizeof C.err, "dlopen %s: %s", p, e ? e : "failed");
        C.rc = GX_CUDA_ERR_UNLOADED;
        return;
    }
#define SYM(field, name)                                                                           \
    do {                                                                                           \
        *(void **)(&C.field) = dlsym(C.h, name);                                                   \
        if (!C.field) {                                                                            \
            snprintf(C.err, sizeof C.err, "%s: no symbol %s", p, name);                            \
            C.rc = GX_CUDA_ERR_UNLOADED;                                                           \
            return;                                                                                \
        }                                                                                          \
    } while (0)
    SYM(init, "cuInit");
    SYM(driver_get_version, "cuDriverGetVersion");
    SYM(get_error_name, "cuGetErrorName");
    SYM(get_error_string, "cuGetErrorString");
    SYM(device_get, "cuDeviceGet");
    SYM(device_get_attribute, "cuDeviceGetAttribute");
    SYM(device_get_uuid, "cuDeviceGetUuid");
    SYM(primary_ctx_retain, "cuDevicePrimaryCtxRetain");
    SYM(primary_ctx_release, "cuDevicePrimaryCtxRelease_v2");
    SYM(ctx_push, "cuCtxPushCurrent_v2");
    SYM(ctx_pop, "cuCtxPopCurrent_v2");
    SYM(pointer_get_attribute, "cuPointerGetAttribute");
    SYM(mem_get_address_range, "cuMemGetAddressRange_v2");
    SYM(ipc_get_mem_handle, "cuIpcGetMemHandle");
    SYM(ipc_open_mem_handle, "cuIpcOpenMemHandle_v2");
    SYM(ipc_close_mem_handle, "cuIpcCloseMemHandle");
    SYM(module_load_data, "cuModuleLoadData");
    SYM(module_unload, "cuModuleUnload");
    SYM(module_get_function, "cuModuleGetFunction");
    SYM(stream_create, "cuStreamCreate");
    SYM(stream_destroy, "cuStreamDestroy_v2");
    SYM(stream_synchronize, "cuStreamSynchronize");
    SYM(mem_alloc, "cuMemAlloc_v2");
    SYM(mem_free, "cuMemFree_v2");
    SYM(memcpy_htod, "cuMemcpyHtoD_v2");
    SYM(launch_kernel, "cuLaunchKernel");
#undef SYM
    CUresult r = C.init(0);
    if (r != 0) {
        char m[256];
        gx_cuda_strerror(r, m, sizeof m);
        snprintf(C.err, sizeof C.err, "cuInit: %s", m);
        C.rc = r;
    }
}

int gx_cuda_load(const char *path, char *err, size_t errlen)
{
    load_path = path;
    pthread_once(&C.once, load_once);
    if (C.rc != 0 && err && errlen)
        snprintf(err, errlen, "%s", C.err);
    return C.rc;
}

void gx_cuda_strerror(int rc, char *buf, size_t len)
{
    const char *name = NULL, *desc = NULL;
    switch (rc) {
    case GX_CUDA_ERR_UNLOADED:
        snprintf(buf, len, "CUDA driver not loaded");
        return;
    case GX_CUDA_ERR_NOMEM:
        snprintf(buf, len, "out of host memory");
        return;
    }
    if (C.get_error_name)
        C.get_error_name(rc, &name);
    if (C.get_error_string)
        C.get_error_string(rc, &desc);
    snprintf(buf, len, "%s (%d): %s", name ? name : "CUresult", rc, desc ? desc : "unknown error");
}

int gx_cuda_driver_version(int *v)
{
    if (C.rc != 0 || !C.h)
        return GX_CUDA_ERR_UNLOADED;
    return C.driver_get_version(v);
}

#define CK(call)                                                                                   \
    do {                                                                                           \
        rc = (call);                                                                               \
        if (rc != 0) {                                                                             \
            what = #call;                                                                          \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)

int gx_cuda_dev_open(int ordinal, const char *ptx, gx_cuda_dev *d, char *err, size_t errlen)
{
    int rc = 0;
    const char *what = "";
    CUcontext ctx = NULL, popped;
    CUdevice dev;
    CUuuid uuid;
    int pushed = 0;
    memset(d, 0, sizeof *d);
    d->ordinal = ordinal;
    if (C.rc != 0 || !C.h) {
        snprintf(err, errlen, "CUDA driver not loaded");
        return GX_CUDA_ERR_UNLOADED;
    }
    CK(C.device_get(&dev, ordinal));
    CK(C.device_get_attribute(&d->sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev));
    CK(C.device_get_uuid(&uuid, dev));
    memcpy(d->uuid, uuid.bytes, GX_CUDA_UUID);
    CK(C.primary_ctx_retain(&ctx, dev));
    d->dev = (void *)(intptr_t)dev;
    d->ctx = ctx;
    CK(C.ctx_push(ctx));
    pushed = 1;
    CK(C.stream_create((CUstream *)&d->stream, CU_STREAM_NON_BLOCKING));
    CK(C.module_load_data((CUmodule *)&d->module, ptx));
    CK(C.module_get_function((CUfunction *)&d->fn, d->module, "gx_gather"));
    CK(C.module_get_function((CUfunction *)&d->fnb, d->module, "gx_gather_blocks"));
    C.ctx_pop(&popped);
    pthread_mutex_init(&d->mu, NULL);
    return 0;
fail : {
    char m[256];
    gx_cuda_strerror(rc, m, sizeof m);
    snprintf(err, errlen, "device %d: %s: %s", ordinal, what, m);
}
    if (d->module)
        C.module_unload(d->module);
    if (d->stream)
        C.stream_destroy(d->stream);
    if (pushed)
        C.ctx_pop(&popped);
    if (ctx)
        C.primary_ctx_release(dev);
    memset(d, 0, sizeof *d);
    return rc;
}

void gx_cuda_dev_close(gx_cuda_dev *d)
{
    CUcontext popped;
    if (!d->ctx)
        return;
    if (C.ctx_push(d->ctx) == 0) {
        if (d->scratch)
            C.mem_free(d->scratch);
        if (d->module)
            C.module_unload(d->module);
        if (d->stream)
            C.stream_destroy(d->stream);
        C.ctx_pop(&popped);
    }
    C.primary_ctx_release((CUdevice)(intptr_t)d->dev);
    pthread_mutex_destroy(&d->mu);
    memset(d, 0, sizeof *d);
}

int gx_cuda_export(gx_cuda_dev *d, uint64_t ptr, uint64_t len, uint64_t *base, uint64_t *size,
                   uint8_t *handle, char *err, size_t errlen)
{
    int rc = 0, mt = 0, ord = -1;
    const char *what = "";
    CUcontext popped;
    CUdeviceptr b = 0;
    size_t sz = 0;
    CUipcMemHandle h;
    if (C.ctx_push(d->ctx) != 0) {
        snprintf(err, errlen, "cannot make device %d's context current", d->ordinal);
        return GX_CUDA_ERR_UNLOADED;
    }
    CK(C.pointer_get_attribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr));
    if (mt != CU_MEMORYTYPE_DEVICE) {
        C.ctx_pop(&popped);
        snprintf(err, errlen, "%#llx is not device memory (CUDA memory type %d)",
                 (unsigned long long)ptr, mt);
        return 1; /* CUDA_ERROR_INVALID_VALUE */
    }
    CK(C.pointer_get_attribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr));
    if (ord != d->ordinal) {
        C.ctx_pop(&popped);
        snprintf(err, errlen, "%#llx is on device %d, registered as device %d",
                 (unsigned long long)ptr, ord, d->ordinal);
        return 101; /* CUDA_ERROR_INVALID_DEVICE */
    }
    CK(C.mem_get_address_range(&b, &sz, ptr));
    if (ptr + len > b + sz) {
        C.ctx_pop(&popped);
        snprintf(err, errlen, "%#llx+%llu runs past its allocation %#llx+%zu",
                 (unsigned long long)ptr, (unsigned long long)len, (unsigned long long)b, sz);
        return 1;
    }
    CK(C.ipc_get_mem_handle(&h, b));
    C.ctx_pop(&popped);
    *base = b;
    *size = sz;
    memcpy(handle, h.reserved, GX_CUDA_IPC_HANDLE);
    return 0;
fail : {
    char m[256];
    gx_cuda_strerror(rc, m, sizeof m);
    snprintf(err, errlen, "%#llx: %s: %s", (unsigned long long)ptr, what, m);
}
    C.ctx_pop(&popped);
    return rc;
}

int gx_cuda_ipc_open(gx_cuda_dev *d, const uint8_t *handle, uint64_t *mapped)
{
    CUcontext popped;
    CUipcMemHandle h;
    CUdeviceptr p = 0;
    int rc = C.ctx_push(d->ctx);
    if (rc != 0)
        return rc;
    memcpy(h.reserved, handle, GX_CUDA_IPC_HANDLE);
    rc = C.ipc_open_mem_handle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    C.ctx_pop(&popped);
    *mapped = p;
    return rc;
}

int gx_cuda_ipc_close(gx_cuda_dev *d, uint64_t mapped)
{
    CUcontext popped;
    int rc = C.ctx_push(d->ctx);
    if (rc != 0)
        return rc;
    rc = C.ipc_close_mem_handle(mapped);
    C.ctx_pop(&popped);
    return rc;
}

/* upload copies bytes of host into d's scratch buffer (growing it), with
 * d->mu held and d's context current. */
static int upload(gx_cuda_dev *d, const void *host, size_t bytes)
{
    int rc;
    if (bytes > d->scratch_len) {
        size_t want = bytes < (1u << 20) ? (1u << 20) : bytes + bytes / 4;
        CUdeviceptr p = 0;
        rc = C.mem_alloc(&p, want);
        if (rc != 0)
            return rc;
        if (d->scratch)
            C.mem_free(d->scratch);
        d->scratch = p;
        d->scratch_len = want;
    }
    return C.memcpy_htod(d->scratch, host, bytes);
}

/* Threads per block of the gather kernels (gather.cu's GX_THREADS, its
 * launch bound): 512 measured 0.97-1.00 of a plain copy on an H200 where
 * 256 gave 0.91-0.98 (tests/gpu/gather_variants.py). */
#define GX_THREADS 512

/* launch runs fn over items with args on d's stream and waits for it. */
static int launch(gx_cuda_dev *d, void *fn, unsigned long long items, void **args)
{
    unsigned long long cap = (unsigned long long)d->sms * 16;
    int rc = C.launch_kernel(fn, (unsigned)(items < cap ? items : cap), 1, 1, GX_THREADS, 1, 1, 0,
                             d->stream, args, NULL);
    if (rc == 0)
        rc = C.stream_synchronize(d->stream);
    return rc;
}

int gx_cuda_gather_blocks(gx_cuda_dev *d, const void *host, size_t bytes, size_t nregs,
                          size_t npairs, uint64_t chunk, uint64_t nchunks)
{
    CUcontext popped;
    unsigned long long nr = nregs, np = npairs, ch = chunk, nc = nchunks;
    CUdeviceptr regs = 0, pairs = 0;
    void *args[6] = {&regs, &nr, &pairs, &np, &ch, &nc};
    int rc;
    if (nr * np * nc == 0)
        return 0;
    pthread_mutex_lock(&d->mu);
    rc = C.ctx_push(d->ctx);
    if (rc == 0) {
        rc = upload(d, host, bytes);
        regs = d->scratch;
        pairs = d->scratch + nregs * 40;
        if (rc == 0)
            rc = launch(d, d->fnb, nr * np * nc, args);
        C.ctx_pop(&popped);
    }
    pthread_mutex_unlock(&d->mu);
    return rc;
}

int gx_cuda_gather(gx_cuda_dev *d, const gx_cop *ops, size_t n)
{
    CUcontext popped;
    unsigned long long nn = n;
    CUdeviceptr p = 0;
    void *args[2] = {&p, &nn};
    int rc;
    if (n == 0)
        return 0;
    pthread_mutex_lock(&d->mu);
    rc = C.ctx_push(d->ctx);
    if (rc == 0) {
        rc = upload(d, ops, n * sizeof *ops);
        p = d->scratch;
        if (rc == 0)
            rc = launch(d, d->fn, nn, args);
        C.ctx_pop(&popped);
    }
    pthread_mutex_unlock(&d->mu);
    return rc;
}
