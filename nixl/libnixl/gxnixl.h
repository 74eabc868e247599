// gxnixl: gonixl's own declarations for the parts of NIXL's C API
// (libnixl_capi.so) that gonixl uses, resolved at run time with dlopen, plus
// bulk helpers so that each Go operation crosses cgo once.
//
// Every gxnixl_* function returns a status in NIXL's own nixl_status_t space
// (0 success, 1 in progress, negative errors, same numbers as NIXL).
#ifndef GONIXL_GXNIXL_H
#define GONIXL_GXNIXL_H

#include <stddef.h>
#include <stdint.h>

// Loading happens in three steps so that the version can be checked before
// anything of the library is resolved or called: gxnixl_open, then (in Go)
// the version check on the files gxnixl_loaded_file names, then
// gxnixl_resolve; gxnixl_close undoes gxnixl_open after a refusal.
//
// dlopen libnixl_capi.so from path (its dependencies come with it; only the
// libraries' own initialisers run). On failure returns -1 and writes the
// dlerror text into err.
int gxnixl_open(const char *path, char *err, size_t errlen);
// The file the dynamic linker mapped for soname, an object already loaded
// (with the opened library, as its dependency); soname NULL: the opened
// library itself. Returns -1 when there is none.
int gxnixl_loaded_file(const char *soname, char *out, size_t outlen);
// Resolve every C API symbol gonixl needs (and, optionally, nixlAgent's
// post/status/release). On failure returns -1, writes the first missing
// symbol's name into missing and the dlerror text into err, and leaves
// nothing resolved.
int gxnixl_resolve(char *missing, size_t mlen, char *err, size_t errlen);
// dlclose the opened library and forget every resolved symbol.
void gxnixl_close(void);
// The required C API symbols, by index (NULL past the end).
size_t gxnixl_required_count(void);
const char *gxnixl_required_name(size_t i);
// 1 when NIXL's agent methods for post/status/release were found, so their
// statuses come back unmapped (the C API folds most errors into BACKEND).
int gxnixl_have_direct_status(void);

int gxnixl_agent_new(const char *name, int prog_thread, int sync_mode, int telemetry,
                     uint64_t pthr_delay_us, void **out);
int gxnixl_agent_free(void *agent);
// Available plugin names, '\n'-separated, malloc'ed (free with gxnixl_free).
int gxnixl_plugins(void *agent, char **out, size_t *len);
int gxnixl_backend_new(void *agent, const char *name, const char **keys, const char **vals,
                       size_t n);

// descs points at n {addr, len, devId} triples.
int gxnixl_register(void *agent, int mem, const uint64_t *descs, size_t n, int dereg);
int gxnixl_local_md(void *agent, void **data, size_t *len);
int gxnixl_load_md(void *agent, const void *data, size_t len, char **name);
int gxnixl_invalidate(void *agent, const char *name);

int gxnixl_prep(void *agent, const char *remote, int mem, const uint64_t *descs, size_t n,
                void **out);
int gxnixl_release_dlist(void *agent, void *dlist);

int gxnixl_make(void *agent, int op, void *local, const int32_t *li, void *remote,
                const int32_t *ri, size_t n, const void *notif, size_t notif_len, int has_notif,
                void **out);
int gxnixl_post(void *agent, void *req);
int gxnixl_check(void *agent, void *req);
// out: start (µs, steady clock), post µs, xfer µs, bytes, descs, and the
// steady clock's now (µs) to place start on the wall clock.
int gxnixl_telemetry(void *agent, void *req, uint64_t out[6]);
int gxnixl_release_xfer(void *agent, void *req);

int gxnixl_gen_notif(void *agent, const char *remote, const void *msg, size_t len);
// Drains notifications into one malloc'ed buffer of records
// [u32 agent_len][agent][u32 msg_len][msg]...; *count records.
int gxnixl_get_notifs(void *agent, void *map, void **buf, size_t *len, size_t *count);
int gxnixl_notif_map_new(void **out);
void gxnixl_notif_map_free(void *map);

void gxnixl_free(void *p);
// Reads both index arrays and returns a checksum: a cgo crossing with the
// arrays of a MakeXfer and no NIXL work, for benchmarks.
int64_t gxnixl_touch(const int32_t *li, const int32_t *ri, size_t n);

#endif
