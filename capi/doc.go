// Command capi is libgonixl.so: the C ABI declared in include/gonixl.h,
// built with `go build -buildmode=c-shared`.
//
// It is the only package with //export functions. Its job is the boundary
// and nothing else: typed handle tables (every object is an opaque uint64,
// 0 invalid, wrong-kind and stale handles are errors), status codes and the
// per-call error struct, the panic guard that poisons the library after a
// recovered panic, size negotiation for variable-length outputs, and copies
// between C and Go memory. Behaviour lives in shim. capi blank-imports the
// transfer engines so they register themselves; nothing imports capi.
//
// Imports: shim, shim/kvwire, nixl and its engine subpackages (blank),
// the standard library. cgo and unsafe are allowed here.
//
// Concurrency: every export may be called from any C thread concurrently.
// The handle tables are guarded by a mutex; objects behind handles are
// themselves safe for concurrent use. No export blocks on the network.
// Go never holds a pointer into caller memory after an export returns,
// except KV-cache regions the caller registers explicitly.
package main
