// Package kvwire is gonixl's wire formats and nothing else: every message
// and parameter its engines exchange with vLLM, with each other and with
// stock vLLM peers, encoded and decoded with bounds, without a Worker, a
// lock or a goroutine.
//
//   - kv_transfer_params (vLLM's keys and gonixl's, keys.go, params.go);
//   - the per-step metadata a scheduler hands its workers (stepmeta.go);
//   - the notifications between workers: pull's done and heartbeat
//     notifications (notif.go), push mode's registration and gonixl's words
//     (push.go);
//   - the bounded MessagePack pre-check every peer-supplied msgpack passes
//     before a decoder sees it (mpcheck.go).
//
// docs/PROTOCOL.md is the specification of what gonixl adds to vLLM's
// protocol and its version history. Every decoder of peer or client input
// has a fuzz target here with a committed corpus.
//
// Imports: the standard library and msgpack/v5; nothing of the module
// (tests/layering_test.go). Safe for concurrent use: no package state but
// a scratch-buffer pool.
package kvwire
