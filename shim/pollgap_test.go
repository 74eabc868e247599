package shim

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

func diagWorker() (*Worker, *observer.ObservedLogs) {
	core, logs := observer.New(zapcore.InfoLevel)
	return &Worker{log: zap.New(core), recv: map[string]*recvState{}, clock: NewFakeClock(100).Now}, logs
}

// A gap between two get_finished calls longer than pollGapWarn is logged
// only while READs posted before it are in flight, with the gap and their
// count; a READ posted in the step that ends the gap is not counted.
func TestPollGapLoggedOnlyWithReadsInFlight(t *testing.T) {
	w, logs := diagWorker()
	w.lastPoll = time.Now().Add(-3 * time.Second)
	w.notePollLocked()
	if n := logs.FilterMessageSnippet("did not poll").Len(); n != 0 {
		t.Fatalf("gap without READs in flight logged %d times", n)
	}
	w.recv["r1"] = &recvState{id: "r1", xfers: []*inflight{{posted: 90}, {posted: 96}, {posted: 99.5}}}
	w.notePollLocked() // right after the previous call: no gap
	if n := logs.FilterMessageSnippet("did not poll").Len(); n != 0 {
		t.Fatalf("short gap logged %d times", n)
	}
	w.lastPoll = time.Now().Add(-3 * time.Second)
	w.notePollLocked()
	got := logs.FilterMessageSnippet("did not poll").All()
	if len(got) != 1 {
		t.Fatalf("gap of 3s with 2 READs in flight logged %d times, want 1", len(got))
	}
	f := got[0].ContextMap()
	if f["reads_in_flight"] != int64(2) {
		t.Fatalf("reads_in_flight %v, want 2", f["reads_in_flight"])
	}
	if gap, _ := f["gap"].(time.Duration); gap < 3*time.Second {
		t.Fatalf("gap %v, want >= 3s", f["gap"])
	}
	// An engine idle for 3 s, then a READ posted by the step that ends
	// the gap: no READ waited.
	w.recv["r1"].xfers = w.recv["r1"].xfers[2:]
	w.lastPoll = time.Now().Add(-3 * time.Second)
	w.notePollLocked()
	if n := logs.FilterMessageSnippet("did not poll").Len(); n != 1 {
		t.Fatalf("a READ posted after the gap logged: %d lines, want 1", n)
	}
}

// A model-thread call that waits for a long-held lock logs the wait and
// names the holder; the holder's long hold is logged too.
func TestLockTimedNamesTheHolder(t *testing.T) {
	w, logs := diagWorker()
	held := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		unlock := w.lockTimed("handshake result")
		close(held)
		time.Sleep(SlowCallWarn() + 100*time.Millisecond)
		unlock()
	}()
	<-held
	w.lockTimed("get_finished")()
	wg.Wait()
	waits := logs.FilterMessage("waited for the worker's lock").All()
	if len(waits) != 1 || waits[0].ContextMap()["held_by"] != "handshake result" || waits[0].ContextMap()["call"] != "get_finished" {
		t.Fatalf("wait lines %+v", waits)
	}
	holds := logs.FilterMessage("held the worker's lock").All()
	if len(holds) != 1 || holds[0].ContextMap()["call"] != "handshake result" {
		t.Fatalf("hold lines %+v", holds)
	}
	w.lockTimed("get_finished")() // uncontended, short: nothing more logged
	if logs.Len() != 2 {
		t.Fatalf("%d lines, want 2", logs.Len())
	}
}

// GONIXL_SLOW_CALL_MS: milliseconds, fractions allowed; unset, not a
// number, not positive or absurd is the default.
func TestSlowCallMS(t *testing.T) {
	for _, c := range []struct {
		in   string
		want time.Duration
	}{
		{"", 500 * time.Millisecond}, {"15", 15 * time.Millisecond}, {" 0.5 ", 500 * time.Microsecond},
		{"0", 500 * time.Millisecond}, {"-3", 500 * time.Millisecond}, {"abc", 500 * time.Millisecond},
		{"NaN", 500 * time.Millisecond}, {"1e12", 500 * time.Millisecond}, {"2000", 2 * time.Second},
	} {
		if got := slowCallMS(c.in); got != c.want {
			t.Errorf("GONIXL_SLOW_CALL_MS=%q: %v, want %v", c.in, got, c.want)
		}
	}
}

// With GONIXL_SLOW_CALL_MS set, a hold still running at that threshold
// logs every goroutine's stack while it lasts: the holder's shows what it
// waits for.
func TestLongHoldLogsStacks(t *testing.T) {
	SlowCallWarn()
	oldWarn, oldStacks := slowWarn, slowStacks
	slowWarn, slowStacks = 30*time.Millisecond, true
	defer func() { slowWarn, slowStacks = oldWarn, oldStacks }()
	w, logs := diagWorker()
	release := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		holdForStackTest(w, release)
	}()
	deadline := time.Now().Add(5 * time.Second)
	for logs.FilterMessageSnippet("goroutines now").Len() == 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	close(release)
	<-done
	got := logs.FilterMessageSnippet("goroutines now").All()
	if len(got) != 1 {
		t.Fatalf("%d stack dumps, want 1", len(got))
	}
	f := got[0].ContextMap()
	if f["call"] != "stack test" || !strings.Contains(fmt.Sprint(f["stacks"]), "holdForStackTest") {
		t.Fatalf("dump %v does not name the holder's frame", f)
	}
	// A short hold dumps nothing.
	w.lockTimed("short")()
	time.Sleep(60 * time.Millisecond)
	if n := logs.FilterMessageSnippet("goroutines now").Len(); n != 1 {
		t.Fatalf("%d dumps after a short hold, want still 1", n)
	}
}

//go:noinline
func holdForStackTest(w *Worker, release <-chan struct{}) {
	defer w.lockTimed("stack test")()
	<-release
}
