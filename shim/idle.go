// Idle steps: whether the worker must be polled this engine step.
//
// vLLM calls get_finished after every forward. A worker with nothing in
// flight — no READ, no WRITE, no push wait, no lease a reader's notification
// may end, no results to report — has nothing for that call to find, and
// the call costs tens of microseconds inside vLLM's process (a wake-up of
// the Go runtime, cold caches). So the worker publishes, to a Publisher
// (capi puts it in memory the Python connector reads without a call):
//
//   - busy: the next step must poll (something is in flight or held);
//   - a change counter, bumped when something changed off vLLM's thread
//     while idle: a handshake finished (its requests' READs or failures
//     are to be reported), an idle remote engine is due for eviction.
//
// The Python connector skips get_finished while the worker is not busy,
// the counter did not move and the step's start_load_kv carried no
// metadata (which always polls: it may have started work). Nothing that
// needs a deadline is lost: every timer of a busy worker is checked on its
// polls, and an idle worker's only timer (engine_ttl) bumps the counter.
//
// A push-mode prefill is always busy: a registration or a decode's cancel
// can arrive at any time, and the NIXL engine says so only when polled.
//
// Idle polls: vLLM steps no engine without requests, and a busy worker
// whose engine does not step would neither time anything out nor answer a
// peer (a push decode's cancel, waiting for this prefill's word to give its
// blocks back). So a worker whose get_finished has not run for
// idlePollAfter polls by itself, every idlePollAfter, from a goroutine
// (IdlePoll): transfers, notifications, leases and push timers — not the
// step-bound parts (an announced push is WRITTEN only from vLLM's
// get_finished, after the forward). What it finds is reported at vLLM's
// next get_finished; the change counter asks for that call.

package shim

import (
	"time"

	"go.uber.org/zap"
)

// Publisher receives a worker's idle state.
type Publisher interface {
	// Publish sets whether the worker must be polled every step, and
	// bumps the change counter when changed is true.
	Publish(busy, changed bool)
}

// SetPublisher makes the worker publish its idle state to p (nil: stop).
func (w *Worker) SetPublisher(p Publisher) {
	defer w.lockTimed("set publisher")()
	w.pub = p
	w.publishLocked(true)
}

// busyLocked reports whether the next engine step must poll.
func (w *Worker) busyLocked() bool {
	return len(w.recv) > 0 || w.held.Len() > 0 || len(w.toProcess) > 0 || len(w.deferred) > 0 ||
		len(w.push.deferred) > 0 || len(w.postQueue) > 0 || w.postsRunning.Load() > 0 ||
		len(w.push.sends) > 0 || len(w.push.computing) > 0 || len(w.push.earlyDone) > 0 ||
		(w.cfg.TransferMode == "push" && w.cfg.KVRole != "kv_consumer") ||
		len(w.done.Sending)+len(w.done.Recving)+len(w.done.Failed) > 0 || w.notifsFailed || w.notifsSkipped
}

// publishLocked publishes the worker's state; changed bumps the counter.
// While idle with remote engines, it arms a timer for the next engine_ttl
// eviction.
func (w *Worker) publishLocked(changed bool) {
	if w.pub == nil {
		return
	}
	busy := !w.closed && w.busyLocked()
	w.pub.Publish(busy, changed)
	if busy || w.closed || w.cfg.EngineTTL <= 0 || len(w.remotes) == 0 {
		return
	}
	next := -1.0
	for _, re := range w.remotes {
		if due := re.lastUsed + w.cfg.EngineTTL; next < 0 || due < next {
			next = due
		}
	}
	if w.evictTimer != nil && w.evictAt <= next {
		return // armed already, for that time or earlier
	}
	if w.evictTimer != nil {
		w.evictTimer.Stop()
	}
	w.evictAt = next
	wait := time.Duration((next - w.clock() + 0.001) * float64(time.Second))
	w.evictTimer = time.AfterFunc(max(wait, 0), func() {
		defer func() {
			if p := recover(); p != nil {
				w.log.Error("recovered a panic in the eviction timer", zap.Any("panic", p), zap.Stack("stack"))
				w.panics.Add(1)
			}
		}()
		defer w.lockTimed("eviction timer")()
		w.evictTimer = nil
		if w.pub != nil && !w.closed {
			w.pub.Publish(w.busyLocked(), true)
		}
	})
}

// idlePollAfter: how long without vLLM's get_finished before a worker polls
// by itself, and the period of those polls. Tests that drive polls
// themselves set it to 0 (no goroutine).
var idlePollAfter = time.Second

// startIdlePoller runs IdlePoll every idlePollAfter until the worker closes.
func (w *Worker) startIdlePoller() {
	// This worker's period, read once: tests change the global between
	// workers, and this worker's goroutine must not read it then.
	every := idlePollAfter
	w.idleEvery = every
	if every <= 0 {
		return
	}
	go func() {
		t := time.NewTicker(every)
		defer t.Stop()
		for range t.C {
			if !w.idlePollSafe() {
				return
			}
		}
	}()
}

// IdlePoll polls a busy worker that vLLM has not polled for idlePollAfter
// (see above); false once the worker is closed.
func (w *Worker) IdlePoll() bool {
	defer w.lockTimed("idle poll")()
	if w.closed {
		return false
	}
	if w.agent == nil || !w.busyLocked() || w.agentBusyLocked() || time.Since(w.lastPoll) < w.idleEvery {
		return true
	}
	before := len(w.done.Sending) + len(w.done.Recving) + len(w.done.Failed)
	w.pollLocked()
	w.publishLocked(len(w.done.Sending)+len(w.done.Recving)+len(w.done.Failed) != before)
	return true
}

// idlePollSafe is IdlePoll with its panics recovered (logged, counted):
// the poller keeps running.
func (w *Worker) idlePollSafe() (alive bool) {
	defer func() {
		if p := recover(); p != nil {
			w.log.Error("recovered a panic in the idle poller", zap.Any("panic", p), zap.Stack("stack"))
			w.panics.Add(1)
			alive = true
		}
	}()
	return w.IdlePoll()
}
