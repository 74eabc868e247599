package shim

import (
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
)

// Diagnostics of the calls vLLM makes on its model thread. They change no
// behaviour; they put in the log on which side a slow request spent its
// time: waiting for the worker's lock (gonixl), holding it (gonixl), or
// between two engine steps (vLLM's engine thread busy or descheduled: a
// READ's transfer_timeout and a lease are checked when vLLM polls, once per
// engine step).
// pollGapWarn: vLLM not polling the connector for this long while READs
// are in flight is logged.
const pollGapWarn = 2 * time.Second

// SlowCallWarn is how long a call into the library, a wait for the
// worker's lock (logged with the holder's name) or a hold of it (vLLM's
// model thread may have waited) may take before it is logged:
// GONIXL_SLOW_CALL_MS
// (milliseconds, default 500). Lowered, it names what a slow engine step
// waited for (docs/BENCHMARKS.md, run 11: calls blocked 43-162 ms). Read at first
// use, after the library took its environment (capi/env.go).
func SlowCallWarn() time.Duration {
	slowOnce.Do(func() {
		v := os.Getenv("GONIXL_SLOW_CALL_MS")
		slowWarn, slowStacks = slowCallMS(v), strings.TrimSpace(v) != ""
	})
	return slowWarn
}

// slowStacksOn: GONIXL_SLOW_CALL_MS was set (a diagnostic run): a hold of
// the worker's lock still running at SlowCallWarn also logs every
// goroutine's stack, which names what the holder waits for (a mutex of
// the engine, a channel, a system call) while it waits.
func slowStacksOn() bool {
	SlowCallWarn()
	return slowStacks
}

// maxStackDump bounds one logged dump of goroutine stacks.
const maxStackDump = 256 << 10

// slowCallMS reads GONIXL_SLOW_CALL_MS: a positive number of milliseconds
// below a million seconds; anything else is the default, 500.
func slowCallMS(v string) time.Duration {
	if ms, err := strconv.ParseFloat(strings.TrimSpace(v), 64); err == nil && ms > 0 && ms < 1e9 {
		return time.Duration(ms * float64(time.Millisecond))
	}
	return 500 * time.Millisecond
}

var (
	slowOnce   sync.Once
	slowWarn   time.Duration
	slowStacks bool
)

// LogSlowCall logs a call into the library (capi's name for it) that ran
// Go code for at least SlowCallWarn.
func LogSlowCall(call string, took time.Duration) {
	Logger().Warn("slow call into the library", zap.String("call", call), zap.Duration("took", took))
}

// lockTimed takes the worker's lock for the section named what and
// returns its unlock, which logs a long hold. A long wait is logged too,
// naming the section that held the lock last.
func (w *Worker) lockTimed(what string) (unlock func()) {
	t0 := time.Now()
	w.mu.Lock()
	got := time.Now()
	if wait := got.Sub(t0); wait >= SlowCallWarn() {
		w.log.Warn("waited for the worker's lock", zap.String("call", what), zap.Duration("waited", wait),
			zap.String("held_by", w.lockHolder))
	}
	w.lockHolder = what
	var dump *time.Timer
	if slowStacksOn() {
		dump = time.AfterFunc(SlowCallWarn(), func() {
			defer func() { _ = recover() }() // a diagnostic never takes the process down
			buf := make([]byte, maxStackDump)
			buf = buf[:runtime.Stack(buf, true)]
			w.log.Warn("the worker's lock is still held; goroutines now", zap.String("call", what),
				zap.Duration("held", time.Since(got)), zap.ByteString("stacks", buf))
		})
	}
	return func() {
		if dump != nil {
			dump.Stop()
		}
		held := time.Since(got)
		w.mu.Unlock()
		if held >= SlowCallWarn() {
			w.log.Warn("held the worker's lock", zap.String("call", what), zap.Duration("held", held))
		}
	}
}

// notePollLocked records a get_finished call and logs a long gap since the
// previous one while READs were in flight. Only READs posted before that
// gap count: an engine idle for a while, then handed a request whose READ
// its step posted just before this poll, did not keep a READ waiting.
func (w *Worker) notePollLocked() {
	now := time.Now()
	last := w.lastPoll
	w.lastPoll = now
	gap := now.Sub(last)
	if last.IsZero() || gap < pollGapWarn {
		return
	}
	postedBy := w.clock() - gap.Seconds()
	inFlight := 0
	for _, st := range w.recv {
		for _, f := range st.xfers {
			if f.posted <= postedBy {
				inFlight++
			}
		}
	}
	if inFlight == 0 {
		return
	}
	w.log.Warn("vLLM did not poll the connector (get_finished runs once per engine step) while READs were in flight",
		zap.Duration("gap", gap), zap.Int("reads_in_flight", inFlight))
}
