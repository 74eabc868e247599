// Package conformance is a reusable test harness that checks a nixl.Engine
// against the behaviour gonixl relies on, with real memory and, for the
// cases that need it, a second OS process.
//
// An engine's test package uses it like this:
//
//	func TestMain(m *testing.M) {
//		conformance.MaybePeer() // never returns when this process is a peer
//		conformance.Exit(m.Run()) // os.Exit, safe under -race with native threads
//	}
//
//	func TestConformance(t *testing.T) { conformance.Run(t, "ucx") }
//
// Run starts the test binary again as a peer process (MaybePeer turns it into
// the peer), then runs the cases as subtests:
//
//   - read: two agents in two processes, each with a KV-cache-shaped region
//     (layers × 2 (K,V) regions of blocks × blockSize bytes, mmap-allocated)
//     exchange metadata over a pipe; the parent READs scattered blocks from
//     the peer by descriptor index (desc = region*blocks + block, as vLLM
//     numbers them), verifies every byte of its whole region, and the peer
//     receives the transfer's notification; the same request is posted again.
//   - write: the same with WRITE; the peer verifies every byte of its region.
//   - notif: standalone notifications in both directions.
//   - peer-death: a second peer is killed (SIGKILL) while a READ is in
//     flight; an error status must appear within Config.DeathDeadline.
//   - the in-process cases below.
//
// RunInProcess runs the cases that need no second process (two agents in
// this process): read/write/notification between them, garbage metadata,
// descriptor indices out of range or mismatched (errors before anything is
// posted), and double release of transfers and descriptor lists.
//
// The shape defaults to 8 layers × 2 × 64 blocks × 16 KiB (16 MiB a side);
// GONIXL_CONFORMANCE_SHAPE="LxBxS" (layers x blocks x blockSize) or "big"
// (32 × 512 × 32 KiB, 1 GiB a side) overrides it.
//
// The harness never decides that an engine cannot run here: an engine whose
// Available() fails is skipped with that reason; anything else that fails
// is a test failure. Every wait has a deadline.
//
// API stability: Run, RunConfig, RunInProcess, MaybePeer, Exit, Config and Shape
// are used by every engine's tests; add fields and functions, do not change
// existing ones.
//
// Imports: the standard library, testing, and nixl. Pure Go: no cgo, no
// unsafe (addresses of mmap-ed memory are taken through reflect).
//
// Concurrency: each Run* call is self-contained; cases run sequentially.
// MaybePeer calls os.Exit in a peer process, which is its whole purpose; it
// is a test helper, never called by library code.
package conformance
