// See gxnixl.h. The declarations below are gonixl's own, written from the
// documented C API of NIXL's Rust bindings (libnixl_capi.so) as NIXL 1.5.1
// ships it: handles are opaque pointers, every function returns a status.
// They hold for the versions load.go accepts and for no other: the C API
// has changed since (listen_port's type, the descriptor-list constructors,
// status codes), so load.go checks the version before anything is resolved.
#ifndef _GNU_SOURCE
#define _GNU_SOURCE // dlinfo
#endif
#include "gxnixl.h"

#include <dlfcn.h>
#include <link.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

// Status codes of the C API (not NIXL's own; see capi_to_nixl).
enum {
    CAPI_OK = 0,
    CAPI_IN_PROG = 1,
    CAPI_INVALID_PARAM = -1,
    CAPI_BACKEND = -2,
    CAPI_INVALID_STATE = -3,
    CAPI_EXCEPTION = -4,
    CAPI_NO_TELEMETRY = -5,
    CAPI_NOT_FOUND = -6,
};

// NIXL's nixl_status_t values.
enum {
    NX_IN_PROG = 1,
    NX_SUCCESS = 0,
    NX_INVALID_PARAM = -2,
    NX_BACKEND = -3,
    NX_NOT_FOUND = -4,
    NX_NOT_ALLOWED = -6,
    NX_UNKNOWN = -8,
    NX_NO_TELEMETRY = -12,
};

typedef void *h_t;

// The C API's agent configuration (nixl_capi_agent_config_t).
struct capi_agent_config {
    bool enable_prog_thread;
    bool enable_listen_thread;
    int listen_port;
    int thread_sync;
    unsigned int num_workers;
    uint64_t pthr_delay_us;
    uint64_t lthr_delay_us;
    bool capture_telemetry;
};

struct capi_telemetry {
    uint64_t start_time_us;
    uint64_t post_duration_us;
    uint64_t xfer_duration_us;
    uint64_t total_bytes;
    uint64_t desc_count;
};

static struct {
    void *lib;
    int (*create_configured_agent)(const char *, const struct capi_agent_config *, h_t *);
    int (*destroy_agent)(h_t);
    int (*get_available_plugins)(h_t, h_t *);
    int (*string_list_size)(h_t, size_t *);
    int (*string_list_get)(h_t, size_t, const char **);
    int (*destroy_string_list)(h_t);
    int (*create_params)(h_t *);
    int (*params_add)(h_t, const char *, const char *);
    int (*destroy_params)(h_t);
    int (*create_backend)(h_t, const char *, h_t, h_t *);
    int (*destroy_backend)(h_t);
    int (*create_reg_dlist)(int, h_t *);
    int (*reg_dlist_add_desc)(h_t, uintptr_t, size_t, uint64_t, const void *, size_t);
    int (*destroy_reg_dlist)(h_t);
    int (*register_mem)(h_t, h_t, h_t);
    int (*deregister_mem)(h_t, h_t, h_t);
    int (*get_local_md)(h_t, void **, size_t *);
    int (*load_remote_md)(h_t, const void *, size_t, char **);
    int (*invalidate_remote_md)(h_t, const char *);
    int (*create_xfer_dlist)(int, h_t *);
    int (*xfer_dlist_add_desc)(h_t, uintptr_t, size_t, uint64_t);
    int (*destroy_xfer_dlist)(h_t);
    int (*prep_xfer_dlist)(h_t, const char *, h_t, h_t *, h_t);
    int (*release_xfer_dlist_handle)(h_t, h_t);
    int (*create_opt_args)(h_t *);
    int (*opt_args_set_notif_msg)(h_t, const void *, size_t);
    int (*opt_args_set_has_notif)(h_t, bool);
    int (*destroy_opt_args)(h_t);
    int (*make_xfer_req)(h_t, int, h_t, const int *, size_t, h_t, const int *, size_t, h_t *, h_t);
    int (*post_xfer_req)(h_t, h_t, h_t);
    int (*get_xfer_status)(h_t, h_t);
    int (*get_xfer_telemetry)(h_t, h_t, struct capi_telemetry *);
    int (*release_xfer_req)(h_t, h_t);
    int (*destroy_xfer_req)(h_t);
    int (*gen_notif)(h_t, const char *, const void *, size_t, h_t);
    int (*create_notif_map)(h_t *);
    int (*destroy_notif_map)(h_t);
    int (*get_notifs)(h_t, h_t, h_t);
    int (*notif_map_size)(h_t, size_t *);
    int (*notif_map_get_agent_at)(h_t, size_t, const char **);
    int (*notif_map_get_notifs_size)(h_t, const char *, size_t *);
    int (*notif_map_get_notif)(h_t, const char *, size_t, const void **, size_t *);
    int (*notif_map_clear)(h_t);

