package redisstate

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/gonixl/gonixl/proxy"
	"github.com/gonixl/gonixl/proxy/redisstate/redistest"
)

// Every test runs against a real redis-server (redistest.Start fails the
// test when the machine has none).

func newStore(t *testing.T, srv *redistest.Server, mod func(*Options)) *Store {
	t.Helper()
	o := Options{URL: srv.URL(0), TTL: time.Minute, Timeout: 500 * time.Millisecond}
	if mod != nil {
		mod(&o)
	}
	s, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func params(conv string, n int) []byte {
	return []byte(fmt.Sprintf(`{"conv":%q,"n":%d}`, conv, n))
}

func mustTake(t *testing.T, s *Store, id string) proxy.Taken {
	t.Helper()
	tk, err := s.TakeTurn(context.Background(), id)
	if err != nil {
		t.Fatalf("TakeTurn(%s): %v", id, err)
	}
	if tk.Turn == 0 {
		t.Fatalf("TakeTurn(%s) numbered the turn 0", id)
	}
	return tk
}

func mustPut(t *testing.T, s *Store, id string, turn uint64, p []byte) bool {
	t.Helper()
	ok, err := s.PutTurn(context.Background(), id, turn, p)
	if err != nil {
		t.Fatalf("PutTurn(%s, %d): %v", id, turn, err)
	}
	return ok
}

func TestTakeIsSingleUseAndPutFollowsTurns(t *testing.T) {
	srv := redistest.Start(t)
	s := newStore(t, srv, nil)
	t1 := mustTake(t, s, "c")
	if t1.Result != proxy.Miss || t1.Params != nil {
		t.Fatalf("first turn found %v %s", t1.Result, t1.Params)
	}
	if !mustPut(t, s, "c", t1.Turn, params("c", 1)) {
		t.Fatal("turn 1's params refused with no later turn")
	}
	t2 := mustTake(t, s, "c")
	if t2.Result != proxy.Hit || string(t2.Params) != string(params("c", 1)) {
		t.Fatalf("turn 2 took %v %s", t2.Result, t2.Params)
	}
	if t2.Turn <= t1.Turn {
		t.Fatalf("turn numbers %d then %d: not increasing", t1.Turn, t2.Turn)
	}
	if again := mustTake(t, s, "c"); again.Result != proxy.Miss {
		t.Fatalf("params taken twice (%v): single use broken", again.Result)
	}

	// Two turns started (t3 < t4): whichever decode finishes first, t4's
	// params stay.
	t3, t4 := mustTake(t, s, "c"), mustTake(t, s, "c")
	if mustPut(t, s, "c", t4.Turn, params("c", 4)) != true || mustPut(t, s, "c", t3.Turn, params("c", 3)) != false {
		t.Fatal("a later turn's params replaced, or the earlier turn's Put accepted after it")
	}
	if got := mustTake(t, s, "c"); string(got.Params) != string(params("c", 4)) {
		t.Fatalf("after both Puts the store holds %s, want turn 4's", got.Params)
	}
	t5, t6 := mustTake(t, s, "c"), mustTake(t, s, "c")
	if !mustPut(t, s, "c", t5.Turn, params("c", 5)) {
		// t6 has started: t5's Put is refused, the store keeps nothing
		// older than the latest turn.
	} else {
		t.Fatal("turn 5's Put accepted although turn 6 had started")
	}
	if !mustPut(t, s, "c", t6.Turn, params("c", 6)) {
		t.Fatal("the latest turn's Put refused")
	}
	if got := mustTake(t, s, "c"); string(got.Params) != string(params("c", 6)) {
		t.Fatalf("store holds %s, want turn 6's", got.Params)
	}
}

// TestConcurrentTakesOneWinner: replicas (separate clients) race on one
// conversation's params; exactly one Take gets them, every round.
func TestConcurrentTakesOneWinner(t *testing.T) {
	srv := redistest.Start(t)
	const replicas, rounds = 6, 40
	stores := make([]*Store, replicas)
	for i := range stores {
		stores[i] = newStore(t, srv, nil)
	}
	for r := 0; r < rounds; r++ {
		conv := fmt.Sprintf("race-%d", r)
		tk := mustTake(t, stores[0], conv)
		mustPut(t, stores[0], conv, tk.Turn, params(conv, r))
		var wins atomic.Int32
		turns := make([]uint64, replicas)
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i, s := range stores {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				got, err := s.TakeTurn(context.Background(), conv)
				if err != nil {
					t.Errorf("replica %d: %v", i, err)
					return
				}
				turns[i] = got.Turn
				if got.Result == proxy.Hit {
					wins.Add(1)
					if string(got.Params) != string(params(conv, r)) {
						t.Errorf("replica %d took %s", i, got.Params)
					}
				}
			}()
		}
		close(start)
		wg.Wait()
		if n := wins.Load(); n != 1 {
			t.Fatalf("round %d: %d replicas took the params, want exactly 1", r, n)
		}
		seen := map[uint64]bool{}
		for _, tn := range turns {
			if seen[tn] {
				t.Fatalf("round %d: two turns got number %d", r, tn)
			}
			seen[tn] = true
		}
	}
}

