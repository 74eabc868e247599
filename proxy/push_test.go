package proxy

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// pushPrefillHandler answers like a push-mode prefill (transfer_mode
// "push"), after release is closed (nil: at once); status != 200 fails.
func pushPrefillHandler(name string, release <-chan struct{}, status *int) func(http.ResponseWriter, *http.Request, received) {
	return func(w http.ResponseWriter, _ *http.Request, rec received) {
		if release != nil {
			<-release
		}
		if status != nil && *status != 200 {
			writeTestJSON(w, *status, map[string]any{"error": map[string]any{"message": "prefill broke"}})
			return
		}
		params := prefillParams(name)
		params["transfer_mode"] = "push"
		params["pp_size"] = 1.0
		writeTestJSON(w, 200, map[string]any{"id": "cmpl-" + name, "choices": []any{map[string]any{"text": "x"}}, "kv_transfer_params": params})
	}
}

// The first request learns the prefill's identity in sequence; later ones
// reach the decode before the prefill answered, with one X-Request-Id on
// both and the decode's kv_transfer_params built from that identity.
func TestPushSendsPrefillAndDecodeAtOnce(t *testing.T) {
	release := make(chan struct{})
	var once sync.Once
	open := func() { once.Do(func() { close(release) }) }
	defer open()
	gate := make(chan struct{})
	close(gate) // the first request goes through at once
	var cur = gate
	var mu sync.Mutex
	pf := newFake(t, "p", func(w http.ResponseWriter, r *http.Request, rec received) {
		mu.Lock()
		g := cur
		mu.Unlock()
		pushPrefillHandler("p", g, nil)(w, r, rec)
	})
	decodeSaw := make(chan received, 4)
	df := newFake(t, "d", func(w http.ResponseWriter, r *http.Request, rec received) {
		decodeSaw <- rec
		decodeHandler("d", false)(w, r, rec)
	})
	rg := newRig(t, []*fakeOpenAI{pf}, []*fakeOpenAI{df}, func(c *Config) { c.Push = true })

	code, _, body := rg.post("/v1/completions", map[string]any{"model": "m", "prompt": "hi", "max_tokens": 5}, map[string]string{"X-Request-Id": "first"})
	if code != 200 {
		t.Fatalf("first request: %d %s", code, body)
	}
	first := <-decodeSaw
	if kv := first.Body["kv_transfer_params"].(map[string]any); kv["remote_request_id"] != "req-p" {
		t.Fatalf("first request: the decode should get the prefill's own params, got %v", kv)
	}

	mu.Lock()
	cur = release // the prefill now answers only when released
	mu.Unlock()
	done := make(chan int, 1)
	go func() {
		code, _, _ := rg.post("/v1/completions", map[string]any{"model": "m", "prompt": "hi", "max_tokens": 5}, map[string]string{"X-Request-Id": "second"})
		done <- code
	}()
	var second received
	select {
	case second = <-decodeSaw:
	case <-time.After(waitLimit):
		t.Fatal("the decode never got the second request while the prefill was still working")
	}
	kv := second.Body["kv_transfer_params"].(map[string]any)
	want := map[string]any{"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "engine-p", "remote_host": "10.0.0.99",
		"remote_port": 5600.0, "tp_size": 1.0, "pp_size": 1.0, "remote_request_id": "second", "transfer_mode": "push"}
	for k, v := range want {
		if kv[k] != v {
			t.Errorf("decode kv_transfer_params[%s] = %v, want %v (all: %v)", k, kv[k], v, kv)
		}
	}
	if second.Header.Get("X-Request-Id") != "second" {
		t.Errorf("decode X-Request-Id %q", second.Header.Get("X-Request-Id"))
	}
	open()
	if code := <-done; code != 200 {
		t.Fatalf("second request: %d", code)
	}
	reqs := pf.requests()
	if len(reqs) != 2 || reqs[1].Header.Get("X-Request-Id") != "second" {
		t.Fatalf("prefill requests %d, last id %q", len(reqs), reqs[len(reqs)-1].Header.Get("X-Request-Id"))
	}
	var pkv map[string]any
	_ = json.Unmarshal(mustJSON(reqs[1].Body["kv_transfer_params"]), &pkv)
	if pkv["do_remote_decode"] != true || reqs[1].Body["max_tokens"] != 1.0 {
		t.Fatalf("prefill body %v", reqs[1].Body)
	}
}

