// Package shim is the connector logic behind libgonixl.so: the
// scheduler-side request state machine (matched tokens, allocation,
// per-step metadata, request_finished parameters, leases) and the
// worker-side transfer state (KV region registration, handshakes, READ
// posting and polling, notifications, stats). The Python connector only
// flattens vLLM objects; every decision is made here.
//
// The wire formats (kv_transfer_params, step metadata, notifications, push
// registrations) are shim/kvwire's; shim names its types (wire.go).
//
// Imports: the standard library, shim/kvwire, nixl (the engine-neutral
// interface, never a concrete engine), sidechannel, zap and client_golang
// (+ prometheus/common for the text format). No cgo, no unsafe.
//
// Concurrency: Scheduler and Worker are safe for concurrent use; their
// public methods take the object's lock, and background goroutines
// (handshakes, progress, lease sweeps, the poster of an engine whose Post
// copies: post.go) communicate through channels or take the lock to record
// their results. No method blocks on the network: waits happen on
// goroutines and results are collected by polling calls, so vLLM's model
// thread is never held up.
// Time comes from an injected Clock so leases are unit-tested without sleeps.
package shim
