/* gxucx.h: the C half of gonixl's direct UCP backend (package nixl/ucx).
 *
 * libucp is never linked: gx_load dlopens it and resolves every function
 * this file uses into a table of pointers. The UCX headers supply only types,
 * constants and inline helpers (UCS_PTR_IS_ERR and friends).
 *
 * Nothing here calls into Go. UCX callbacks (active-message receive, endpoint
 * error, send completion) are C functions that store into C-side state which
 * Go reads later. Every function that touches a worker must be called with
 * the owning agent's Go mutex held (the worker is created SERIALIZED).
 */
#ifndef GONIXL_GXUCX_H
#define GONIXL_GXUCX_H

#include <stddef.h>
#include <stdint.h>
#include <pthread.h>
#include <ucp/api/ucp.h>

#define GX_AM_NOTIF_ID 0
#define GX_MAX_NOTIF   (1u << 20) /* largest accepted notification payload */
#define GX_MAX_NAME    1024       /* largest accepted sender name */

/* Errors gonixl adds on top of ucs_status_t (all below UCS_ERR_LAST). */
#define GX_ERR_REPOST_ACTIVE (-1001)
#define GX_ERR_EP_FAILED     (-1002)
#define GX_ERR_EP_CLOSED     (-1003)
#define GX_ERR_CMA_DENIED    (-1004)

/* Loads libucp from path. On failure returns -1 and writes a message into
 * err. Must be called once per process before anything else. */
int gx_load(const char *path, char *err, size_t errlen);
/* Fills the loaded library's version. */
void gx_version(unsigned *major, unsigned *minor, unsigned *release);
/* The path of the object that actually defines ucp_init_version (dladdr). */
const char *gx_loaded_path(void);
const char *gx_status_string(int status);

typedef struct gx_notif {
    struct gx_notif *next;
    uint32_t name_len;
    uint32_t msg_len;
    char data[]; /* name then msg */
} gx_notif;

typedef struct gx_pending {
    struct gx_pending *next;
    void *req;
    void *buf;
} gx_pending;

typedef struct gx_agent {
    ucp_context_h ctx;
    ucp_worker_h worker;
    int efd;               /* worker event fd (only with wakeup), else -1 */
    gx_pending *pending;   /* fire-and-forget sends still in flight */
    pthread_mutex_t nq_mu; /* guards the notification queue below */
    gx_notif *nq_head, *nq_tail;
    uint64_t nq_dropped;
} gx_agent;

/* Creates context + worker. cfg is "KEY=VAL\n..." applied with
 * ucp_config_modify (may be NULL). wakeup adds UCP_FEATURE_WAKEUP and exposes
 * the worker's event fd. Returns NULL with err filled on failure. */
gx_agent *gx_agent_create(const char *name, const char *cfg, int wakeup, char *err, size_t errlen);
/* Destroys worker and context (after every ep, rkey and memh is gone). */
void gx_agent_destroy(gx_agent *a);
/* Copies the worker address into a malloc'd buffer. */
int gx_worker_address(gx_agent *a, void **out, size_t *len);
/* Progresses the worker until it has nothing to do (at most max rounds) and
 * reaps completed fire-and-forget sends. Returns the events processed. */
unsigned gx_progress(gx_agent *a, unsigned max);
/* Progress; when that found nothing to do and arm is set, arm the worker's
 * event fd. Returns -1 when armed (the caller may sleep on the fd), else the
 * number of events processed (0: idle but not armed, or arm said busy). */
int gx_progress_arm(gx_agent *a, int arm);
/* Blocks in poll(2) on the worker fd and wakefd for at most timeout_ms.
 * Does not touch the worker: call it without the Go mutex. */
void gx_wait(int efd, int wakefd, int timeout_ms);
/* Detaches and returns the queued notifications (caller frees each node). */
gx_notif *gx_notifs_take(gx_agent *a, uint64_t *dropped);
void gx_notifs_free(gx_notif *n);
static inline const char *gx_notif_data(const gx_notif *n)
{
    return n->data;
}

typedef struct gx_ep {
    ucp_ep_h ep;
    volatile int failed; /* set by the error callback */
    volatile int status; /* the ucs_status_t it reported */
    int closed;
} gx_ep;