// A failed prefill cancels its concurrent decode request and is what the
// client sees.
func TestPushPrefillFailureCancelsDecode(t *testing.T) {
	var st atomic.Int64
	st.Store(200)
	pf := newFake(t, "p", func(w http.ResponseWriter, r *http.Request, rec received) {
		s := int(st.Load())
		pushPrefillHandler("p", nil, &s)(w, r, rec)
	})
	cancelled := make(chan struct{}, 1)
	df := newFake(t, "d", func(w http.ResponseWriter, r *http.Request, rec received) {
		if st.Load() == 200 {
			decodeHandler("d", false)(w, r, rec)
			return
		}
		select {
		case <-r.Context().Done():
			cancelled <- struct{}{}
		case <-time.After(waitLimit):
		}
	})
	rg := newRig(t, []*fakeOpenAI{pf}, []*fakeOpenAI{df}, func(c *Config) { c.Push = true })
	if code, _, body := rg.post("/v1/completions", map[string]any{"model": "m", "prompt": "hi"}, nil); code != 200 {
		t.Fatalf("first: %d %s", code, body)
	}
	st.Store(503)
	code, _, body := rg.post("/v1/completions", map[string]any{"model": "m", "prompt": "hi"}, nil)
	if code != http.StatusBadGateway || !strings.Contains(string(body), "prefill instance") || !strings.Contains(string(body), "503") {
		t.Fatalf("prefill failure: client got %d %s, want the prefill's failure (502 naming its 503)", code, body)
	}
	select {
	case <-cancelled:
	case <-time.After(waitLimit):
		t.Fatal("the decode request was not cancelled")
	}
}

func TestPushInMultiturnModeNeedsOneway(t *testing.T) {
	if _, err := New(Config{Mode: ModeMultiturn, Push: true, Prefill: []Instance{{Host: "a", Port: 1}}, Decode: []Instance{{Host: "b", Port: 2}}}); err == nil {
		t.Fatal("push with bidirectional reuse accepted")
	}
}

// The multi-turn proxy in push mode (oneway reuse): conversation_id is
// not forwarded, the prefill's side channel is addressed at the host the
// proxy reaches the prefill at, and later turns go out at once.
func TestPushMultiturnOneway(t *testing.T) {
	pf := newFake(t, "p", pushPrefillHandler("p", nil, nil))
	decodeSaw := make(chan received, 4)
	df := newFake(t, "d", func(w http.ResponseWriter, r *http.Request, rec received) {
		decodeSaw <- rec
		decodeHandler("d", false)(w, r, rec)
	})
	rg := newRig(t, []*fakeOpenAI{pf}, []*fakeOpenAI{df}, func(c *Config) {
		c.Mode, c.Push, c.ReuseMode = ModeMultiturn, true, ReuseOneway
	})
	for turn := 0; turn < 2; turn++ {
		body := map[string]any{"model": "m", "messages": []any{map[string]any{"role": "user", "content": "hi"}}, "conversation_id": "c1"}
		if code, _, out := rg.post("/v1/chat/completions", body, nil); code != 200 {
			t.Fatalf("turn %d: %d %s", turn, code, out)
		}
		got := <-decodeSaw
		if _, ok := got.Body["conversation_id"]; ok {
			t.Fatalf("turn %d: conversation_id reached the decode", turn)
		}
		kv := got.Body["kv_transfer_params"].(map[string]any)
		if kv["remote_host"] != "p.test" {
			t.Fatalf("turn %d: remote_host %v, want the prefill's host as the proxy reaches it", turn, kv["remote_host"])
		}
		if turn == 1 && kv["transfer_mode"] != "push" {
			t.Fatalf("turn 2 not sent at once: %v", kv)
		}
	}
}

