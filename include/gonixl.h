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
#define GONIXL_ABI_VERSION 7

/* Status codes. Append-only: never renumber. */
typedef int32_t gonixl_status_t;
#define GONIXL_OK 0
#define GONIXL_IN_PROGRESS 1            /* reserved: no call returns it today */
#define GONIXL_ERR_INTERNAL (-1)         /* a bug; a recovered panic poisons the library */
#define GONIXL_ERR_INVALID_ARGUMENT (-2) /* malformed input: bad JSON, bad value, bad length */
#define GONIXL_ERR_NULL_POINTER (-3)     /* a required pointer argument was NULL */
#define GONIXL_ERR_INVALID_HANDLE (-4)   /* 0, unknown or already closed handle */
#define GONIXL_ERR_WRONG_HANDLE (-5)     /* a handle of another kind */
#define GONIXL_ERR_BUFFER_TOO_SMALL (-6) /* *len now holds the needed size */
#define GONIXL_ERR_POISONED (-7)         /* an earlier call panicked */
#define GONIXL_ERR_UNAVAILABLE (-8)      /* a native dependency (NIXL, UCX) cannot be loaded */
#define GONIXL_ERR_NOT_SUPPORTED (-9)    /* valid request the library does not do */
#define GONIXL_ERR_TRANSFER (-10)        /* the transfer engine failed (registration, connection, transfer) */
#define GONIXL_ERR_TIMEOUT (-11)         /* reserved: deadlines fail requests, not calls */
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

/* ---------------------------------------------------------------------
 * Scheduler side (vLLM's EngineCore process).
 *
 * Strings are (pointer, length) pairs of UTF-8 bytes. kv_transfer_params are
 * the request's dict as JSON ("null" or length 0 for none). Block ids cross
 * as one flat int64 array plus the number of ids of each KV-cache group.
 * --------------------------------------------------------------------- */

/* Creates the scheduler-side state from a JSON configuration (see
 * pybridge/gonixl/vllm.py for the keys). */
gonixl_status_t gonixl_scheduler_new(char *config_json, size_t config_len,
                                     gonixl_scheduler_t *out, gonixl_error_t *err);

/* get_num_new_matched_tokens: *out_count tokens can be loaded remotely,
 * *out_async is 1 when they load asynchronously. */
gonixl_status_t gonixl_scheduler_get_num_new_matched_tokens(gonixl_scheduler_t h,
                                                            char *params_json, size_t params_len,
                                                            int64_t num_prompt_tokens,
                                                            int64_t num_computed_tokens,
                                                            int64_t *out_count, int32_t *out_async,
                                                            gonixl_error_t *err);

/* update_state_after_alloc: block_ids/group_lens are the request's unhashed
 * local blocks; num_computed holds the locally computed blocks per group.
 * *out_mutated is 1 when the caller must set do_remote_prefill=False and
 * _remote_blocks_processed=True on the request's kv_transfer_params. */
gonixl_status_t gonixl_scheduler_update_state_after_alloc(gonixl_scheduler_t h,
                                                          char *req_id, size_t req_id_len,
                                                          char *params_json, size_t params_len,
                                                          int64_t *block_ids, int64_t num_block_ids,
                                                          int64_t *group_lens, int64_t num_groups,
                                                          int64_t *num_computed, int64_t num_computed_len,
                                                          int64_t num_external_tokens,
                                                          int32_t *out_mutated, gonixl_error_t *err);

/* build_connector_meta: this step's metadata for the workers (opaque bytes).
 * Size-negotiated; a result that did not fit is kept for the retry. Zero
 * bytes: an idle step (no work, no timer due): the workers have nothing to
 * do (gonixl_worker_start_load_kv with meta_len 0 returns OK at once), and
 * until another gonixl_scheduler_* call every later step is idle too, for
 * gonixl_scheduler_idle_for's seconds. */
gonixl_status_t gonixl_scheduler_build_meta(gonixl_scheduler_t h, char *buf, size_t *len,
                                            gonixl_error_t *err);