    // nixlAgent's own methods (Itanium C++ ABI: the object is the first
    // argument). They return nixl_status_t unmapped. Optional.
    int (*agent_post)(const void *self, void *req, const void *extra);
    int (*agent_status)(const void *self, void *req);
    int (*agent_release)(const void *self, void *req);
} api;

// The C API's handles wrap one pointer to the C++ object: agent -> nixlAgent*,
// request -> nixlXferReqH*. Only the direct-status path looks inside.
static void *inner(h_t h)
{
    return *(void **)h;
}

static int capi_to_nixl(int s)
{
    switch (s) {
    case CAPI_OK:
        return NX_SUCCESS;
    case CAPI_IN_PROG:
        return NX_IN_PROG;
    case CAPI_INVALID_PARAM:
        return NX_INVALID_PARAM;
    case CAPI_BACKEND:
        return NX_BACKEND;
    case CAPI_INVALID_STATE:
        return NX_NOT_ALLOWED;
    case CAPI_NO_TELEMETRY:
        return NX_NO_TELEMETRY;
    case CAPI_NOT_FOUND:
        return NX_NOT_FOUND;
    }
    return NX_UNKNOWN;
}

// Every C API function gonixl calls. All are resolved, once the version is
// accepted, before the first call; one missing refuses the library.
#define REQ(field, name)                                                                           \
    {                                                                                              \
        (void **)&api.field, name                                                                  \
    }
static const struct {
    void **slot;
    const char *name;
} required[] = {
    REQ(create_configured_agent, "nixl_capi_create_configured_agent"),
    REQ(destroy_agent, "nixl_capi_destroy_agent"),
    REQ(get_available_plugins, "nixl_capi_get_available_plugins"),
    REQ(string_list_size, "nixl_capi_string_list_size"),
    REQ(string_list_get, "nixl_capi_string_list_get"),
    REQ(destroy_string_list, "nixl_capi_destroy_string_list"),
    REQ(create_params, "nixl_capi_create_params"),
    REQ(params_add, "nixl_capi_params_add"),
    REQ(destroy_params, "nixl_capi_destroy_params"),
    REQ(create_backend, "nixl_capi_create_backend"),
    REQ(destroy_backend, "nixl_capi_destroy_backend"),
    REQ(create_reg_dlist, "nixl_capi_create_reg_dlist"),
    REQ(reg_dlist_add_desc, "nixl_capi_reg_dlist_add_desc"),
    REQ(destroy_reg_dlist, "nixl_capi_destroy_reg_dlist"),
    REQ(register_mem, "nixl_capi_register_mem"),
    REQ(deregister_mem, "nixl_capi_deregister_mem"),
    REQ(get_local_md, "nixl_capi_get_local_md"),
    REQ(load_remote_md, "nixl_capi_load_remote_md"),
    REQ(invalidate_remote_md, "nixl_capi_invalidate_remote_md"),
    REQ(create_xfer_dlist, "nixl_capi_create_xfer_dlist"),
    REQ(xfer_dlist_add_desc, "nixl_capi_xfer_dlist_add_desc"),
    REQ(destroy_xfer_dlist, "nixl_capi_destroy_xfer_dlist"),
    REQ(prep_xfer_dlist, "nixl_capi_prep_xfer_dlist"),
    REQ(release_xfer_dlist_handle, "nixl_capi_release_xfer_dlist_handle"),
    REQ(create_opt_args, "nixl_capi_create_opt_args"),
    REQ(opt_args_set_notif_msg, "nixl_capi_opt_args_set_notif_msg"),
    REQ(opt_args_set_has_notif, "nixl_capi_opt_args_set_has_notif"),
    REQ(destroy_opt_args, "nixl_capi_destroy_opt_args"),
    REQ(make_xfer_req, "nixl_capi_make_xfer_req"),
    REQ(post_xfer_req, "nixl_capi_post_xfer_req"),
    REQ(get_xfer_status, "nixl_capi_get_xfer_status"),
    REQ(get_xfer_telemetry, "nixl_capi_get_xfer_telemetry"),
    REQ(release_xfer_req, "nixl_capi_release_xfer_req"),
    REQ(destroy_xfer_req, "nixl_capi_destroy_xfer_req"),
    REQ(gen_notif, "nixl_capi_gen_notif"),
    REQ(create_notif_map, "nixl_capi_create_notif_map"),
    REQ(destroy_notif_map, "nixl_capi_destroy_notif_map"),
    REQ(get_notifs, "nixl_capi_get_notifs"),
    REQ(notif_map_size, "nixl_capi_notif_map_size"),
    REQ(notif_map_get_agent_at, "nixl_capi_notif_map_get_agent_at"),
    REQ(notif_map_get_notifs_size, "nixl_capi_notif_map_get_notifs_size"),
    REQ(notif_map_get_notif, "nixl_capi_notif_map_get_notif"),
    REQ(notif_map_clear, "nixl_capi_notif_map_clear"),
};
#define NREQ (sizeof required / sizeof required[0])