/* Creates an endpoint to a worker address. peer_mode selects
 * UCP_ERR_HANDLING_MODE_PEER (else NONE). */
gx_ep *gx_ep_create(gx_agent *a, const void *addr, size_t len, int peer_mode, char *err,
                    size_t errlen);
/* Reports whether UCX declared the endpoint failed (and with which status). */
int gx_ep_failed(gx_ep *e, int *status);
/* Writes ucp_ep_print_info into a malloc'd NUL-terminated string. */
char *gx_ep_info(gx_ep *e);
/* Flushes every outstanding operation on the endpoint, progressing for at
 * most timeout_ms. Returns 0 when flushed, 1 on timeout, <0 on failure. */
int gx_ep_flush(gx_agent *a, gx_ep *e, int timeout_ms);
/* Closes the endpoint: flush-close (force if failed or asked), progressing for at most
 * timeout_ms. The gx_ep struct stays allocated (freed by gx_ep_free). */
void gx_ep_close(gx_agent *a, gx_ep *e, int force, int timeout_ms);
/* Non-blocking halves of gx_ep_flush and gx_ep_close, for a teardown
 * advanced by the progress loop: each returns 0 when done at once, 1 with
 * *req set to a request to poll with gx_req_poll, <0 on failure. */
int gx_ep_flush_start(gx_agent *a, gx_ep *e, void **req);
int gx_ep_close_start(gx_agent *a, gx_ep *e, int force, void **req);
/* Progresses the worker once and reports a request: 1 still in progress,
 * 0 completed OK, <0 completed with an error. A completed request is
 * freed (and *req cleared). */
int gx_req_poll(gx_agent *a, void **req);
/* Gives an unfinished request back to UCX (freed when it completes). */
void gx_req_abandon(void **req);
void gx_ep_free(gx_ep *e);

/* Maps [addr, addr+len) and packs its rkey into a malloc'd buffer. */
int gx_mem_map(gx_agent *a, uint64_t addr, uint64_t len, ucp_mem_h *memh, void **rkey,
               size_t *rkey_len);
int gx_mem_unmap(gx_agent *a, ucp_mem_h memh);
int gx_rkey_unpack(gx_ep *e, const void *buf, size_t len, ucp_rkey_h *out);
void gx_rkey_destroy(ucp_rkey_h r);

/* One UCP operation of a transfer: 32 bytes, laid out identically in Go. */
typedef struct gx_iov {
    uint64_t laddr;
    uint64_t raddr;
    uint64_t len;
    uint32_t rkey_idx;
    uint32_t memh_idx;
} gx_iov;

enum { GX_X_IDLE = 0, GX_X_DATA = 1, GX_X_NOTIF = 2, GX_X_DONE = 3, GX_X_ERR = 4 };

typedef struct gx_xfer {
    void *data_req;
    void *flush_req;
    void *notif_req;
    void *notif_buf; /* [u16 name_len][name][msg], owned by the xfer */
    size_t notif_len;
    int state;
    int err; /* ucs_status_t (or GX_ERR_*) when state == GX_X_ERR */
    /* A post that failed after earlier ops of its batch went out: those may
     * still move bytes, so the transfer stays in its data phase (busy)
     * until the flush behind them completes, then fails with this. */
    int pending_err;
} gx_xfer;

gx_xfer *gx_xfer_new(void);
/* Sets (or clears, with len 0) the notification sent after the data. */
int gx_xfer_set_notif(gx_xfer *x, const void *buf, size_t len);
/* Posts every op (READ: op=0 → ucp_get_nbx, WRITE: op=1 → ucp_put_nbx),
 * then an endpoint flush. Returns 1 (in progress), 0 (done) or a negative
 * status. */
int gx_post(gx_agent *a, gx_ep *e, int op, const gx_iov *iov, size_t n, ucp_rkey_h *rkeys,
            size_t nrkeys, ucp_mem_h *memhs, size_t nmemhs, gx_xfer *x);
/* Progresses (unless progress == 0) and advances x. Same returns as
 * gx_post. */
