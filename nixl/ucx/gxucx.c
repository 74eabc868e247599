//go:build cgo && !gonixl_noucx

/* gxucx.c: see gxucx.h. */
#define _GNU_SOURCE
#include "gxucx.h"

#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <sys/uio.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The subset of UCP that gonixl calls, resolved at load time. */
static struct {
    void *handle;
    char path[4096];
    ucs_status_t (*config_read)(const char *, const char *, ucp_config_t **);
    ucs_status_t (*config_modify)(ucp_config_t *, const char *, const char *);
    void (*config_release)(ucp_config_t *);
    ucs_status_t (*init_version)(unsigned, unsigned, const ucp_params_t *, const ucp_config_t *,
                                 ucp_context_h *);
    void (*cleanup)(ucp_context_h);
    void (*get_version)(unsigned *, unsigned *, unsigned *);
    ucs_status_t (*worker_create)(ucp_context_h, const ucp_worker_params_t *, ucp_worker_h *);
    void (*worker_destroy)(ucp_worker_h);
    ucs_status_t (*worker_get_address)(ucp_worker_h, ucp_address_t **, size_t *);
    void (*worker_release_address)(ucp_worker_h, ucp_address_t *);
    unsigned (*worker_progress)(ucp_worker_h);
    ucs_status_t (*worker_get_efd)(ucp_worker_h, int *);
    ucs_status_t (*worker_arm)(ucp_worker_h);
    ucs_status_t (*worker_set_am_recv_handler)(ucp_worker_h, const ucp_am_handler_param_t *);
    ucs_status_t (*ep_create)(ucp_worker_h, const ucp_ep_params_t *, ucp_ep_h *);
    ucs_status_ptr_t (*ep_close_nbx)(ucp_ep_h, const ucp_request_param_t *);
    ucs_status_ptr_t (*ep_flush_nbx)(ucp_ep_h, const ucp_request_param_t *);
    void (*ep_print_info)(ucp_ep_h, FILE *);
    ucs_status_t (*mem_map)(ucp_context_h, const ucp_mem_map_params_t *, ucp_mem_h *);
    ucs_status_t (*mem_unmap)(ucp_context_h, ucp_mem_h);
    ucs_status_t (*rkey_pack)(ucp_context_h, ucp_mem_h, void **, size_t *);
    void (*rkey_buffer_release)(void *);
    ucs_status_t (*ep_rkey_unpack)(ucp_ep_h, const void *, ucp_rkey_h *);
    void (*rkey_destroy)(ucp_rkey_h);
    ucs_status_ptr_t (*put_nbx)(ucp_ep_h, const void *, size_t, uint64_t, ucp_rkey_h,
                                const ucp_request_param_t *);
    ucs_status_ptr_t (*get_nbx)(ucp_ep_h, void *, size_t, uint64_t, ucp_rkey_h,
                                const ucp_request_param_t *);
    ucs_status_ptr_t (*am_send_nbx)(ucp_ep_h, unsigned, const void *, size_t, const void *, size_t,
                                    const ucp_request_param_t *);
    ucs_status_t (*request_check_status)(void *);
    void (*request_free)(void *);
    void (*request_cancel)(ucp_worker_h, void *);
    const char *(*status_string)(ucs_status_t);
} G;