func TestTTLExpiry(t *testing.T) {
	srv := redistest.Start(t)
	s := newStore(t, srv, func(o *Options) { o.TTL = 300 * time.Millisecond })
	tk := mustTake(t, s, "ttl")
	mustPut(t, s, "ttl", tk.Turn, params("ttl", 1))
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr(), Protocol: 2})
	defer rdb.Close()
	pttl, err := rdb.PTTL(context.Background(), DefaultPrefix+"ttl").Result()
	if err != nil || pttl <= 0 || pttl > 300*time.Millisecond {
		t.Fatalf("key TTL %v (%v), want in (0, 300ms]", pttl, err)
	}
	time.Sleep(450 * time.Millisecond)
	if got := mustTake(t, s, "ttl"); got.Result != proxy.Miss {
		t.Fatalf("entry older than the TTL taken: %v %s", got.Result, got.Params)
	}
	// A new key after expiry still numbers turns above the old ones.
	if got := mustTake(t, s, "ttl"); got.Turn <= tk.Turn {
		t.Fatalf("turn %d after expiry, not above %d", got.Turn, tk.Turn)
	}
}

func TestStoreDownThenBack(t *testing.T) {
	srv := redistest.Start(t)
	s := newStore(t, srv, func(o *Options) { o.Timeout = 50 * time.Millisecond })
	tk := mustTake(t, s, "down")
	mustPut(t, s, "down", tk.Turn, params("down", 1))

	srv.Stop()
	if _, err := s.TakeTurn(context.Background(), "down"); err == nil {
		t.Fatal("TakeTurn succeeded with the server stopped")
	}
	if _, err := s.PutTurn(context.Background(), "down", tk.Turn+1, params("down", 2)); err == nil {
		t.Fatal("PutTurn succeeded with the server stopped")
	}

	// A fresh server (no persistence, empty script cache): the same Store
	// reconnects, EVALSHA falls back to EVAL, the conversation starts over.
	srv.Restart()
	got := mustTake(t, s, "down")
	if got.Result != proxy.Miss {
		t.Fatalf("restarted empty server gave %v", got.Result)
	}
	mustPut(t, s, "down", got.Turn, params("down", 3))
	if got := mustTake(t, s, "down"); got.Result != proxy.Hit || string(got.Params) != string(params("down", 3)) {
		t.Fatalf("after restart: %v %s", got.Result, got.Params)
	}
}