/* Scheduler batches: scheduler calls whose answer the caller does not wait
 * for, encoded one after another, each as uint8 kind, uint32 length of its
 * body, the body (little-endian; in a body str = uint32 length + bytes;
 * groups = uint32 count, then per group uint32 count + int64s; int64s =
 * uint32 count + int64s):
 *   1 on_new_request           str req_id, str params_json
 *                              (starts heartbeats for a decode request
 *                              waiting on a remote prefill)
 *   2 update_state_after_alloc str req_id, str params_json, groups block_ids,
 *                              int64s num_computed, int64 num_external_tokens
 *   3 request_finished         str req_id, str params_json, uint8 normal,
 *                              int64 num_computed_tokens, groups block_ids
 *                              (only a decode's, without bidirectional
 *                              transfer: its answer is always "no delay, no
 *                              params"; any other is refused)
 *   4 update_connector_output  uint32 count, that many str req_id
 *                              (finished_recving)
 * Applied in order, as the single calls below would be (on_new_request and
 * update_connector_output are only ops). results has one
 * byte per op (num_ops): GONIXL_OP_MUTATED (update_state_after_alloc's
 * out_mutated) and GONIXL_OP_INVALID (the op was refused: its params, an
 * unknown kind or a body that does not decode; logged by the library with
 * the request id; the other ops still apply). A batch whose framing does not
 * hold (an op longer than what is left), or that holds another number of
 * ops, applies nothing and writes no result (GONIXL_ERR_INVALID_ARGUMENT). Ops that change what a call reads go before
 * it: gonixl_scheduler_get_num_new_matched_tokens reads only its arguments. */
#define GONIXL_OP_MUTATED 1
#define GONIXL_OP_INVALID 2
gonixl_status_t gonixl_scheduler_apply(gonixl_scheduler_t h, char *ops, size_t ops_len,
                                       uint8_t *results, int64_t num_ops, gonixl_error_t *err);

/* apply_build_meta: gonixl_scheduler_apply, then gonixl_scheduler_build_meta,
 * in one call (a step's batch and its metadata). On a retry after
 * GONIXL_ERR_BUFFER_TOO_SMALL (same ops) the ops are not applied again and
 * results keeps what the first call wrote. */
gonixl_status_t gonixl_scheduler_apply_build_meta(gonixl_scheduler_t h, char *ops, size_t ops_len,
                                                  uint8_t *results, int64_t num_ops, char *buf,
                                                  size_t *len, gonixl_error_t *err);

/* idle_for: after build_meta answered zero bytes, *out is how many seconds
 * later steps stay idle unless another gonixl_scheduler_* call is made (the
 * next heartbeat to a prefill holding blocks for this decode); -1 when
 * nothing is timed (idle until another call), 0 when there is work now. */
gonixl_status_t gonixl_scheduler_idle_for(gonixl_scheduler_t h, double *out, gonixl_error_t *err);

/* request_finished: *out_delay is 1 when the blocks must be held for a remote
 * reader; the kv_transfer_params for the request's output are written as JSON
 * to (out_params, out_len) (length 0 for none). finished_normally is 1 for
 * FINISHED_LENGTH_CAPPED and FINISHED_STOPPED. Size-negotiated; a result that
 * did not fit is kept for the retry with the same req_id. */
gonixl_status_t gonixl_scheduler_request_finished(gonixl_scheduler_t h,
                                                  char *req_id, size_t req_id_len,
                                                  char *params_json, size_t params_len,
                                                  int32_t finished_normally,
                                                  int64_t num_computed_tokens,
                                                  int64_t *block_ids, int64_t num_block_ids,
                                                  int64_t *group_lens, int64_t num_groups,
                                                  int32_t *out_delay, char *out_params,
                                                  size_t *out_len, gonixl_error_t *err);