#define SYM(field, name)                                                                           \
    do {                                                                                           \
        *(void **)(&G.field) = dlsym(h, name);                                                     \
        if (G.field == NULL) {                                                                     \
            snprintf(err, errlen, "%s: symbol %s not found", path, name);                          \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)

int gx_load(const char *path, char *err, size_t errlen)
{
    void *h;
    Dl_info info;

    dlerror();
    h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
        const char *e = dlerror();
        snprintf(err, errlen, "%s", e ? e : "dlopen failed");
        return -1;
    }
    SYM(config_read, "ucp_config_read");
    SYM(config_modify, "ucp_config_modify");
    SYM(config_release, "ucp_config_release");
    SYM(init_version, "ucp_init_version");
    SYM(cleanup, "ucp_cleanup");
    SYM(get_version, "ucp_get_version");
    SYM(worker_create, "ucp_worker_create");
    SYM(worker_destroy, "ucp_worker_destroy");
    SYM(worker_get_address, "ucp_worker_get_address");
    SYM(worker_release_address, "ucp_worker_release_address");
    SYM(worker_progress, "ucp_worker_progress");
    SYM(worker_get_efd, "ucp_worker_get_efd");
    SYM(worker_arm, "ucp_worker_arm");
    SYM(worker_set_am_recv_handler, "ucp_worker_set_am_recv_handler");
    SYM(ep_create, "ucp_ep_create");
    SYM(ep_close_nbx, "ucp_ep_close_nbx");
    SYM(ep_flush_nbx, "ucp_ep_flush_nbx");
    SYM(ep_print_info, "ucp_ep_print_info");
    SYM(mem_map, "ucp_mem_map");
    SYM(mem_unmap, "ucp_mem_unmap");
    SYM(rkey_pack, "ucp_rkey_pack");
    SYM(rkey_buffer_release, "ucp_rkey_buffer_release");
    SYM(ep_rkey_unpack, "ucp_ep_rkey_unpack");
    SYM(rkey_destroy, "ucp_rkey_destroy");
    SYM(put_nbx, "ucp_put_nbx");
    SYM(get_nbx, "ucp_get_nbx");
    SYM(am_send_nbx, "ucp_am_send_nbx");
    SYM(request_check_status, "ucp_request_check_status");
    SYM(request_free, "ucp_request_free");
    SYM(request_cancel, "ucp_request_cancel");
    /* libucs is a dependency of libucp, so the handle's search scope has it. */
    SYM(status_string, "ucs_status_string");

    G.handle = h;
    if (dladdr(*(void **)&G.init_version, &info) != 0 && info.dli_fname != NULL) {
        snprintf(G.path, sizeof(G.path), "%s", info.dli_fname);
    } else {
        snprintf(G.path, sizeof(G.path), "%s", path);
    }
    return 0;
fail:
    dlclose(h);
    memset(&G, 0, sizeof(G));
    return -1;
}

void gx_version(unsigned *major, unsigned *minor, unsigned *release)
{
    G.get_version(major, minor, release);
}

const char *gx_loaded_path(void)
{
    return G.path;
}

const char *gx_status_string(int status)
{
    switch (status) {
    case GX_ERR_REPOST_ACTIVE:
        return "transfer still in progress";
    case GX_ERR_EP_FAILED:
        return "endpoint failed";
    case GX_ERR_EP_CLOSED:
        return "endpoint closed";
    case GX_ERR_CMA_DENIED:
        return "cross-memory attach denied";
    case GX_ERR_SHM_REVOKED:
        return "remote region was deregistered by its owner";
    }
    return G.status_string((ucs_status_t)status);
}

/* ---- agent (context + worker) ------------------------------------------- */

static ucs_status_t gx_am_recv(void *arg, const void *header, size_t header_length, void *data,
                               size_t length, const ucp_am_recv_param_t *param)
{
    gx_agent *a = (gx_agent *)arg;
    const unsigned char *p = (const unsigned char *)data;
    size_t name_len;
    gx_notif *n;

    (void)header;
    (void)header_length;
    /* Senders force eager; a rendezvous descriptor, a short or oversized
     * payload is counted and dropped (UCX releases it when we return OK). */
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || length < 2 ||
        length > GX_MAX_NOTIF + GX_MAX_NAME + 2) {
        goto drop;
    }
    name_len = (size_t)p[0] | ((size_t)p[1] << 8);
    if (name_len > GX_MAX_NAME || name_len > length - 2) {
        goto drop;
    }
    n = malloc(sizeof(*n) + length - 2);
    if (n == NULL) {
        goto drop;
    }
    n->next = NULL;
    n->name_len = (uint32_t)name_len;
    n->msg_len = (uint32_t)(length - 2 - name_len);
    memcpy(n->data, p + 2, length - 2);
    pthread_mutex_lock(&a->nq_mu);
    if (a->nq_tail) {
        a->nq_tail->next = n;
    } else {
        a->nq_head = n;
    }
    a->nq_tail = n;
    pthread_mutex_unlock(&a->nq_mu);
    return UCS_OK;
drop:
    pthread_mutex_lock(&a->nq_mu);
    a->nq_dropped++;
    pthread_mutex_unlock(&a->nq_mu);
    return UCS_OK;
}

