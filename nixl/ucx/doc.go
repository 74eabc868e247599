// Package ucx is gonixl's "ucx" transfer engine: a direct binding of UCX's
// UCP API that implements nixl.Engine and nixl.Agent without NIXL. It is the
// transfer path on hosts where NIXL cannot load (NIXL's wheels bring a UCX
// that needs CUDA) and the place to tune transfer performance.
//
// # Loading
//
// libucp is opened with dlopen on first use (Engine.Available), never
// linked, so libgonixl.so loads on hosts without UCX and reports why the
// engine is unavailable. Search order: $GONIXL_UCX_LIB alone when set; else
// libucx/lib/libucp.so.0 from a libucx-cu12/-cu13 wheel in a Python
// site-packages directory (native.SitePackages: $VIRTUAL_ENV's, those
// mapped into the process, .venv directories above the working directory);
// else the system's libucp.so.0 (Debian: libucx0). The UCX environment
// defaults (native.SetUCXDefaults) are set before the first dlopen. UCX 1.13 or newer is
// required. Building needs the UCX headers (Debian: libucx-dev); the C half
// (gxucx.c) calls UCP only through the resolved function pointers. Built
// with CGO_ENABLED=0 or the tag gonixl_noucx, the package registers a stub
// engine whose Available says so (stub.go).
//
// Before the first dlopen the engine sets UCX_HANDLE_ERRORS=none and an
// empty UCX_ERROR_SIGNALS where the user left them unset: UCX's default
// installs handlers for SIGSEGV, SIGBUS, SIGILL and SIGFPE that replace the
// Go runtime's, so any Go nil dereference in the process would abort with a
// UCX backtrace instead of panicking (and capi could not recover it).
//
// # Mapping onto UCP
//
//   - one ucp_context and one worker (features RMA and AM, plus WAKEUP when
//     AgentConfig.ProgressThread is set) per agent; the worker address
//     travels in the agent metadata;
//   - RegisterMem: ucp_mem_map and ucp_rkey_pack per region (DRAM only);
//   - LoadRemoteMetadata: one endpoint to the peer's worker, and
//     ucp_ep_rkey_unpack per advertised region;
//   - PrepDescList resolves every descriptor to the registered (local) or
//     advertised (remote) region that holds it, so an address outside the
//     peer's regions is refused before anything is posted;
//   - MakeXfer merges descriptor pairs that are adjacent in both local and
//     remote memory into one operation; Post issues every ucp_get_nbx
//     (READ) or ucp_put_nbx (WRITE) and an endpoint flush in one cgo call;
//   - the notification, an active message (id 0, eager) carrying
//     [u16 name length][sender name][message], is sent only once data and
//     flush are complete. Its request's completion status decides the
//     transfer's (Check reports a failed send); SendNotif sends the same
//     message without a transfer and returns only errors UCX reports at
//     once: a send UCX queues leaves with the next progress (progress
//     thread, Check or GetNotifs) and a later failure of it is not
//     reported.
//
// Metadata is this package's own versioned, checksummed format (see
// metadata.go); it is not NIXL's, so both sides must run this engine. It
// also carries the writer's boot id, pid namespace, pid and start time: for
// a peer on the same host the engine checks /proc while a transfer is in
// progress, so a dead peer fails its transfers with ERR_REMOTE_DISCONNECT
// even in error mode "none", where UCX itself never notices.
//
// # Data paths
//
// UCX 1.13 (Debian bookworm) serves ucp_get/ucp_put on memory it did not
// allocate with software emulation over active messages when the peer is
// reached through shared memory or tcp: the target's worker copies every
// fragment, so the target must progress (its progress thread spins for a
// short window after work for that reason). Newer UCX (1.16+, e.g. the
// libucx-cu12 wheel) reads with CMA zero-copy instead. data_path "cma"
// (the default) moves same-host data with process_vm_readv/writev
// directly, one syscall per 512 operations, on a goroutine of this process
// outside the agent mutex, and uses UCX only for the notification; Post
// returns InProgress at once.
//
// data_path "shm" (opt-in, both sides) goes further, to what ucx_perftest
// gets on memory UCX allocated itself: RegisterMem re-backs the
// page-aligned interior of each region with a sealed memfd at the same
// addresses and with the same bytes, a same-host peer maps it when it loads
// the metadata, and a READ or WRITE is a memcpy (CMA for the partial pages
// at the ends of a region), checked against the owner's revocation and
// exit before and after. Deregistration gives the caller private memory
// back with its contents. shm.go describes the mechanism and what a caller
// can observe while a region is shared.
//
// # Configuration
//
// BackendParams["UCX"] takes NIXL's UCX plugin keys: ucx_error_handling_mode
// (alias error_handling) "auto", "peer" or "none", engine_config
// "KEY=VAL,...", device_list, and this engine's data_path "cma" (default),
// "ucp" or "shm". The error mode falls back to $GONIXL_UCX_ERR_MODE, then "auto";
// the data path to $GONIXL_UCX_DATA_PATH, then "cma".
//
// On UCX 1.13, peer mode lets UCP use only transports that detect peer
// failure, which pushes same-host traffic onto TCP (about 1 GB/s here);
// none allows shared memory and CMA (6-9 GB/s) but UCX then never notices a
// dead peer. auto, the default, uses none for a peer on this host (same
// boot id and pid namespace in its metadata), whose death the engine
// detects through /proc, and peer for every other peer. NIXL's own default
// is peer; set it explicitly for NIXL's behaviour.
//
// UCX_* environment variables apply as usual (UCX_TLS, UCX_NET_DEVICES,
// ...). The agent's EndpointInfo method returns UCX's lane summary for the
// first endpoint and Info a one-line description; callers log both at info
// level (this package does not log).
//
// # Imports
//
// The standard library and package nixl. cgo and unsafe are confined to
// this package.
//
// # Concurrency
//
// An agent is safe for concurrent use: one mutex per agent serialises every
// call into UCX (the worker is created UCS_THREAD_MODE_SERIALIZED). Progress
// happens inside Check, GetNotifs and teardown, and, with
// AgentConfig.ProgressThread, on a dedicated locked OS thread that sleeps in
// poll(2) on the worker's event fd between rounds. No UCX callback calls into
// Go: the active-message handler copies into a C-side queue under a pthread
// mutex, and the endpoint error handler sets a flag; Go reads both later.
// GetNotifs both progresses and takes that queue: a caller that calls it
// only to progress a target must keep what it returns, or it discards the
// notifications another caller waits for (this package's tests did, and
// lost about one notification in 20 with data_path "cma").
//
// # Teardown
//
// Close cancels and frees transfer requests, then per peer flushes the
// endpoint (bounded), destroys its rkeys and closes it (forced when failed),
// then unmaps local registrations and destroys the worker and the context.
// Memory registered by the caller must stay valid until DeregisterMem or
// Close.
package ucx