/* push_prompt_done (push mode, a prefill; vLLM's NixlPushConnector has no
 * such call): the step being scheduled completes this request's prompt and
 * finishes it (max_tokens 1), and none of its blocks (block_ids/group_lens,
 * all of them, per group) is freed before request_finished. Call before this
 * step's gonixl_scheduler_build_meta: the workers WRITE the blocks to the
 * decode as soon as the step's forward is done (their next
 * gonixl_worker_get_finished) instead of after request_finished. Until its
 * request_finished, pending_block_frees reports 1; its request_finished is
 * a push send whatever its status (finished_normally is overridden): its
 * blocks stay held until the WRITE is done. num_tokens: the prompt's tokens
 * (the KV digests cover their slots). */
gonixl_status_t gonixl_scheduler_push_prompt_done(gonixl_scheduler_t h, char *req_id,
                                                  size_t req_id_len, char *params_json,
                                                  size_t params_len, int64_t *block_ids,
                                                  int64_t num_block_ids, int64_t *group_lens,
                                                  int64_t num_groups, int64_t num_tokens,
                                                  gonixl_error_t *err);

/* push_preempted (push mode, a prefill): the request ids vLLM preempted this
 * step (its SchedulerOutput's preempted_req_ids, a JSON array). Those
 * announced by push_prompt_done and not finished go to the workers in this
 * step's metadata: a WRITE not posted yet is dropped, one in flight is waited
 * for in gonixl_worker_handle_preemptions, before the step's forward can
 * overwrite the blocks. Call before this step's gonixl_scheduler_build_meta. */
gonixl_status_t gonixl_scheduler_push_preempted(gonixl_scheduler_t h, char *req_ids_json,
                                                size_t json_len, gonixl_error_t *err);

/* pending_block_frees (vLLM's has_pending_block_frees): bit 1 of *out is set
 * while a request announced by push_prompt_done has not been finished (its
 * early WRITE may read its blocks: vLLM must not preempt it); bit 2 when the
 * call handed announcements too old to trust to the workers as preemptions
 * (the next step's metadata needs gonixl_worker_handle_preemptions). */
gonixl_status_t gonixl_scheduler_pending_block_frees(gonixl_scheduler_t h, int32_t *out,
                                                     gonixl_error_t *err);

/* kv_digests (a bidirectional decode, kv_digest_readback): the workers'
 * digests of blocks held for a read-back, a JSON object by request id of
 * gonixl_kv_digest values (null: not digested). The side channel serves them
 * to the reader (docs/PROTOCOL.md). */
gonixl_status_t gonixl_scheduler_kv_digests(gonixl_scheduler_t h, char *digests_json,
                                            size_t json_len, gonixl_error_t *err);

/* set_xfer_handshake_metadata: serves one worker's encoded handshake payload
 * for (pp_rank, tp_rank); starts the side-channel listener on first use. */
gonixl_status_t gonixl_scheduler_set_handshake_payload(gonixl_scheduler_t h, int32_t pp_rank,
                                                       int32_t tp_rank, char *payload,
                                                       size_t payload_len, gonixl_error_t *err);

/* Stops the scheduler (listener, timers) and frees the handle. A second close
 * of the same handle returns GONIXL_ERR_INVALID_HANDLE. */
gonixl_status_t gonixl_scheduler_close(gonixl_scheduler_t h, gonixl_error_t *err);

/* Live state as a JSON object: awaiting_kv, send_pending, heartbeat_leases
 * (all 0 at rest) and the counters side_channel_served, side_channel_refused.
 * Size-negotiated. */
gonixl_status_t gonixl_scheduler_live(gonixl_scheduler_t h, char *buf, size_t *len,
                                      gonixl_error_t *err);

/* ---------------------------------------------------------------------
 * Worker side (one per TP/PP rank).
 * --------------------------------------------------------------------- */

/* Creates the worker-side state from a JSON configuration. */
gonixl_status_t gonixl_worker_new(char *config_json, size_t config_len,
                                  gonixl_worker_t *out, gonixl_error_t *err);

/* register_kv_caches: the tensors' geometry as JSON (layers with data_ptr,
 * storage_ptr, storage_bytes, elem_size, shape, stride, device; num_blocks,
 * block_size, attn_backend, kv_cache_layout). Creates the transfer agent and
 * registers the memory. */