static int apply_config(ucp_config_t *cfg, const char *kv, char *err, size_t errlen)
{
    char *copy, *line, *save = NULL;
    int rc = 0;

    if (kv == NULL || *kv == '\0') {
        return 0;
    }
    copy = strdup(kv);
    if (copy == NULL) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    for (line = strtok_r(copy, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char *eq = strchr(line, '=');
        ucs_status_t st;
        if (eq == NULL) {
            continue;
        }
        *eq = '\0';
        st = G.config_modify(cfg, line, eq + 1);
        if (st != UCS_OK) {
            snprintf(err, errlen, "ucp_config_modify(%s=%s): %s", line, eq + 1,
                     G.status_string(st));
            rc = -1;
            break;
        }
    }
    free(copy);
    return rc;
}

gx_agent *gx_agent_create(const char *name, const char *cfgkv, int wakeup, char *err, size_t errlen)
{
    gx_agent *a;
    ucp_config_t *cfg = NULL;
    ucp_params_t params;
    ucp_worker_params_t wp;
    ucp_am_handler_param_t am;
    ucs_status_t st;

    if (G.handle == NULL) {
        snprintf(err, errlen, "libucp not loaded");
        return NULL;
    }
    a = calloc(1, sizeof(*a));
    if (a == NULL) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    a->efd = -1;
    pthread_mutex_init(&a->nq_mu, NULL);

    st = G.config_read(NULL, NULL, &cfg);
    if (st != UCS_OK) {
        snprintf(err, errlen, "ucp_config_read: %s", G.status_string(st));
        goto fail;
    }
    if (apply_config(cfg, cfgkv, err, errlen) != 0) {
        goto fail;
    }
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM;
    if (wakeup) {
        params.features |= UCP_FEATURE_WAKEUP;
    }
    params.name = name;
    st = G.init_version(UCP_API_MAJOR, UCP_API_MINOR, &params, cfg, &a->ctx);
    G.config_release(cfg);
    cfg = NULL;
    if (st != UCS_OK) {
        snprintf(err, errlen, "ucp_init: %s", G.status_string(st));
        goto fail;
    }

    memset(&wp, 0, sizeof(wp));
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    st = G.worker_create(a->ctx, &wp, &a->worker);
    if (st != UCS_OK) {
        snprintf(err, errlen, "ucp_worker_create: %s", G.status_string(st));
        goto fail;
    }
    memset(&am, 0, sizeof(am));
    am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG;
    am.id = GX_AM_NOTIF_ID;
    am.cb = gx_am_recv;
    am.arg = a;
    st = G.worker_set_am_recv_handler(a->worker, &am);
    if (st != UCS_OK) {
        snprintf(err, errlen, "ucp_worker_set_am_recv_handler: %s", G.status_string(st));
        goto fail;
    }
    if (wakeup) {
        st = G.worker_get_efd(a->worker, &a->efd);
        if (st != UCS_OK) {
            snprintf(err, errlen, "ucp_worker_get_efd: %s", G.status_string(st));
            goto fail;
        }
    }
    return a;
fail:
    if (cfg) {
        G.config_release(cfg);
    }
    if (a->worker) {
        G.worker_destroy(a->worker);
    }
    if (a->ctx) {
        G.cleanup(a->ctx);
    }
    pthread_mutex_destroy(&a->nq_mu);
    free(a);
    return NULL;
}

static void reap_pending(gx_agent *a, int cancel)
{
    gx_pending **pp = &a->pending;
    while (*pp) {
        gx_pending *p = *pp;
        if (cancel) {
            G.request_cancel(a->worker, p->req);
        }
        if (G.request_check_status(p->req) != UCS_INPROGRESS) {
            G.request_free(p->req);
            free(p->buf);
            *pp = p->next;
            free(p);
        } else {
            pp = &p->next;
        }
    }
}

static void add_pending(gx_agent *a, void *req, void *buf)
{
    gx_pending *p = malloc(sizeof(*p));
    if (p == NULL) {
        /* Cannot track it: leak the buffer rather than free it under UCX. */
        G.request_free(req);
        return;
    }
    p->req = req;
    p->buf = buf;
    p->next = a->pending;
    a->pending = p;
}

void gx_agent_destroy(gx_agent *a)
{
    struct timespec t0, t;
    gx_notif *n;

    if (a == NULL) {
        return;
    }
    if (a->pending) {
        reap_pending(a, 1);
        clock_gettime(CLOCK_MONOTONIC, &t0);
        while (a->pending) {
            G.worker_progress(a->worker);
            reap_pending(a, 0);
            clock_gettime(CLOCK_MONOTONIC, &t);
            if ((t.tv_sec - t0.tv_sec) * 1000 + (t.tv_nsec - t0.tv_nsec) / 1000000 > 500) {
                break;
            }
        }
        /* Whatever is left is abandoned to worker destruction; its buffers
         * are leaked on purpose (UCX may still reference them). */
        while (a->pending) {
            gx_pending *p = a->pending;
            a->pending = p->next;
            G.request_free(p->req);
            free(p);
        }
    }
    G.worker_destroy(a->worker);
    G.cleanup(a->ctx);
    for (n = a->nq_head; n;) {
        gx_notif *next = n->next;
        free(n);
        n = next;
    }
    pthread_mutex_destroy(&a->nq_mu);
    free(a);
}

int gx_worker_address(gx_agent *a, void **out, size_t *len)
{
    ucp_address_t *addr;
    size_t n;
    ucs_status_t st = G.worker_get_address(a->worker, &addr, &n);
    if (st != UCS_OK) {
        return st;
    }
    *out = malloc(n);
    if (*out == NULL) {
        G.worker_release_address(a->worker, addr);
        return UCS_ERR_NO_MEMORY;
    }
    memcpy(*out, addr, n);
    *len = n;
    G.worker_release_address(a->worker, addr);
    return UCS_OK;
}

unsigned gx_progress(gx_agent *a, unsigned max)
{
    unsigned total = 0, i, n;
    for (i = 0; i < max; i++) {
        n = G.worker_progress(a->worker);
        total += n;
        if (n == 0) {
            break;
        }
    }
    if (a->pending) {
        reap_pending(a, 0);
    }
    return total;
}

int gx_progress_arm(gx_agent *a, int arm)
{
    unsigned n = gx_progress(a, 64);
    if (n > 0 || !arm) {
        return (int)n;
    }
    return G.worker_arm(a->worker) == UCS_OK ? -1 : 0;
}

void gx_wait(int efd, int wakefd, int timeout_ms)
{
    struct pollfd fds[2];
    int n = 0;
    if (efd >= 0) {
        fds[n].fd = efd;
        fds[n].events = POLLIN;
        n++;
    }
    if (wakefd >= 0) {
        fds[n].fd = wakefd;
        fds[n].events = POLLIN;
        n++;
    }
    (void)poll(fds, (nfds_t)n, timeout_ms);
}

gx_notif *gx_notifs_take(gx_agent *a, uint64_t *dropped)
{
    gx_notif *n;
    pthread_mutex_lock(&a->nq_mu);
    n = a->nq_head;
    a->nq_head = a->nq_tail = NULL;
    *dropped = a->nq_dropped;
    a->nq_dropped = 0;
    pthread_mutex_unlock(&a->nq_mu);
    return n;
}

void gx_notifs_free(gx_notif *n)
{
    while (n) {
        gx_notif *next = n->next;
        free(n);
        n = next;
    }
}

/* ---- endpoints ------------------------------------------------------------ */

static void gx_ep_err(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    gx_ep *e = (gx_ep *)arg;
    (void)ep;
    e->status = status;
    __atomic_store_n(&e->failed, 1, __ATOMIC_RELEASE);
}

gx_ep *gx_ep_create(gx_agent *a, const void *addr, size_t len, int peer_mode, char *err,
                    size_t errlen)
{
    ucp_ep_params_t p;
    ucs_status_t st;
    gx_ep *e = calloc(1, sizeof(*e));
    (void)len;
    if (e == NULL) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    memset(&p, 0, sizeof(p));
    p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.address = (const ucp_address_t *)addr;
    p.err_mode = peer_mode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    p.err_handler.cb = gx_ep_err;
    p.err_handler.arg = e;
    st = G.ep_create(a->worker, &p, &e->ep);
    if (st != UCS_OK) {
        snprintf(err, errlen, "ucp_ep_create: %s", G.status_string(st));
        free(e);
        return NULL;
    }
    return e;
}

int gx_ep_failed(gx_ep *e, int *status)
{
    if (__atomic_load_n(&e->failed, __ATOMIC_ACQUIRE)) {
        *status = e->status;
        return 1;
    }
    return 0;
}

char *gx_ep_info(gx_ep *e)
{
    char *buf = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&buf, &n);
    if (f == NULL) {
        return NULL;
    }
    G.ep_print_info(e->ep, f);
    fclose(f);
    return buf;
}