int gx_check(gx_agent *a, gx_ep *e, gx_xfer *x, int progress);
/* Same-host data path: moves every op with process_vm_readv (op=0) or
 * process_vm_writev (op=1) against process pid, synchronously, without UCX.
 * Touches no UCX state, so it may run without the agent mutex. Returns 0,
 * or GX_ERR_CMA_DENIED when the kernel refuses access before anything
 * moved, GX_ERR_EP_FAILED when the process is gone, UCS_ERR_IO_ERROR else. */
int gx_cma(int pid, int op, const gx_iov *iov, size_t n);
/* Marks x's data complete after gx_cma and advances it (sends the
 * notification). Same returns as gx_post. */
int gx_data_done(gx_agent *a, gx_ep *e, gx_xfer *x);
/* Cancels what is in flight, hands buffers still referenced by UCX to the
 * agent's pending list, frees x. */
/* 1 while a transfer's data phase may still write local memory (the flush
 * after its ops has not completed); such a transfer must not be freed. */
int gx_xfer_busy(gx_agent *a, gx_xfer *x);
void gx_xfer_free(gx_agent *a, gx_xfer *x);
/* Fire-and-forget notification (buf is copied). */
int gx_send_notif(gx_agent *a, gx_ep *e, const void *buf, size_t len);

/* ---- same-host shared-memory data path (gxshm.c) ---------------------------
 *
 * The owner of a registered region re-backs its page-aligned interior with a
 * sealed memfd (same addresses, same contents); a peer on the same host opens
 * the memfd through /proc/<pid>/fd/<fd>, maps it, and a READ or WRITE becomes
 * a memcpy. Page 0 of the memfd is a control page; the data follows it. */
#define GX_ERR_SHM_REVOKED (-1005)
#define GX_SHM_MAGIC       0x314d48534c584e47ull /* "GNXLSHM1" */
enum { GX_SHM_ACTIVE = 1, GX_SHM_REVOKED = 2 };

typedef struct gx_shm_ctl {
    uint64_t magic;
    uint64_t token; /* random, also in the metadata */
    uint64_t len;   /* data bytes after this page */
    uint32_t state; /* GX_SHM_ACTIVE until the owner deregisters */
} gx_shm_ctl;

typedef struct gx_shm_local {
    int fd;
    uint64_t ino, dev;
    gx_shm_ctl *ctl;
} gx_shm_local;

size_t gx_page_size(void);
/* Re-backs [base, base+len) (page aligned, private anonymous memory the
 * caller checked) with a new sealed memfd, chunk bytes at a time, keeping
 * every byte. On failure the range is private memory again with its
 * contents, err says why, and -1 is returned. */
int gx_shm_share(uint64_t base, uint64_t len, uint64_t token, size_t chunk, gx_shm_local *out,
                 char *err, size_t errlen);
/* Marks the region revoked: peers fail transfers that touch it. */
void gx_shm_revoke(gx_shm_local *l);
/* Revokes; with restore, maps private anonymous memory back over the range
 * with the same contents (holes stay unpopulated) and frees the file's
 * pages; then closes the memfd. */
void gx_shm_unshare(gx_shm_local *l, uint64_t base, uint64_t len, size_t chunk, int restore);
/* Peer side: opens /proc/pid/fd/fd, checks inode, device, size, seals and
 * the control page against the metadata, maps control page + data. */
int gx_shm_attach(int pid, int fd, uint64_t ino, uint64_t dev, uint64_t len, uint64_t token,
                  void **map, char *err, size_t errlen);
void gx_shm_detach(void *map, uint64_t len);
/* pidfd of a process (-1 when the kernel has none); whether it exited. */
int gx_pidfd_open(int pid);
int gx_pidfd_exited(int pidfd);
/* Moves shm ops (raddr already translated into the peer mapping) with
 * memcpy and cma ops with gx_cma against pid, checking before and after
 * that every control page in ctls is active and that the owner lives.
 * Returns 0, GX_ERR_SHM_REVOKED, GX_ERR_EP_FAILED or gx_cma's errors. */
int gx_shm_post(int pid, int pidfd, int op, const gx_iov *shm, size_t nshm, const gx_iov *cma,
                size_t ncma, void *const *ctls, size_t nctl);

#endif
