package proxy

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"reflect"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// flakyStore is a StateStore over a ConversationCache whose calls fail
// while down is set (as a remote store that is unreachable), or wait for
// the context's deadline while stuck is set (one that does not answer).
type flakyStore struct {
	*ConversationCache
	down, stuck  atomic.Bool
	takes, puts  atomic.Int32
	lastDeadline atomic.Int64 // ns left on the last call's context
}

func (f *flakyStore) fail(ctx context.Context) error {
	if dl, ok := ctx.Deadline(); ok {
		f.lastDeadline.Store(int64(time.Until(dl)))
	} else {
		f.lastDeadline.Store(-1)
	}
	if f.stuck.Load() {
		<-ctx.Done()
		return ctx.Err()
	}
	if f.down.Load() {
		return errors.New("dial tcp 127.0.0.1:1: connect: connection refused")
	}
	return nil
}

func (f *flakyStore) TakeTurn(ctx context.Context, id string) (Taken, error) {
	f.takes.Add(1)
	if err := f.fail(ctx); err != nil {
		return Taken{}, err
	}
	return f.ConversationCache.TakeTurn(ctx, id)
}

func (f *flakyStore) PutTurn(ctx context.Context, id string, turn uint64, p []byte) (bool, error) {
	f.puts.Add(1)
	if err := f.fail(ctx); err != nil {
		return false, err
	}
	return f.ConversationCache.PutTurn(ctx, id, turn, p)
}

func (f *flakyStore) String() string { return "flaky" }

func TestStateStoreDownDegradesToFullPrefill(t *testing.T) {
	store := &flakyStore{ConversationCache: NewConversationCache(time.Minute, 100, time.Now)}
	core, logs := observer.New(zap.DebugLevel)
	r, pf, _ := multiturnRig(t, func(c *Config) {
		c.StateStore = store
		c.StateTimeout = 30 * time.Millisecond
		c.Logger = zap.New(core)
	})
	turn := func(conv string) map[string]any {
		t.Helper()
		if status, _, b := r.post("/v1/chat/completions", chatBody(conv, false, nil), nil); status != 200 {
			t.Fatalf("status %d: %s", status, b)
		}
		reqs := pf.requests()
		return reqs[len(reqs)-1].Body["kv_transfer_params"].(map[string]any)
	}
	cached := decodeParams("d0")
	cached["remote_host"] = "d0.test"
	cached["do_remote_decode"], cached["do_remote_prefill"] = true, false

	turn("c")                                            // stored
	if kv := turn("c"); !reflect.DeepEqual(kv, cached) { // taken, and the new turn stored
		t.Fatalf("turn 2 with the store up: %v", kv)
	}
	if d := time.Duration(store.lastDeadline.Load()); d <= 0 || d > 30*time.Millisecond {
		t.Errorf("remote store call bounded by %v, want (0, 30ms]", d)
	}

	store.down.Store(true)
	for i := 0; i < 3; i++ {
		if kv := turn("c"); !reflect.DeepEqual(kv, emptyParams()) {
			t.Fatalf("turn with the store down pulled %v", kv)
		}
	}
	// A turn whose take failed has no number: its Put is not attempted.
	if n := store.puts.Load(); n != 2 {
		t.Errorf("%d Puts, want 2 (none for turns whose Take failed)", n)
	}
	if got := r.metric(MetricStateErrors, map[string]string{"op": "take", "reason": "error"}); got != 3 {
		t.Errorf("take errors = %v, want 3", got)
	}
	if n := logs.FilterMessageSnippet("conversation state store failed: turns are full prefills").Len(); n != 1 {
		t.Errorf("%d warnings for one outage, want 1", n)
	}

	// Stuck store: the turn waits at most StateTimeout, then is a miss.
	store.down.Store(false)
	store.stuck.Store(true)
	if kv := turn("c"); !reflect.DeepEqual(kv, emptyParams()) {
		t.Fatalf("turn with a stuck store pulled %v", kv)
	}
	if got := r.metric(MetricStateErrors, map[string]string{"op": "take", "reason": "timeout"}); got != 1 {
		t.Errorf("take timeouts = %v, want 1", got)
	}

	// Back: the store answers; turn 2's params, stored before the outage
	// and never taken, are still there, and the conversation goes on.
	store.stuck.Store(false)
	if kv := turn("c"); !reflect.DeepEqual(kv, cached) {
		t.Fatalf("after recovery the first turn pulled %v", kv)
	}
	if kv := turn("c"); !reflect.DeepEqual(kv, cached) {
		t.Fatalf("after recovery turn 2 pulled %v", kv)
	}
	if logs.FilterMessage("conversation state store answers again").Len() != 1 {
		t.Error("recovery not logged")
	}
	if got := r.metric(MetricCacheMisses, nil); got != 5 {
		t.Errorf("misses = %v, want 5 (the first turn and the failed takes)", got)
	}
	if r.p.Cache() != nil {
		t.Error("Cache() returns a cache while another store is in use")
	}
	if status, h := r.get("/health"); status != 200 || h["state_store"] != "flaky" {
		t.Errorf("/health = %d %v", status, h)
	}
}