size_t gxnixl_required_count(void)
{
    return NREQ;
}
const char *gxnixl_required_name(size_t i)
{
    return i < NREQ ? required[i].name : NULL;
}

int gxnixl_open(const char *path, char *err, size_t errlen)
{
    if (api.lib)
        return 0;
    dlerror();
    api.lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!api.lib) {
        const char *e = dlerror();
        snprintf(err, errlen, "%s", e ? e : "dlopen failed");
        return -1;
    }
    return 0;
}

int gxnixl_loaded_file(const char *soname, char *out, size_t outlen)
{
    void *h = api.lib;
    struct link_map *lm = NULL;
    int rc = -1;
    if (!h)
        return -1;
    if (soname) {
        // Already loaded (as a dependency of api.lib, by soname): this finds
        // that object and loads nothing.
        h = dlopen(soname, RTLD_LAZY | RTLD_NOLOAD);
        if (!h)
            return -1;
    }
    if (dlinfo(h, RTLD_DI_LINKMAP, &lm) == 0 && lm && lm->l_name && lm->l_name[0]) {
        snprintf(out, outlen, "%s", lm->l_name);
        rc = 0;
    }
    if (soname)
        dlclose(h);
    return rc;
}

void gxnixl_close(void)
{
    if (api.lib)
        dlclose(api.lib);
    memset(&api, 0, sizeof api);
}

int gxnixl_resolve(char *missing, size_t mlen, char *err, size_t errlen)
{
    if (!api.lib) {
        snprintf(missing, mlen, "%s", "");
        snprintf(err, errlen, "%s", "library not open");
        return -1;
    }
    for (size_t i = 0; i < NREQ; i++) {
        dlerror();
        *required[i].slot = dlsym(api.lib, required[i].name);
        if (!*required[i].slot) {
            const char *e = dlerror();
            snprintf(missing, mlen, "%s", required[i].name);
            snprintf(err, errlen, "%s", e ? e : "resolved to NULL");
            for (size_t j = 0; j < NREQ; j++)
                *required[j].slot = NULL;
            return -1;
        }
    }
    // nixlAgent::postXferReq(nixlXferReqH*, nixlAgentOptionalArgs const*) const,
    // nixlAgent::getXferStatus(nixlXferReqH*) const and
    // nixlAgent::releaseXferReq(nixlXferReqH*) const, found through the C
    // API library's dependency libnixl.so. Optional: without all three the
    // C API's own post/status/release are used.
    *(void **)(&api.agent_post) =
        dlsym(api.lib, "_ZNK9nixlAgent11postXferReqEP12nixlXferReqHPK21nixlAgentOptionalArgs");
    *(void **)(&api.agent_status) = dlsym(api.lib, "_ZNK9nixlAgent13getXferStatusEP12nixlXferReqH");
    *(void **)(&api.agent_release) =
        dlsym(api.lib, "_ZNK9nixlAgent14releaseXferReqEP12nixlXferReqH");
    dlerror();
    if (!api.agent_post || !api.agent_status || !api.agent_release) {
        api.agent_post = NULL;
        api.agent_status = NULL;
        api.agent_release = NULL;
    }
    return 0;
}

int gxnixl_have_direct_status(void)
{
    return api.agent_post != NULL;
}

int gxnixl_agent_new(const char *name, int prog_thread, int sync_mode, int telemetry,
                     uint64_t pthr_delay_us, void **out)
{
    struct capi_agent_config cfg = {0};
    cfg.enable_prog_thread = prog_thread != 0;
    cfg.enable_listen_thread = false;
    cfg.listen_port = 0;
    cfg.thread_sync = sync_mode;
    cfg.num_workers = 0;
    cfg.pthr_delay_us = pthr_delay_us;
    cfg.lthr_delay_us = 100000;
    cfg.capture_telemetry = telemetry != 0;
    return capi_to_nixl(api.create_configured_agent(name, &cfg, out));
}