gonixl_status_t gonixl_worker_register_kv_caches(gonixl_worker_t h, char *init_json,
                                                 size_t init_len, gonixl_error_t *err);

/* The encoded handshake payload this rank serves. Size-negotiated. */
gonixl_status_t gonixl_worker_handshake_payload(gonixl_worker_t h, char *buf, size_t *len,
                                                gonixl_error_t *err);

/* handle_preemptions (vLLM's handle_preemptions, called before the step's
 * forward): a step's metadata from gonixl_scheduler_build_meta that names
 * preempted announced requests (the scheduler's push_preempted, or bit 2 of
 * pending_block_frees). A WRITE of their blocks not posted is dropped, one in
 * flight is waited for (bounded by transfer_timeout): the forward may give the
 * blocks another request's KV. */
gonixl_status_t gonixl_worker_handle_preemptions(gonixl_worker_t h, char *meta, size_t meta_len,
                                                 gonixl_error_t *err);

/* start_load_kv: one step's metadata from gonixl_scheduler_build_meta. Posts
 * READs and heartbeats; never blocks on the network. */
gonixl_status_t gonixl_worker_start_load_kv(gonixl_worker_t h, char *meta, size_t meta_len,
                                            gonixl_error_t *err);

/* get_finished: what finished since the last call, in a binary form
 * (little-endian; shim/kvwire/finished.go, docs/PROTOCOL.md):
 *   uint32 version (GONIXL_FINISHED_VERSION), uint32 flags
 *   (GONIXL_FINISHED_LOAD_ERRORS_PENDING, GONIXL_FINISHED_STATS_PENDING,
 *   GONIXL_FINISHED_PUSH_ARRIVALS_PENDING, GONIXL_FINISHED_DIGESTS_PENDING),
 *   uint32 counts of finished_sending, finished_recving, failed_recving and
 *   reshaped requests; then each request id of the three lists as uint32
 *   length + bytes; then per reshaped request: uint32 id length, id bytes,
 *   uint32 groups, per group uint32 ratio, uint32 covered, uint32 blocks,
 *   blocks x int64. 24 bytes when nothing finished. Size-negotiated; a
 *   result that did not fit is kept for the retry. */
gonixl_status_t gonixl_worker_get_finished(gonixl_worker_t h, char *buf, size_t *len,
                                           gonixl_error_t *err);

#define GONIXL_FINISHED_VERSION 1
#define GONIXL_FINISHED_LOAD_ERRORS_PENDING 1
#define GONIXL_FINISHED_STATS_PENDING 2
#define GONIXL_FINISHED_PUSH_ARRIVALS_PENDING 4
#define GONIXL_FINISHED_DIGESTS_PENDING 8

/* A worker's idle state, in memory the library writes (atomically) and the
 * caller reads without a call: busy is nonzero while the next engine step
 * must call get_finished (something is in flight or held); seq is bumped
 * whenever something changed off the caller's thread (a handshake finished,
 * an idle remote engine is due for eviction). A caller may skip
 * get_finished in a step whose start_load_kv had no metadata while busy is
 * 0 and seq has not moved since its last get_finished. */
typedef struct gonixl_worker_state {
    volatile uint64_t seq;
    volatile uint32_t busy;
    uint32_t reserved;
} gonixl_worker_state_t;

/* worker_state: *out points at the worker's state (above); the memory stays
 * valid for the life of the process, also after gonixl_worker_close (busy is
 * then 0). The first call starts the publishing. */
gonixl_status_t gonixl_worker_state(gonixl_worker_t h, gonixl_worker_state_t **out,
                                    gonixl_error_t *err);

/* get_block_ids_with_load_errors: JSON array of local block ids, cleared by
 * the call. Size-negotiated like get_finished. */
gonixl_status_t gonixl_worker_load_errors(gonixl_worker_t h, char *buf, size_t *len,
                                          gonixl_error_t *err);