func TestStuckServerTimesOut(t *testing.T) {
	srv := redistest.Start(t)
	s := newStore(t, srv, func(o *Options) { o.Timeout = 50 * time.Millisecond })
	mustTake(t, s, "warm") // a pooled connection exists
	srv.Pause()
	defer srv.Resume()
	_, err := s.TakeTurn(context.Background(), "stuck")
	if err == nil {
		t.Fatal("TakeTurn answered by a stopped server")
	}
	var ne interface{ Timeout() bool }
	if !errors.Is(err, context.DeadlineExceeded) && !(errors.As(err, &ne) && ne.Timeout()) {
		t.Fatalf("error %v is not a timeout", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, err := s.PutTurn(ctx, "stuck", 1, params("stuck", 1)); err == nil {
		t.Fatal("PutTurn answered by a stopped server")
	}
	srv.Resume()
	// The timed-out connections were dropped: the next calls get their own
	// replies, not the late ones.
	tk := mustTake(t, s, "after")
	if tk.Result != proxy.Miss {
		t.Fatalf("fresh conversation found %v %s", tk.Result, tk.Params)
	}
}

// TestRestartedReplicaFindsConversation: a proxy's Store closed and a new
// one opened (a restarted replica) takes what the old one stored.
func TestRestartedReplicaFindsConversation(t *testing.T) {
	srv := redistest.Start(t)
	a := newStore(t, srv, nil)
	tk := mustTake(t, a, "kept")
	mustPut(t, a, "kept", tk.Turn, params("kept", 1))
	_ = a.Close()
	b := newStore(t, srv, nil)
	if got := mustTake(t, b, "kept"); got.Result != proxy.Hit || string(got.Params) != string(params("kept", 1)) {
		t.Fatalf("new replica took %v %s", got.Result, got.Params)
	}
	// A different prefix (another fleet on the same server) sees nothing.
	c := newStore(t, srv, func(o *Options) { o.Prefix = "other:" })
	tk = mustTake(t, b, "kept")
	mustPut(t, b, "kept", tk.Turn, params("kept", 2))
	if got := mustTake(t, c, "kept"); got.Result != proxy.Miss {
		t.Fatalf("another prefix took %s", got.Params)
	}
}

// TestNoLeakageUnderInterleavings: several replicas run many conversations'
// turns in random order; every params a Take returns were stored for that
// conversation, and for its latest stored turn.
func TestNoLeakageUnderInterleavings(t *testing.T) {
	srv := redistest.Start(t)
	stores := []*Store{newStore(t, srv, nil), newStore(t, srv, nil), newStore(t, srv, nil)}
	const workers, convs, steps = 8, 12, 150
	var mu sync.Mutex
	type stored struct {
		turn   uint64
		params []byte
	}
	lastStored := map[string]stored{} // per conversation, the highest-numbered accepted Put
	var hits atomic.Int32
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for i := 0; i < steps; i++ {
				conv := fmt.Sprintf("conv-%d", rng.IntN(convs))
				s := stores[rng.IntN(len(stores))]
				tk, err := s.TakeTurn(context.Background(), conv)
				if err != nil {
					t.Error(err)
					return
				}
				if tk.Result == proxy.Hit {
					hits.Add(1)
					if !strings.Contains(string(tk.Params), fmt.Sprintf(`"conv":%q`, conv)) {
						t.Errorf("%s took another conversation's params: %s", conv, tk.Params)
					}
				}
				p := []byte(fmt.Sprintf(`{"conv":%q,"turn":%d}`, conv, tk.Turn))
				if rng.IntN(4) == 0 {
					time.Sleep(time.Duration(rng.IntN(2000)) * time.Microsecond)
				}
				ok, err := stores[rng.IntN(len(stores))].PutTurn(context.Background(), conv, tk.Turn, p)
				if err != nil {
					t.Error(err)
					return
				}
				if ok {
					mu.Lock()
					if tk.Turn > lastStored[conv].turn {
						lastStored[conv] = stored{tk.Turn, p}
					}
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	if hits.Load() == 0 {
		t.Fatal("no Take hit: the interleavings never exercised a read")
	}
	// Quiescent: a conversation that still holds params holds those of its
	// highest-numbered accepted Put (an accepted Put is never below the
	// conversation's newest turn, so the last one accepted is the highest).
	for conv, want := range lastStored {
		got := mustTake(t, stores[0], conv)
		if got.Result == proxy.Hit && string(got.Params) != string(want.params) {
			t.Errorf("%s holds %s, its highest accepted Put stored %s", conv, got.Params, want.params)
		}
	}

	// An entry stored under one conversation's key for another (a corrupted
	// or hand-written key) is refused, not returned.
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr(), Protocol: 2})
	defer rdb.Close()
	if err := rdb.HSet(context.Background(), DefaultPrefix+"victim", "t", "1", "c", "intruder", "p", `{"x":1}`).Err(); err != nil {
		t.Fatal(err)
	}
	if got, err := stores[1].TakeTurn(context.Background(), "victim"); !errors.Is(err, ErrForeignEntry) || got.Params != nil {
		t.Fatalf("foreign entry: %v %s, want ErrForeignEntry and no params", err, got.Params)
	}
}

func TestNewRejectsBadURLAndRedacts(t *testing.T) {
	if _, err := New(Options{URL: "http://x"}); err == nil {
		t.Error("http URL accepted")
	}
	s, err := New(Options{URL: "redis://user:secret@127.0.0.1:1/2"})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if strings.Contains(s.String(), "secret") {
		t.Errorf("String() shows the password: %s", s.String())
	}
}

// BenchmarkTurn: one turn's store traffic (a TakeTurn and a PutTurn of
// ~300 bytes of params) against a local redis-server, the cost a shared
// store adds to a turn; run in parallel with -cpu to see contention.
func BenchmarkTurn(b *testing.B) {
	srv := redistest.Start(b)
	s, err := New(Options{URL: srv.URL(0), TTL: time.Minute, Timeout: time.Second})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	p := []byte(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_block_ids":[1,2,3,4,5,6,7,8],` +
		`"remote_engine_id":"engine-d0","remote_request_id":"chatcmpl-0123456789abcdef","remote_host":"10.0.0.7",` +
		`"remote_port":5600,"tp_size":1,"remote_num_tokens":250,"gonixl_expiry_unix":1790000000.5,` +
		`"gonixl_token_digest":"0123456789abcdef0123456789abcdef0123456789abcdef"}`)
	var n atomic.Int64
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		conv := fmt.Sprint("bench-", n.Add(1))
		for pb.Next() {
			tk, err := s.TakeTurn(context.Background(), conv)
			if err != nil {
				b.Fatal(err)
			}
			if _, err := s.PutTurn(context.Background(), conv, tk.Turn, p); err != nil {
				b.Fatal(err)
			}
		}
	})
}