static long elapsed_ms(const struct timespec *t0)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long)(t.tv_sec - t0->tv_sec) * 1000 + (t.tv_nsec - t0->tv_nsec) / 1000000;
}

int gx_ep_flush(gx_agent *a, gx_ep *e, int timeout_ms)
{
    void *req;
    struct timespec t0;
    int rc = gx_ep_flush_start(a, e, &req);

    if (rc != 1) {
        return rc;
    }
    clock_gettime(CLOCK_MONOTONIC, &t0);
    while ((rc = gx_req_poll(a, &req)) == 1) {
        if (elapsed_ms(&t0) > timeout_ms) {
            gx_req_abandon(&req);
            return 1;
        }
    }
    return rc;
}

void gx_ep_close(gx_agent *a, gx_ep *e, int force, int timeout_ms)
{
    void *req;
    struct timespec t0;

    if (gx_ep_close_start(a, e, force, &req) != 1) {
        return;
    }
    clock_gettime(CLOCK_MONOTONIC, &t0);
    while (gx_req_poll(a, &req) == 1) {
        if (elapsed_ms(&t0) > timeout_ms) {
            /* The peer does not answer the close handshake: give the request
             * back; worker destruction reclaims the endpoint. */
            gx_req_abandon(&req);
            return;
        }
    }
}

