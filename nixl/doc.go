// Package nixl is gonixl's view of a NIXL transfer agent: one agent per
// worker, memory registration, metadata exchange, prepared descriptor lists,
// one-sided READ/WRITE with completion notifications, and per-transfer
// telemetry.
//
// The package is pure Go: no cgo, no unsafe. Concrete engines live in
// subpackages and register themselves by name from an init function:
//
//	nixl/libnixl  "nixl"  real NIXL through libnixl_capi.so (dlopen)
//	nixl/ucx      "ucx"   direct UCP binding (dlopen of libucp.so.0)
//	nixl/nixltest "fake"  scriptable in-process fake, for unit tests only
//
// Higher layers (shim) pick an engine with Select (or Lookup) and never
// import a concrete engine; capi blank-imports the real ones. Optional agent
// capabilities and the index rules every engine applies are in
// capabilities.go; docs/ARCHITECTURE.md has the map.
//
// Imports: the standard library only.
//
// Concurrency: an Agent is safe for concurrent use by several goroutines;
// each implementation serialises calls into its C library as that library
// requires. A DescList or Xfer must not be used after it is released, and a
// single Xfer must not be posted or checked by two goroutines at once.
package nixl
