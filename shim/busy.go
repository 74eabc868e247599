// Polls and posts from vLLM's model thread are put off while the engine's
// agent runs a long control call: the NIXL engine serialises every call on
// one lock, and a handshake goroutine's metadata load or descriptor-list
// preparation for a new peer held it for 4.8 s while get_finished waited
// behind it (bench/timed_connector.py on a loaded 2-vCPU host). The model
// thread must not wait on another engine's first contact.

package shim

import (
	"go.uber.org/zap"

	"github.com/gonixl/gonixl/nixl"
)

// busyLogAfter is how long the agent may stay busy before the worker says
// that it is putting its polls off (once per busy period).
const busyLogAfter = 1.0 // seconds

// engineBusyLocked reports whether the agent is in a long control call
// (nixl.ControlBusy); engines without the capability never are. It also
// tracks the busy period for the log.
func (w *Worker) engineBusyLocked() bool {
	cb, ok := w.agent.(nixl.ControlBusy)
	if !ok || !cb.ControlBusy() {
		if w.busySince != 0 && w.busyLogged {
			w.log.Info("agent free again; polls resumed", zap.Float64("busy_seconds", w.clock()-w.busySince), zap.Int64("polls_put_off", w.busySkips))
		}
		w.busySince, w.busyLogged, w.busySkips = 0, false, 0
		return false
	}
	now := w.clock()
	if w.busySince == 0 {
		w.busySince = now
	}
	w.busySkips++
	if !w.busyLogged && now-w.busySince >= busyLogAfter {
		w.busyLogged = true
		w.log.Info("the agent is busy with a control call (a peer's metadata or descriptor list); transfer polls and posts are put off until it ends",
			zap.Float64("busy_seconds", now-w.busySince), zap.Int("reads_put_off", len(w.deferred)))
	}
	return true
}

// deferReadLocked puts st's READ off until the agent is free: st counts as
// loading (waiting) meanwhile, as a request behind a handshake does.
func (w *Worker) deferReadLocked(st *recvState) {
	st.waiting = true
	w.deferred = append(w.deferred, st.id)
}

// postDeferredLocked posts the READs put off while the agent was busy, in
// the order they came. The caller has checked that it is free.
func (w *Worker) postDeferredLocked() {
	if len(w.deferred) == 0 {
		return
	}
	ids := w.deferred
	w.deferred = nil
	for _, id := range ids {
		if st, ok := w.recv[id]; ok && st.waiting {
			w.readLocked(st)
		}
	}
}