int gx_ep_flush_start(gx_agent *a, gx_ep *e, void **req)
{
    ucp_request_param_t p;
    ucs_status_ptr_t sp;

    (void)a;
    *req = NULL;
    if (e == NULL || e->closed) {
        return 0;
    }
    if (__atomic_load_n(&e->failed, __ATOMIC_ACQUIRE)) {
        return GX_ERR_EP_FAILED;
    }
    memset(&p, 0, sizeof(p));
    sp = G.ep_flush_nbx(e->ep, &p);
    if (sp == NULL) {
        return 0;
    }
    if (UCS_PTR_IS_ERR(sp)) {
        return UCS_PTR_STATUS(sp);
    }
    *req = sp;
    return 1;
}

int gx_ep_close_start(gx_agent *a, gx_ep *e, int force, void **req)
{
    ucp_request_param_t p;
    ucs_status_ptr_t sp;

    (void)a;
    *req = NULL;
    if (e == NULL || e->closed) {
        return 0;
    }
    e->closed = 1;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags =
        (force || __atomic_load_n(&e->failed, __ATOMIC_ACQUIRE)) ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    sp = G.ep_close_nbx(e->ep, &p);
    if (sp == NULL) {
        return 0;
    }
    if (UCS_PTR_IS_ERR(sp)) {
        return UCS_PTR_STATUS(sp);
    }
    *req = sp;
    return 1;
}

int gx_req_poll(gx_agent *a, void **req)
{
    ucs_status_t st;

    if (*req == NULL) {
        return 0;
    }
    G.worker_progress(a->worker);
    st = G.request_check_status(*req);
    if (st == UCS_INPROGRESS) {
        return 1;
    }
    G.request_free(*req);
    *req = NULL;
    return st == UCS_OK ? 0 : (int)st;
}

void gx_req_abandon(void **req)
{
    if (*req != NULL) {
        G.request_free(*req);
        *req = NULL;
    }
}

void gx_ep_free(gx_ep *e)
{
    free(e);
}

/* ---- memory ---------------------------------------------------------------- */

int gx_mem_map(gx_agent *a, uint64_t addr, uint64_t len, ucp_mem_h *memh, void **rkey,
               size_t *rkey_len)
{
    ucp_mem_map_params_t p;
    ucs_status_t st;
    void *buf;
    size_t n;

    memset(&p, 0, sizeof(p));
    p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    p.address = (void *)(uintptr_t)addr;
    p.length = (size_t)len;
    st = G.mem_map(a->ctx, &p, memh);
    if (st != UCS_OK) {
        return st;
    }
    st = G.rkey_pack(a->ctx, *memh, &buf, &n);
    if (st != UCS_OK) {
        G.mem_unmap(a->ctx, *memh);
        return st;
    }
    *rkey = malloc(n ? n : 1);
    if (*rkey == NULL) {
        G.rkey_buffer_release(buf);
        G.mem_unmap(a->ctx, *memh);
        return UCS_ERR_NO_MEMORY;
    }
    memcpy(*rkey, buf, n);
    *rkey_len = n;
    G.rkey_buffer_release(buf);
    return UCS_OK;
}

