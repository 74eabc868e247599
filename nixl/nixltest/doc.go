// Package nixltest is a scriptable, in-process fake transfer engine,
// registered as "fake", for unit tests of the layers above nixl (shim,
// capi). It is for tests only: every behaviour that matters is also tested
// against real NIXL (nixl/libnixl) and UCX (nixl/ucx).
//
// What it does:
//   - Agents of one Engine find each other through the engine: metadata is
//     a small self-describing blob, and loading it connects to the live
//     agent of that name in this process ("in-process remote agents").
//   - Transfers really copy bytes between the registered addresses (so
//     tests can check data), after a scripted number of in-progress polls,
//     then deliver the notification to the target agent's inbox.
//   - Faults: any step can fail with a chosen nixl.Status (every time, or
//     on its Nth occurrence); Kill makes an agent look like a dead peer
//     (transfers to it end in ERR_REMOTE_DISCONNECT).
//   - Every API call is recorded (Agent.Calls) for assertions.
//   - Observation (observe.go): every data movement is reported before
//     the bytes move (Engine.SetMoveHook), live transfers are listed
//     (Engine.Transfers), notifications can be held back and delivered
//     later or twice (Engine.SetNotifHook, Agent.Inject), a transfer in
//     flight can be finished by the engine's own progress, unpolled
//     (Engine.Settle), a release refused while operations are in flight
//     as the ucx engine does (Script.RefuseReleaseInFlight; with
//     Script.InFlightSurvivesInvalidate even past InvalidateRemote), and
//     the next occurrence of a step failed (Agent.FailNext).
//   - Posting: Script.PostCopies makes an agent say that Post copies on
//     the caller's thread (nixl.PostCopies, the NIXL engine's DRAM
//     transfers), and Script.PostHook runs at the start of every Post
//     without the engine's lock, to make a post slow or hold it.
//   - Validation follows NIXL: descriptors must lie in registered regions
//     (ERR_NOT_FOUND), index arrays must be non-empty, of equal length, in
//     range and pair equal lengths (ERR_INVALID_PARAM), re-posting an
//     active request is ERR_REPOST_ACTIVE; a released or unknown handle is
//     ERR_INVALID_PARAM, never a crash.
//
// Imports: nixl and the standard library. unsafe is used in one place
// (copy.go) to move bytes between caller-provided addresses, as a real
// backend does; this package is a backend subpackage, where the
// architecture allows it.
//
// Concurrency: an Engine and its agents share one mutex; every method is
// safe for concurrent use. Scripts may be changed while agents run.
package nixltest
