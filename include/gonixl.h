/*
 * gonixl.h — the C ABI of libgonixl.so.
 *
 * gonixl is a KV-cache transfer engine for vLLM disaggregated prefill/decode.
 * This header is hand-written and is the contract: the library's exported
 * symbols, these declarations and the ctypes prototypes of the Python package
 * (pybridge/gonixl/_lib.py) are compared by tests/abi_check.py on every
 * `./build.sh test`.
 *
 * Conventions
 *  - Every function except gonixl_abi_version() returns gonixl_status_t:
 *    0 OK, 1 in progress, negative values are errors. Codes are append-only.
 *  - Every function takes a trailing `gonixl_error_t *err`, which may be NULL.
 *    On error it receives the code and a NUL-terminated message. There is no
 *    global "last error": Python threads call the library concurrently.
 *  - Objects are opaque uint64_t handles; 0 is never a valid handle. A stale
 *    handle, or a handle of the wrong kind, is an error, never a crash.
 *  - Variable-size outputs negotiate their size: pass (buf, &len). If buf is
 *    NULL or len is too small the call returns GONIXL_ERR_BUFFER_TOO_SMALL
 *    and stores the needed length in *len; on success *len is the length
 *    written. Output bytes are not NUL-terminated unless stated.
 *  - Input byte strings are (pointer, length) pairs and are copied before the
 *    call returns; the library keeps no pointer into caller memory except
 *    registered KV-cache regions.
 *  - A Go panic inside any call is recovered, reported as GONIXL_ERR_INTERNAL,
 *    and poisons the library: every later call fails with GONIXL_ERR_POISONED.
 *  - No callbacks into the caller; completion is polled.
 *  - The library starts a Go runtime when loaded. Load it after fork(), never
 *    before: a Go runtime does not survive fork.
 */
#ifndef GONIXL_H
#define GONIXL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped on any incompatible change to this header. */
#define GONIXL_ABI_VERSION 1

/* Status codes. Append-only: never renumber. */
typedef int32_t gonixl_status_t;
#define GONIXL_OK 0
#define GONIXL_IN_PROGRESS 1
#define GONIXL_ERR_INTERNAL (-1)         /* a bug; a recovered panic poisons the library */
#define GONIXL_ERR_INVALID_ARGUMENT (-2) /* malformed input: bad JSON, bad value, bad length */
#define GONIXL_ERR_NULL_POINTER (-3)     /* a required pointer argument was NULL */
#define GONIXL_ERR_INVALID_HANDLE (-4)   /* 0, unknown or already closed handle */
#define GONIXL_ERR_WRONG_HANDLE (-5)     /* a handle of another kind */
#define GONIXL_ERR_BUFFER_TOO_SMALL (-6) /* *len now holds the needed size */
#define GONIXL_ERR_POISONED (-7)         /* an earlier call panicked */
#define GONIXL_ERR_UNAVAILABLE (-8)      /* a native dependency (NIXL, UCX) cannot be loaded */
#define GONIXL_ERR_NOT_SUPPORTED (-9)    /* valid request the library does not do */
#define GONIXL_ERR_TRANSFER (-10)        /* a transfer or handshake failed */
#define GONIXL_ERR_TIMEOUT (-11)         /* a deadline passed */
#define GONIXL_ERR_STATE (-12)           /* call not valid in the object's current state */

#define GONIXL_ERROR_MESSAGE_SIZE 512

/* Per-call error detail. */
typedef struct gonixl_error {
    int32_t code;                             /* same as the returned status */
    char message[GONIXL_ERROR_MESSAGE_SIZE];  /* NUL-terminated, truncated if needed */
} gonixl_error_t;

/* Handle types. 0 is invalid. */
typedef uint64_t gonixl_scheduler_t; /* scheduler-side connector state (EngineCore process) */
typedef uint64_t gonixl_worker_t;    /* worker-side connector state (one per TP/PP rank) */

/* Returns GONIXL_ABI_VERSION of the library; the loader refuses a mismatch. */
uint32_t gonixl_abi_version(void);

/* The library version string (e.g. "0.1.0"), UTF-8, size-negotiated. */
gonixl_status_t gonixl_version(char *buf, size_t *len, gonixl_error_t *err);

/* A JSON object describing the library and its native dependencies: version,
 * Go version, and for each transfer engine whether it loads here and why not.
 * Size-negotiated. Loads native libraries on first call. */
gonixl_status_t gonixl_probe(char *buf, size_t *len, gonixl_error_t *err);

/* Creates the scheduler-side state from a JSON configuration (see
 * pybridge/gonixl/config.py for the keys). */
gonixl_status_t gonixl_scheduler_new(char *config_json, size_t config_len,
                                     gonixl_scheduler_t *out, gonixl_error_t *err);

/* Stops the scheduler (listener, timers) and frees the handle. A second close
 * of the same handle returns GONIXL_ERR_INVALID_HANDLE. */
gonixl_status_t gonixl_scheduler_close(gonixl_scheduler_t h, gonixl_error_t *err);

/* Creates the worker-side state from a JSON configuration. */
gonixl_status_t gonixl_worker_new(char *config_json, size_t config_len,
                                  gonixl_worker_t *out, gonixl_error_t *err);

/* Stops the worker (in-flight transfers, agent) and frees the handle. */
gonixl_status_t gonixl_worker_close(gonixl_worker_t h, gonixl_error_t *err);

/* Test hook: panics inside the library when the process was started with
 * GONIXL_TEST_HOOKS=1, to exercise the panic guard; otherwise returns
 * GONIXL_ERR_NOT_SUPPORTED and does nothing. */
gonixl_status_t gonixl_debug_panic(gonixl_error_t *err);

#ifdef __cplusplus
}
#endif

#endif /* GONIXL_H */
