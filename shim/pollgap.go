package shim

import (
	"time"

	"go.uber.org/zap"
)

// Diagnostics of the calls vLLM makes on its model thread. They change no
// behaviour; they put in the log on which side a slow request spent its
// time: waiting for the worker's lock (gonixl), holding it (gonixl), or
// between two engine steps (vLLM's engine thread busy or descheduled: a
// READ's transfer_timeout and a lease are checked when vLLM polls, once per
// engine step).
const (
	// lockWaitWarn: a call from the model thread that waited this long
	// for the worker's lock is logged with the holder's name.
	lockWaitWarn = 500 * time.Millisecond
	// lockHoldWarn: a section that held the worker's lock this long is
	// logged (vLLM's model thread may have been waiting for it).
	lockHoldWarn = 500 * time.Millisecond
	// pollGapWarn: vLLM not polling the connector for this long while
	// READs are in flight is logged.
	pollGapWarn = 2 * time.Second
)

// lockTimed takes the worker's lock for the section named what and
// returns its unlock, which logs a long hold. A long wait is logged too,
// naming the section that held the lock last.
func (w *Worker) lockTimed(what string) (unlock func()) {
	t0 := time.Now()
	w.mu.Lock()
	got := time.Now()
	if wait := got.Sub(t0); wait >= lockWaitWarn {
		w.log.Warn("waited for the worker's lock", zap.String("call", what), zap.Duration("waited", wait),
			zap.String("held_by", w.lockHolder))
	}
	w.lockHolder = what
	return func() {
		held := time.Since(got)
		w.mu.Unlock()
		if held >= lockHoldWarn {
			w.log.Warn("held the worker's lock", zap.String("call", what), zap.Duration("held", held))
		}
	}
}

// notePollLocked records a get_finished call and logs a long gap since the
// previous one while READs were in flight.
func (w *Worker) notePollLocked() {
	now := time.Now()
	last := w.lastPoll
	w.lastPoll = now
	if last.IsZero() || now.Sub(last) < pollGapWarn {
		return
	}
	inFlight := 0
	for _, st := range w.recv {
		inFlight += len(st.xfers)
	}
	if inFlight == 0 {
		return
	}
	w.log.Warn("vLLM did not poll the connector (get_finished runs once per engine step) while READs were in flight",
		zap.Duration("gap", now.Sub(last)), zap.Int("reads_in_flight", inFlight))
}