int gxnixl_agent_free(void *agent)
{
    return capi_to_nixl(api.destroy_agent(agent));
}

int gxnixl_plugins(void *agent, char **out, size_t *len)
{
    h_t list = NULL;
    int s = api.get_available_plugins(agent, &list);
    if (s != CAPI_OK)
        return capi_to_nixl(s);
    size_t n = 0, total = 0;
    api.string_list_size(list, &n);
    for (size_t i = 0; i < n; i++) {
        const char *p = NULL;
        if (api.string_list_get(list, i, &p) == CAPI_OK && p)
            total += strlen(p) + 1;
    }
    char *buf = malloc(total + 1), *w = buf;
    if (!buf) {
        api.destroy_string_list(list);
        return NX_BACKEND;
    }
    for (size_t i = 0; i < n; i++) {
        const char *p = NULL;
        if (api.string_list_get(list, i, &p) == CAPI_OK && p) {
            size_t l = strlen(p);
            memcpy(w, p, l);
            w += l;
            *w++ = '\n';
        }
    }
    *w = 0;
    api.destroy_string_list(list);
    *out = buf;
    *len = (size_t)(w - buf);
    return NX_SUCCESS;
}

int gxnixl_backend_new(void *agent, const char *name, const char **keys, const char **vals,
                       size_t n)
{
    h_t params = NULL, backend = NULL;
    int s = api.create_params(&params);
    if (s != CAPI_OK)
        return capi_to_nixl(s);
    for (size_t i = 0; i < n; i++) {
        s = api.params_add(params, keys[i], vals[i]);
        if (s != CAPI_OK)
            goto out;
    }
    s = api.create_backend(agent, name, params, &backend);
    if (s == CAPI_OK && backend)
        api.destroy_backend(backend); // the wrapper only; the agent owns the backend
out:
    api.destroy_params(params);
    return capi_to_nixl(s);
}

int gxnixl_register(void *agent, int mem, const uint64_t *descs, size_t n, int dereg)
{
    h_t list = NULL;
    int s = api.create_reg_dlist(mem, &list);
    if (s != CAPI_OK)
        return capi_to_nixl(s);
    for (size_t i = 0; i < n; i++) {
        s = api.reg_dlist_add_desc(list, (uintptr_t)descs[3 * i], (size_t)descs[3 * i + 1],
                                   descs[3 * i + 2], NULL, 0);
        if (s != CAPI_OK)
            goto out;
    }
    s = dereg ? api.deregister_mem(agent, list, NULL) : api.register_mem(agent, list, NULL);
out:
    api.destroy_reg_dlist(list);
    return capi_to_nixl(s);
}

int gxnixl_local_md(void *agent, void **data, size_t *len)
{
    *data = NULL;
    *len = 0;
    return capi_to_nixl(api.get_local_md(agent, data, len));
}

int gxnixl_load_md(void *agent, const void *data, size_t len, char **name)
{
    *name = NULL;
    return capi_to_nixl(api.load_remote_md(agent, data, len, name));
}

int gxnixl_invalidate(void *agent, const char *name)
{
    return capi_to_nixl(api.invalidate_remote_md(agent, name));
}

int gxnixl_prep(void *agent, const char *remote, int mem, const uint64_t *descs, size_t n,
                void **out)
{
    h_t list = NULL;
    *out = NULL;
    int s = api.create_xfer_dlist(mem, &list);
    if (s != CAPI_OK)
        return capi_to_nixl(s);
    for (size_t i = 0; i < n; i++) {
        s = api.xfer_dlist_add_desc(list, (uintptr_t)descs[3 * i], (size_t)descs[3 * i + 1],
                                    descs[3 * i + 2]);
        if (s != CAPI_OK)
            goto out;
    }
    s = api.prep_xfer_dlist(agent, remote, list, out, NULL);
out:
    api.destroy_xfer_dlist(list);
    return capi_to_nixl(s);
}

int gxnixl_release_dlist(void *agent, void *dlist)
{
    return capi_to_nixl(api.release_xfer_dlist_handle(agent, dlist));
}