func mustJSON(v any) []byte {
	b, _ := json.Marshal(v)
	return b
}

// gatedPush is a push rig whose decode answers normally until gated is set,
// then holds each request until it is cancelled: it signals decodeIn on
// arrival and sends the cancellation's time on canceled. The prefill's
// identity is learned by one request before it returns.
type gatedPush struct {
	rg       *rig
	pf       *fakeOpenAI
	gated    atomic.Bool
	decodeIn chan struct{}
	canceled chan time.Time
}

func newGatedPush(t *testing.T, mod func(*Config)) *gatedPush {
	t.Helper()
	g := &gatedPush{decodeIn: make(chan struct{}, 4), canceled: make(chan time.Time, 4)}
	g.pf = newFake(t, "p", pushPrefillHandler("p", nil, nil))
	df := newFake(t, "d", func(w http.ResponseWriter, r *http.Request, rec received) {
		if !g.gated.Load() {
			decodeHandler("d", false)(w, r, rec)
			return
		}
		g.decodeIn <- struct{}{}
		<-r.Context().Done()
		g.canceled <- time.Now()
	})
	g.rg = newRig(t, []*fakeOpenAI{g.pf}, []*fakeOpenAI{df}, func(c *Config) { c.Push = true; mod(c) })
	if code, _, body := g.rg.post("/v1/completions", map[string]any{"model": "m", "prompt": "hi"}, nil); code != 200 {
		t.Fatalf("first: %d %s", code, body)
	}
	g.gated.Store(true)
	return g
}

// clientLeaves sends a request, waits for the decode to hold it, and cancels
// the client; it returns when the cancel was made, with the client's
// outcome on the channel.
func (g *gatedPush) clientLeaves(t *testing.T) (left time.Time, errc <-chan error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, g.rg.srv.URL+"/v1/completions", strings.NewReader(`{"model":"m","prompt":"hi"}`))
	req.Header.Set("Content-Type", "application/json")
	ec := make(chan error, 1)
	go func() {
		resp, err := g.rg.srv.Client().Do(req)
		if err == nil {
			resp.Body.Close()
		}
		ec <- err
	}()
	select {
	case <-g.decodeIn:
	case <-time.After(waitLimit):
		cancel()
		t.Fatal("the decode never got the request")
	}
	left = time.Now()
	cancel()
	return left, ec
}

// A client that goes away before the decode answers is not a decode
// failure: the prefill's identity is kept and the next request still
// reaches both at once.
func TestPushClientGoneKeepsIdentity(t *testing.T) {
	g := newGatedPush(t, func(*Config) {})
	_, errc := g.clientLeaves(t) // the client goes away while the decode works
	<-errc
	g.gated.Store(false)
	// The proxy's handler may still be winding down: the identity must
	// survive it, so wait for the prefill's request to have ended too.
	deadline := time.Now().Add(waitLimit)
	for len(g.pf.requests()) < 2 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond)
	if _, ok := g.rg.p.pushIdentityOf(g.rg.p.cfg.Prefill[0]); !ok {
		t.Fatal("a client that went away made the proxy forget the prefill's identity")
	}
}

// Push mode does not outlive a client that went away: a push decode aborted
// before vLLM gave it blocks cannot tell the prefill to drop a computed
// prompt, so both requests are cancelled at once, whatever AbandonGrace.
func TestPushClientGoneCancelsAtOnce(t *testing.T) {
	g := newGatedPush(t, func(c *Config) { c.AbandonGrace = 5 * time.Second })
	left, _ := g.clientLeaves(t)
	select {
	case at := <-g.canceled:
		if d := at.Sub(left); d > 2*time.Second {
			t.Fatalf("push decode cancelled %v after the client left; want at once, not after the 5 s grace", d)
		}
	case <-time.After(waitLimit):
		t.Fatal("push decode never cancelled")
	}
}
