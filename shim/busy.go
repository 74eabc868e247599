// Polls and posts from vLLM's model thread are put off while the engine's
// agent runs a long control call: the NIXL engine serialises every call on
// one lock, and a handshake goroutine's metadata load or descriptor-list
// preparation for a new peer held it for 4.8 s while get_finished waited
// behind it (bench/timed_connector.py on a loaded 2-vCPU host). The model
// thread must not wait on another engine's first contact. A post from the
// worker's poster (post.go) holds that lock too: polls, READs, WRITEs and
// heartbeats are put off the same way while one runs (agentBusyLocked).

package shim

import (
	"go.uber.org/zap"

	"github.com/gonixl/gonixl/nixl"
)

// busyLogAfter is how long the agent may stay busy before the worker says
// that it is putting its polls off (once per busy period).
const busyLogAfter = 1.0 // seconds

// agentBusyLocked reports whether a call on the agent from this thread
// would wait: the poster is posting on it (post.go), or it is in a long
// control call (engineBusyLocked). A post takes milliseconds: it is not
// logged.
func (w *Worker) agentBusyLocked() bool {
	if w.postsRunning.Load() > 0 {
		return true
	}
	return w.engineBusyLocked()
}

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

// postDeferredLocked posts the READs and WRITEs put off while the agent
// was busy, in the order they came. The caller has checked that it is
// free.
func (w *Worker) postDeferredLocked() {
	if ids := w.deferred; len(ids) > 0 {
		w.deferred = nil
		for _, id := range ids {
			if st, ok := w.recv[id]; ok && st.waiting {
				w.readLocked(st)
			}
		}
	}
	if ids := w.push.deferred; len(ids) > 0 {
		w.push.deferred = nil
		for _, id := range ids {
			// Still matched and computed, not written: not preempted,
			// cancelled or abandoned meanwhile.
			if ps := w.push.sends[id]; ps != nil && ps.state == sendComputing && ps.computed && ps.reg != nil {
				w.writeKnownLocked(ps)
			}
		}
	}
}