int gxnixl_make(void *agent, int op, void *local, const int32_t *li, void *remote,
                const int32_t *ri, size_t n, const void *notif, size_t notif_len, int has_notif,
                void **out)
{
    h_t opt = NULL;
    int s;
    *out = NULL;
    if (has_notif) {
        s = api.create_opt_args(&opt);
        if (s != CAPI_OK)
            return capi_to_nixl(s);
        s = api.opt_args_set_notif_msg(opt, notif_len ? notif : "", notif_len);
        if (s == CAPI_OK)
            s = api.opt_args_set_has_notif(opt, true);
        if (s != CAPI_OK)
            goto out;
    }
    s = api.make_xfer_req(agent, op, local, (const int *)li, n, remote, (const int *)ri, n, out,
                          opt);
out:
    if (opt)
        api.destroy_opt_args(opt);
    return capi_to_nixl(s);
}

int gxnixl_post(void *agent, void *req)
{
    if (api.agent_post)
        return api.agent_post(inner(agent), inner(req), NULL);
    return capi_to_nixl(api.post_xfer_req(agent, req, NULL));
}

int gxnixl_check(void *agent, void *req)
{
    if (api.agent_status)
        return api.agent_status(inner(agent), inner(req));
    return capi_to_nixl(api.get_xfer_status(agent, req));
}

int gxnixl_telemetry(void *agent, void *req, uint64_t out[6])
{
    struct capi_telemetry t = {0};
    int s = api.get_xfer_telemetry(agent, req, &t);
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    out[0] = t.start_time_us;
    out[1] = t.post_duration_us;
    out[2] = t.xfer_duration_us;
    out[3] = t.total_bytes;
    out[4] = t.desc_count;
    out[5] = (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
    return capi_to_nixl(s);
}

int gxnixl_release_xfer(void *agent, void *req)
{
    int s;
    if (api.agent_release) {
        s = api.agent_release(inner(agent), inner(req));
        if (s != NX_SUCCESS)
            return s;
        *(void **)req = NULL; // released: the wrapper may now be freed
    } else {
        s = capi_to_nixl(api.release_xfer_req(agent, req));
        if (s != NX_SUCCESS)
            return s;
    }
    return capi_to_nixl(api.destroy_xfer_req(req));
}

int gxnixl_gen_notif(void *agent, const char *remote, const void *msg, size_t len)
{
    return capi_to_nixl(api.gen_notif(agent, remote, len ? msg : "", len, NULL));
}

int gxnixl_notif_map_new(void **out)
{
    return capi_to_nixl(api.create_notif_map(out));
}

void gxnixl_notif_map_free(void *map)
{
    if (map)
        api.destroy_notif_map(map);
}

int gxnixl_get_notifs(void *agent, void *map, void **buf, size_t *len, size_t *count)
{
    *buf = NULL;
    *len = 0;
    *count = 0;
    api.notif_map_clear(map);
    int s = api.get_notifs(agent, map, NULL);
    if (s != CAPI_OK)
        return capi_to_nixl(s);
    size_t agents = 0, total = 0, nrec = 0;
    api.notif_map_size(map, &agents);
    for (int pass = 0; pass < 2; pass++) {
        unsigned char *w = NULL;
        if (pass == 1) {
            if (nrec == 0)
                break;
            *buf = malloc(total);
            if (!*buf) {
                api.notif_map_clear(map);
                return NX_BACKEND;
            }
            w = *buf;
        }
        for (size_t a = 0; a < agents; a++) {
            const char *name = NULL;
            size_t n = 0;
            if (api.notif_map_get_agent_at(map, a, &name) != CAPI_OK || !name)
                continue;
            if (api.notif_map_get_notifs_size(map, name, &n) != CAPI_OK)
                continue;
            uint32_t nl = (uint32_t)strlen(name);
            for (size_t i = 0; i < n; i++) {
                const void *d = NULL;
                size_t dl = 0;
                if (api.notif_map_get_notif(map, name, i, &d, &dl) != CAPI_OK)
                    continue;
                if (pass == 0) {
                    total += 8 + nl + dl;
                    nrec++;
                    continue;
                }
                uint32_t l32 = (uint32_t)dl;
                memcpy(w, &nl, 4);
                memcpy(w + 4, name, nl);
                w += 4 + nl;
                memcpy(w, &l32, 4);
                if (dl)
                    memcpy(w + 4, d, dl);
                w += 4 + dl;
            }
        }
    }
    api.notif_map_clear(map);
    *len = total;
    *count = nrec;
    return NX_SUCCESS;
}

void gxnixl_free(void *p)
{
    free(p);
}

int64_t gxnixl_touch(const int32_t *li, const int32_t *ri, size_t n)
{
    return n ? (int64_t)li[0] + ri[n - 1] + (int64_t)n : 0;
}