int gx_mem_unmap(gx_agent *a, ucp_mem_h memh)
{
    return G.mem_unmap(a->ctx, memh);
}

int gx_rkey_unpack(gx_ep *e, const void *buf, size_t len, ucp_rkey_h *out)
{
    (void)len; /* UCX parses the buffer; gonixl checked its framing. */
    return G.ep_rkey_unpack(e->ep, buf, out);
}

void gx_rkey_destroy(ucp_rkey_h r)
{
    G.rkey_destroy(r);
}

/* ---- transfers --------------------------------------------------------------- */

gx_xfer *gx_xfer_new(void)
{
    return calloc(1, sizeof(gx_xfer));
}

int gx_xfer_set_notif(gx_xfer *x, const void *buf, size_t len)
{
    void *nb = NULL;
    if (x->state == GX_X_DATA || x->state == GX_X_NOTIF) {
        return GX_ERR_REPOST_ACTIVE;
    }
    if (len > 0) {
        nb = malloc(len);
        if (nb == NULL) {
            return UCS_ERR_NO_MEMORY;
        }
        memcpy(nb, buf, len);
    }
    free(x->notif_buf);
    x->notif_buf = nb;
    x->notif_len = len;
    return UCS_OK;
}

static int fail(gx_xfer *x, int st)
{
    x->state = GX_X_ERR;
    x->err = st;
    return st;
}

/* Checks one request slot: 1 still running, 0 done (slot cleared), <0 failed. */
static int req_done(void **slot)
{
    ucs_status_t st;
    if (*slot == NULL) {
        return 0;
    }
    st = G.request_check_status(*slot);
    if (st == UCS_INPROGRESS) {
        return 1;
    }
    G.request_free(*slot);
    *slot = NULL;
    return st == UCS_OK ? 0 : (int)st;
}

static int advance(gx_agent *a, gx_ep *e, gx_xfer *x)
{
    int rc;
    (void)a;
    if (x->state == GX_X_DATA) {
        if ((rc = req_done(&x->data_req)) != 0 || (rc = req_done(&x->flush_req)) != 0) {
            if (rc < 0) {
                if (x->flush_req) {
                    G.request_cancel(a->worker, x->flush_req);
                    G.request_free(x->flush_req);
                    x->flush_req = NULL;
                }
                if (__atomic_load_n(&e->failed, __ATOMIC_ACQUIRE)) {
                    return fail(x, GX_ERR_EP_FAILED);
                }
                return fail(x, rc);
            }
            return 1;
        }
        if (x->pending_err != 0) {
            return fail(x, x->pending_err); /* the ops of a failed post are done */
        }
        /* Data and flush are complete: only now may the peer hear of it. */
        if (x->notif_len > 0) {
            ucp_request_param_t p;
            ucs_status_ptr_t sp;
            if (e->closed) {
                return fail(x, GX_ERR_EP_CLOSED);
            }
            memset(&p, 0, sizeof(p));
            p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
            p.flags = UCP_AM_SEND_FLAG_EAGER;
            sp = G.am_send_nbx(e->ep, GX_AM_NOTIF_ID, NULL, 0, x->notif_buf, x->notif_len, &p);
            if (UCS_PTR_IS_ERR(sp)) {
                return fail(x, UCS_PTR_STATUS(sp));
            }
            x->notif_req = sp;
            x->state = GX_X_NOTIF;
        } else {
            x->state = GX_X_DONE;
            return 0;
        }
    }
    if (x->state == GX_X_NOTIF) {
        rc = req_done(&x->notif_req);
        if (rc == 1) {
            return 1;
        }
        if (rc < 0) {
            if (__atomic_load_n(&e->failed, __ATOMIC_ACQUIRE)) {
                return fail(x, GX_ERR_EP_FAILED);
            }
            return fail(x, rc);
        }
        x->state = GX_X_DONE;
        return 0;
    }
    if (x->state == GX_X_DONE) {
        return 0;
    }
    if (x->state == GX_X_ERR) {
        return x->err;
    }
    return UCS_ERR_INVALID_PARAM; /* never posted */
}