/* push_arrivals (push mode, a prefill): JSON array of the base request ids
 * (vLLM's get_base_request_id) of the decode registrations that arrived
 * since the last call, each once; get_finished's flag
 * GONIXL_FINISHED_PUSH_ARRIVALS_PENDING says when there are any.
 * Size-negotiated. */
gonixl_status_t gonixl_worker_push_arrivals(gonixl_worker_t h, char *buf, size_t *len,
                                            gonixl_error_t *err);

/* kv_digest (a prefill, after the forward of a step that completed prompts):
 * reqs_json is a JSON array of {"id", "tokens", "blocks": [[ids] per
 * transfer group]}; the answer is a JSON object, by request id, of
 * {"blocks": [[digest per block] per group], "regions": [[sum per region]
 * per group]} (digests as JSON integers, 0 = not digested), or {} when this
 * engine's KV cannot be digested. Size-negotiated: a call with a buffer too
 * small parks the answer for the next call with the same handle. */
gonixl_status_t gonixl_worker_kv_digest(gonixl_worker_t h, char *reqs_json, size_t reqs_len,
                                        char *buf, size_t *len, gonixl_error_t *err);

/* kv_digest_held (a bidirectional decode, after the forward of the step
 * whose metadata listed read-back holds): reqs_json as for kv_digest; the
 * blocks are hashed on a goroutine and the call returns at once. Each
 * hold's finished_sending waits for its hashing; get_finished's flag
 * GONIXL_FINISHED_DIGESTS_PENDING says when digests are ready. */
gonixl_status_t gonixl_worker_kv_digest_held(gonixl_worker_t h, char *reqs_json, size_t reqs_len,
                                             gonixl_error_t *err);

/* kv_digests_ready: the digests kv_digest_held finished since the last
 * call, in kv_digest's answer form ({} when none). Size-negotiated. */
gonixl_status_t gonixl_worker_kv_digests_ready(gonixl_worker_t h, char *buf, size_t *len,
                                               gonixl_error_t *err);

/* get_kv_connector_stats: JSON object of vLLM's stats lists accumulated since
 * the last call, or length 0 when there is nothing. Size-negotiated. */
gonixl_status_t gonixl_worker_stats(gonixl_worker_t h, char *buf, size_t *len,
                                    gonixl_error_t *err);

/* gonixl's own Prometheus registry in the text exposition format. */
gonixl_status_t gonixl_worker_metrics(gonixl_worker_t h, char *buf, size_t *len,
                                      gonixl_error_t *err);

/* Live state as a JSON object: transfer_handles, stuck_handles,
 * receiving_requests, held_leases, pending_handshakes, remote_engines, and
 * the counters panics and handshakes_refused. At rest every count but
 * remote_engines (a cache) is 0; a soak checks them for leaks. Also gauges
 * in gonixl's Prometheus registry (GONIXL_METRICS_PORT). Size-negotiated. */
gonixl_status_t gonixl_worker_live(gonixl_worker_t h, char *buf, size_t *len,
                                   gonixl_error_t *err);

/* Stops the worker (in-flight transfers, agent) and frees the handle. */
gonixl_status_t gonixl_worker_close(gonixl_worker_t h, gonixl_error_t *err);

/* The library's live objects, as JSON {"schedulers":n,"workers":n,
 * "pending_results":n}: open handles of each kind and results parked after a
 * GONIXL_ERR_BUFFER_TOO_SMALL and not yet collected. Test suites end by
 * asserting all are 0. Size-negotiated. */
gonixl_status_t gonixl_live_objects(char *buf, size_t *len, gonixl_error_t *err);

/* Test hook: panics inside the library when the process was started with
 * GONIXL_TEST_HOOKS=1, to exercise the panic guard; otherwise returns
 * GONIXL_ERR_NOT_SUPPORTED and does nothing. */
gonixl_status_t gonixl_debug_panic(gonixl_error_t *err);

#ifdef __cplusplus
}
#endif

#endif /* GONIXL_H */