func TestStatePutFailureCounted(t *testing.T) {
	store := &flakyStore{ConversationCache: NewConversationCache(time.Minute, 100, time.Now)}
	r, pf, _ := multiturnRig(t, func(c *Config) { c.StateStore = store })
	r.post("/v1/chat/completions", chatBody("p", false, nil), nil)
	store.down.Store(true)
	r.post("/v1/chat/completions", chatBody("p", false, nil), nil)
	store.down.Store(false)
	r.post("/v1/chat/completions", chatBody("p", false, nil), nil)
	// Turn 2 failed both ways; turn 3 finds turn 1's params (turn 2 could
	// not take them).
	reqs := pf.requests()
	if kv := reqs[2].Body["kv_transfer_params"].(map[string]any); kv["remote_engine_id"] != "engine-d0" {
		t.Errorf("turn 3 pulled %v, want turn 1's params", kv)
	}
	if got := r.metric(MetricStateErrors, map[string]string{"op": "take", "reason": "error"}); got != 1 {
		t.Errorf("take errors %v, want 1", got)
	}
}

func TestStateSupersededPutCounted(t *testing.T) {
	// Two turns of one conversation at once: the first one's decode
	// answers after the second one's; its params must not replace the
	// second's.
	pf := newFake(t, "p0", prefillHandler("p0"))
	release := make(chan struct{})
	var calls atomic.Int32
	df := newFake(t, "d0", func(w http.ResponseWriter, r *http.Request, rec received) {
		if calls.Add(1) == 1 {
			<-release // the first turn's decode is slow
		}
		decodeHandler("d0", true)(w, r, rec)
	})
	r := newRig(t, []*fakeOpenAI{pf}, []*fakeOpenAI{df}, func(c *Config) { c.Mode = ModeMultiturn })
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		r.post("/v1/chat/completions", chatBody("s", false, nil), nil)
	}()
	for len(df.requests()) == 0 && calls.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	r.post("/v1/chat/completions", chatBody("s", false, nil), nil) // turn 2 (started later) finishes first
	close(release)
	wg.Wait()
	if got := r.metric(MetricStateSuperseded, nil); got != 1 {
		t.Errorf("superseded = %v, want 1", got)
	}
	if n := r.p.Cache().Len(); n != 1 {
		t.Errorf("cache holds %d conversations, want 1", n)
	}
}

func TestConversationCacheTurns(t *testing.T) {
	clk := &fakeClock{t: time.Unix(1000, 0)}
	c := NewConversationCache(10*time.Second, 10, clk.now)
	ctx := context.Background()
	t1, _ := c.TakeTurn(ctx, "c")
	t2, _ := c.TakeTurn(ctx, "c")
	if t1.Turn == 0 || t2.Turn <= t1.Turn || t1.Result != Miss {
		t.Fatalf("turns %+v %+v", t1, t2)
	}
	if ok, _ := c.PutTurn(ctx, "c", t1.Turn, []byte(`{"t":1}`)); ok {
		t.Error("an earlier turn's Put accepted after a later turn started")
	}
	if ok, _ := c.PutTurn(ctx, "c", t2.Turn, []byte(`{"t":2}`)); !ok {
		t.Error("the latest turn's Put refused")
	}
	t3, _ := c.TakeTurn(ctx, "c")
	if t3.Result != Hit || string(t3.Params) != `{"t":2}` {
		t.Fatalf("took %v %s", t3.Result, t3.Params)
	}
	// The taken conversation keeps its turn number until the TTL: a late
	// Put of turn 2 is refused.
	if ok, _ := c.PutTurn(ctx, "c", t2.Turn, []byte(`{"t":2}`)); ok {
		t.Error("a Put of an older turn accepted after the params were taken")
	}
	if c.Len() != 0 {
		t.Errorf("Len %d after the params were taken", c.Len())
	}
	clk.advance(11 * time.Second)
	c.EvictStale()
	if ok, _ := c.PutTurn(ctx, "c", t2.Turn, []byte(`{"t":2}`)); !ok {
		t.Error("after the TTL the conversation is forgotten; a Put should be stored")
	}

	// Racing Takes: one winner.
	for round := 0; round < 50; round++ {
		id := fmt.Sprint("r", round)
		c.Put(id, []byte(`{}`))
		var wins atomic.Int32
		var wg sync.WaitGroup
		for g := 0; g < 6; g++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if tk, _ := c.TakeTurn(ctx, id); tk.Result == Hit {
					wins.Add(1)
				}
			}()
		}
		wg.Wait()
		if wins.Load() != 1 {
			t.Fatalf("round %d: %d winners", round, wins.Load())
		}
	}
}