int gx_post(gx_agent *a, gx_ep *e, int op, const gx_iov *iov, size_t n, ucp_rkey_h *rkeys,
            size_t nrkeys, ucp_mem_h *memhs, size_t nmemhs, gx_xfer *x)
{
    ucp_request_param_t p;
    ucs_status_ptr_t sp;
    void *last = NULL;
    size_t i;

    if (x->state == GX_X_DATA || x->state == GX_X_NOTIF) {
        return GX_ERR_REPOST_ACTIVE;
    }
    x->state = GX_X_IDLE;
    x->err = 0;
    x->pending_err = 0;
    if (e->closed) {
        return fail(x, GX_ERR_EP_CLOSED);
    }
    if (__atomic_load_n(&e->failed, __ATOMIC_ACQUIRE)) {
        return fail(x, GX_ERR_EP_FAILED);
    }
    /* Validate every index before the first op is posted. */
    for (i = 0; i < n; i++) {
        if (iov[i].rkey_idx >= nrkeys || rkeys[iov[i].rkey_idx] == NULL ||
            iov[i].memh_idx >= nmemhs || memhs[iov[i].memh_idx] == NULL) {
            return fail(x, UCS_ERR_INVALID_PARAM);
        }
    }
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH | UCP_OP_ATTR_FLAG_MULTI_SEND;
    for (i = 0; i < n; i++) {
        p.memh = memhs[iov[i].memh_idx];
        if (op == 0) {
            sp = G.get_nbx(e->ep, (void *)(uintptr_t)iov[i].laddr, (size_t)iov[i].len, iov[i].raddr,
                           rkeys[iov[i].rkey_idx], &p);
        } else {
            sp = G.put_nbx(e->ep, (const void *)(uintptr_t)iov[i].laddr, (size_t)iov[i].len,
                           iov[i].raddr, rkeys[iov[i].rkey_idx], &p);
        }
        if (UCS_PTR_IS_ERR(sp)) {
            if (i > 0) {
                /* Ops 0..i-1 are out and may still write (GET) or read
                 * (PUT) local memory: a flush tracks them, and the
                 * transfer fails only once it completes. */
                memset(&p, 0, sizeof(p));
                ucs_status_ptr_t fp = G.ep_flush_nbx(e->ep, &p);
                if (!UCS_PTR_IS_ERR(fp)) {
                    x->data_req = last;
                    x->flush_req = fp;
                    x->pending_err = UCS_PTR_STATUS(sp);
                    x->state = GX_X_DATA;
                    return x->pending_err;
                }
            }
            if (last) {
                G.request_free(last);
            }
            return fail(x, UCS_PTR_STATUS(sp));
        }
        if (sp != NULL) {
            /* UCX frees an earlier request itself once it completes; only
             * the last one is tracked (ops on one ep complete in order for
             * the flush that follows). */
            if (last) {
                G.request_free(last);
            }
            last = sp;
        }
    }
    x->data_req = last;
    memset(&p, 0, sizeof(p));
    sp = G.ep_flush_nbx(e->ep, &p);
    if (UCS_PTR_IS_ERR(sp)) {
        if (x->data_req) {
            G.request_free(x->data_req);
            x->data_req = NULL;
        }
        return fail(x, UCS_PTR_STATUS(sp));
    }
    x->flush_req = sp;
    x->state = GX_X_DATA;
    return advance(a, e, x);
}

int gx_check(gx_agent *a, gx_ep *e, gx_xfer *x, int progress)
{
    if (progress && (x->state == GX_X_DATA || x->state == GX_X_NOTIF)) {
        gx_progress(a, 64);
    }
    return advance(a, e, x);
}

int gx_xfer_busy(gx_agent *a, gx_xfer *x)
{
    /* In its data phase a transfer's GETs may still write local memory
     * (UCX cannot cancel them: ucp_request_cancel ignores RMA, and earlier
     * ops of the batch are not tracked). The flush that follows them
     * completes only when all have, or when the endpoint is force-closed
     * (then with an error): until then the transfer must not be freed. */
    if (x == NULL || x->state != GX_X_DATA) {
        return 0;
    }
    G.worker_progress(a->worker);
    if (x->flush_req != NULL && G.request_check_status(x->flush_req) == UCS_INPROGRESS) {
        return 1;
    }
    if (x->data_req != NULL && G.request_check_status(x->data_req) == UCS_INPROGRESS) {
        return 1;
    }
    return 0;
}

