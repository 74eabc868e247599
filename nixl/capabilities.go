package nixl

// Optional capabilities. An agent implements these when it can; callers
// test for them with a type assertion, and each engine pins the ones it
// provides with a compile-time assertion (var _ nixl.Describer = ...), so a
// renamed method fails the build instead of silently dropping the feature.

// Describer is an agent that describes itself for the logs: library,
// version and settings in effect (the ucx engine: error-handling mode,
// data path, progress thread).
type Describer interface {
	Info() string
}

// EndpointDescriber is an agent that can show the transport of its first
// connection to a peer (UCX's lanes), logged once so that a deployment's
// transport choice is visible.
type EndpointDescriber interface {
	EndpointInfo() string
}

// ControlBusy is an agent whose calls wait for one another (one lock
// around a native agent that is not thread-safe: the NIXL engine).
// ControlBusy reports whether a call that can take long is running or
// waiting to run: loading a peer's metadata, preparing or releasing a
// descriptor list, registering memory. NIXL's metadata load of a new peer
// took 4.8 s on a loaded host, and a poll from vLLM's model thread waited
// behind it; a caller on that thread puts its own calls off while the
// agent is busy instead.
type ControlBusy interface {
	ControlBusy() bool
}

// TryChecker is a transfer whose Check can decline to wait: TryCheck is
// Check when the engine's lock is free at once, and (InProgress, nil,
// false), checking nothing, while another thread holds it (the ucx
// engine's progress thread mid-sweep, a post). A poll from vLLM's model
// thread uses it: behind a progress sweep of a descheduled thread it waited
// 178 ms (GONIXL_SLOW_CALL_MS=15, docs/BENCHMARKS.md run 12), and the
// transfer is checked again at the next poll.
type TryChecker interface {
	TryCheck() (Status, error, bool)
}

// TryNotifier is an agent whose GetNotifs can decline to wait, as
// TryChecker's TryCheck does: (nil, nil, false), taking nothing, while
// another thread holds the engine's lock.
type TryNotifier interface {
	TryGetNotifs() ([]Notif, error, bool)
}

// PostCopies is an agent whose Xfer.Post may move a transfer's bytes on
// the caller's thread before it returns, and whose calls wait for one
// another (ControlBusy's one lock). PostCopies reports whether it does so
// for this agent's registered memory. Measured with cmd/gonixl-bench
// transfer (two processes on one host, progress threads on): the NIXL
// engine's Post takes the whole transfer — 1.97 ms of a 1.97 ms READ of
// 14 MiB (224 × 64 KiB), 4.3 ms of a 4.3 ms WRITE: NIXL's UCX backend
// copies a same-host DRAM transfer (CMA) before Post returns. The ucx
// engine's takes 4–16 µs with data paths cma and shm (the copy runs on a
// goroutine of the engine's own) and 10–46 µs for a READ with data path
// ucp. A caller on a thread that must not wait (vLLM's model thread) posts
// for such an agent from a goroutine, and puts its other calls on the
// agent off while that post runs: they would wait behind it.
type PostCopies interface {
	PostCopies() bool
}

// Lander is a transfer that says when its bytes are in place, before a
// poll sees it complete: the channel Landed returns after a Post is
// closed once every byte of that post has moved (a READ's data is in
// local memory, a WRITE's in the peer's), at the latest by the Check that
// first reports Success (a caller may wait on it instead of polling), and
// never for a post whose bytes did not all move: one that fails before
// or during the data, is cancelled or is released first. A post whose
// bytes moved and whose completion notification then failed has landed
// and still reports its failure. A caller waits on it to
// start work on the data on a goroutine of its own (the shim's KV digest
// check of a READ) instead of at the next poll. Call Landed after Post:
// a transfer posted again gets a new channel. The ucx engine closes it
// when its own copy (data paths cma and shm, CUDA IPC) has finished;
// bytes UCP moves are known to have landed only by Check, which closes it
// then.
type Lander interface {
	Landed() <-chan struct{}
}

// NotifDropCounter is an agent that counts received notifications it had
// to drop (malformed or over its size limit).
type NotifDropCounter interface {
	DroppedNotifs() uint64
}

// CheckIndexArrays is MakeXfer's rule for its index arrays, the same in
// every engine: non-empty and of equal length.
func CheckIndexArrays(localIdx, remoteIdx []int32) error {
	if len(localIdx) == 0 || len(localIdx) != len(remoteIdx) {
		return Errorf(ErrInvalidParam, "MakeXfer", "index arrays must be non-empty and of equal length (%d, %d)", len(localIdx), len(remoteIdx))
	}
	return nil
}

// CheckPairRange is MakeXfer's rule for pair i: both indices inside their
// lists (of nLocal and nRemote descriptors). Engines call it before they
// look at the descriptors.
func CheckPairRange(i int, li, ri int32, nLocal, nRemote int) error {
	if li < 0 || int(li) >= nLocal || ri < 0 || int(ri) >= nRemote {
		return Errorf(ErrInvalidParam, "MakeXfer", "index pair %d (%d, %d) out of range (%d, %d)", i, li, ri, nLocal, nRemote)
	}
	return nil
}

// CheckPairLengths is MakeXfer's rule that pair i moves equal lengths.
func CheckPairLengths(i int, localLen, remoteLen uint64) error {
	if localLen != remoteLen {
		return Errorf(ErrInvalidParam, "MakeXfer", "pair %d: lengths %d local and %d remote differ", i, localLen, remoteLen)
	}
	return nil
}