void gx_xfer_free(gx_agent *a, gx_xfer *x)
{
    void **slots[2] = {&x->data_req, &x->flush_req};
    int i;
    if (x == NULL) {
        return;
    }
    for (i = 0; i < 2; i++) {
        if (*slots[i]) {
            if (G.request_check_status(*slots[i]) == UCS_INPROGRESS) {
                G.request_cancel(a->worker, *slots[i]);
            }
            G.request_free(*slots[i]);
        }
    }
    if (x->notif_req) {
        if (G.request_check_status(x->notif_req) == UCS_INPROGRESS) {
            /* UCX may still read the payload: the agent frees it later. */
            add_pending(a, x->notif_req, x->notif_buf);
            x->notif_buf = NULL;
        } else {
            G.request_free(x->notif_req);
        }
    }
    free(x->notif_buf);
    free(x);
}

int gx_send_notif(gx_agent *a, gx_ep *e, const void *buf, size_t len)
{
    ucp_request_param_t p;
    ucs_status_ptr_t sp;
    void *copy;

    if (e->closed) {
        return GX_ERR_EP_CLOSED;
    }
    if (__atomic_load_n(&e->failed, __ATOMIC_ACQUIRE)) {
        return GX_ERR_EP_FAILED;
    }
    copy = malloc(len ? len : 1);
    if (copy == NULL) {
        return UCS_ERR_NO_MEMORY;
    }
    memcpy(copy, buf, len);
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_EAGER;
    sp = G.am_send_nbx(e->ep, GX_AM_NOTIF_ID, NULL, 0, copy, len, &p);
    if (UCS_PTR_IS_ERR(sp)) {
        free(copy);
        return UCS_PTR_STATUS(sp);
    }
    if (sp == NULL) {
        free(copy);
        return UCS_OK;
    }
    add_pending(a, sp, copy);
    return UCS_OK;
}

/* ---- same-host data path ------------------------------------------------------ */

#define GX_CMA_BATCH 512 /* iovecs per syscall, below IOV_MAX (1024) */

int gx_cma(int pid, int op, const gx_iov *iov, size_t n)
{
    struct iovec l[GX_CMA_BATCH], r[GX_CMA_BATCH];
    size_t i = 0, off = 0; /* next op, and bytes of it already moved */
    int moved_any = 0;

    while (i < n) {
        size_t k = 0, want = 0, j;
        ssize_t got;
        for (j = i; j < n && k < GX_CMA_BATCH; j++, k++) {
            size_t skip = (j == i) ? off : 0;
            l[k].iov_base = (void *)(uintptr_t)(iov[j].laddr + skip);
            l[k].iov_len = (size_t)(iov[j].len - skip);
            r[k].iov_base = (void *)(uintptr_t)(iov[j].raddr + skip);
            r[k].iov_len = l[k].iov_len;
            want += l[k].iov_len;
        }
        got =
            op == 0 ? process_vm_readv(pid, l, k, r, k, 0) : process_vm_writev(pid, l, k, r, k, 0);
        if (got < 0) {
            if (errno == EINTR) {
                continue;
            }
            if (errno == ESRCH) {
                return GX_ERR_EP_FAILED;
            }
            if (errno == EPERM && !moved_any) {
                return GX_ERR_CMA_DENIED;
            }
            return UCS_ERR_IO_ERROR;
        }
        if (got == 0 && want > 0) {
            return UCS_ERR_IO_ERROR; /* no progress */
        }
        moved_any = 1;
        /* Advance (i, off) by got bytes; a short count resumes mid-op. */
        while (got > 0 && i < n) {
            size_t left = (size_t)(iov[i].len - off);
            if ((size_t)got >= left) {
                got -= (ssize_t)left;
                i++;
                off = 0;
            } else {
                off += (size_t)got;
                got = 0;
            }
        }
    }
    return 0;
}

int gx_data_done(gx_agent *a, gx_ep *e, gx_xfer *x)
{
    if (x->state == GX_X_DATA || x->state == GX_X_NOTIF) {
        return GX_ERR_REPOST_ACTIVE;
    }
    x->err = 0;
    x->data_req = NULL;
    x->flush_req = NULL;
    x->state = GX_X_DATA;
    return advance(a, e, x);
}
