package main

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gonixl/gonixl/proxy"
	"github.com/gonixl/gonixl/proxy/redisstate/redistest"
)

// fleetFake is one fake vLLM playing prefill and decode: a prefill request
// (max_tokens 1) records the kv_transfer_params it was given; a decode
// answers with params naming its turn, so that the next turn's prefill
// shows which turn's params it got.
type fleetFake struct {
	mu      sync.Mutex
	decodes int
	pulled  []string // per prefill request: the remote_request_id it was given, "" for none
}

func (f *fleetFake) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	var m map[string]any
	_ = json.Unmarshal(b, &m)
	f.mu.Lock()
	defer f.mu.Unlock()
	if m["max_tokens"] == 1.0 {
		kv, _ := m["kv_transfer_params"].(map[string]any)
		id, _ := kv["remote_request_id"].(string)
		f.pulled = append(f.pulled, id)
		_, _ = io.WriteString(w, `{"kv_transfer_params":{"remote_block_ids":[1]}}`)
		return
	}
	f.decodes++
	resp := map[string]any{"choices": []any{map[string]any{"message": map[string]any{"role": "assistant", "content": "ok"}}},
		"kv_transfer_params": map[string]any{"do_remote_prefill": true, "remote_request_id": "decode-" + strconv.Itoa(f.decodes),
			"remote_block_ids": []int{1, 2}, "remote_engine_id": "d", "remote_host": "x", "remote_port": 1}}
	_ = json.NewEncoder(w).Encode(resp)
}

func (f *fleetFake) lastPulled() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.pulled[len(f.pulled)-1]
}

type replica struct {
	addr   string
	cancel context.CancelFunc
	exited chan int
	stderr *syncBuffer
	once   sync.Once
}

func startReplica(t *testing.T, fake *url.URL, storeURL string) *replica {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r := &replica{cancel: cancel, exited: make(chan int, 1), stderr: &syncBuffer{}}
	ready := make(chan string, 1)
	go func() {
		r.exited <- run(ctx, []string{"--multiturn", "--port", "0", "--prefiller-host", fake.Hostname(), "--prefiller-port", fake.Port(),
			"--decoder-host", fake.Hostname(), "--decoder-port", fake.Port(), "--state-store", storeURL,
			"--state-store-timeout", "0.2", "--log-level", "debug"}, io.Discard, r.stderr, func(a string) { ready <- a })
	}()
	select {
	case r.addr = <-ready:
	case rc := <-r.exited:
		t.Fatalf("proxy exited early with %d: %s", rc, r.stderr.String())
	case <-time.After(10 * time.Second):
		t.Fatal("proxy never became ready")
	}
	t.Cleanup(r.stop)
	return r
}

func (r *replica) stop() {
	r.once.Do(func() {
		r.cancel()
		select {
		case <-r.exited:
		case <-time.After(15 * time.Second):
		}
	})
}

func (r *replica) turn(t *testing.T, conv string) {
	t.Helper()
	body := `{"model":"m","messages":[{"role":"user","content":"hi"}],"conversation_id":"` + conv + `"}`
	resp, err := http.Post("http://"+r.addr+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || strings.Contains(string(b), "kv_transfer_params") {
		t.Fatalf("turn of %s: %d %s", conv, resp.StatusCode, b)
	}
}

func (r *replica) metric(t *testing.T, name, labels string) string {
	t.Helper()
	resp, err := http.Get("http://" + r.addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, name+labels+" ") {
			return strings.TrimPrefix(line, name+labels+" ")
		}
	}
	return ""
}

// TestReplicasShareConversations: two gonixl-proxy commands with one real
// redis-server as --state-store; a conversation's turns alternate between
// them, one of them restarts, and then the server stops.
func TestReplicasShareConversations(t *testing.T) {
	srv := redistest.Start(t)
	fake := &fleetFake{}
	hs := httptest.NewServer(fake)
	defer hs.Close()
	u, _ := url.Parse(hs.URL)

	a := startReplica(t, u, srv.URL(0))
	b := startReplica(t, u, srv.URL(0))
	if !strings.Contains(a.stderr.String(), "state_store") || !strings.Contains(a.stderr.String(), srv.URL(0)) {
		t.Errorf("start-up line does not name the store: %s", a.stderr.String())
	}

	a.turn(t, "conv")
	if got := fake.lastPulled(); got != "" {
		t.Fatalf("first turn pulled %q", got)
	}
	b.turn(t, "conv") // the other replica: finds turn 1's params
	if got := fake.lastPulled(); got != "decode-1" {
		t.Fatalf("turn 2 on the other replica pulled %q, want decode-1", got)
	}
	a.turn(t, "other") // another conversation never sees conv's params
	if got := fake.lastPulled(); got != "" {
		t.Fatalf("another conversation pulled %q", got)
	}

	a.stop()
	a2 := startReplica(t, u, srv.URL(0)) // restarted replica
	a2.turn(t, "conv")
	if got := fake.lastPulled(); got != "decode-2" {
		t.Fatalf("turn 3 on a restarted replica pulled %q, want decode-2", got)
	}

	srv.Stop()
	b.turn(t, "conv") // store down: a full prefill, not an error
	if got := fake.lastPulled(); got != "" {
		t.Fatalf("turn with the store down pulled %q", got)
	}
	if got := b.metric(t, proxy.MetricStateErrors, `{op="take",reason="error"}`); got != "1" {
		t.Errorf("take errors on the replica = %q, want 1", got)
	}
	if !strings.Contains(b.stderr.String(), "conversation state store failed") {
		t.Errorf("the outage was not logged: %s", b.stderr.String())
	}
}

// TestReplicasRaceOnOneConversation: two turns of one conversation sent at
// once, one to each replica, round after round. A decode's params are
// pulled at most once (two prefills never read the same blocks); when the
// two turns overlap, one of them finds nothing.
func TestReplicasRaceOnOneConversation(t *testing.T) {
	srv := redistest.Start(t)
	fake := &fleetFake{}
	hs := httptest.NewServer(fake)
	defer hs.Close()
	u, _ := url.Parse(hs.URL)
	reps := []*replica{startReplica(t, u, srv.URL(0)), startReplica(t, u, srv.URL(0))}
	misses := 0
	for round := 0; round < 30; round++ {
		conv := "race-" + strconv.Itoa(round)
		reps[0].turn(t, conv) // stores the decode's params
		var wg sync.WaitGroup
		for _, r := range reps {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r.turn(t, conv)
			}()
		}
		wg.Wait()
		fake.mu.Lock()
		last := fake.pulled[len(fake.pulled)-2:]
		if last[0] == "" || last[1] == "" {
			misses++
		}
		fake.mu.Unlock()
	}
	fake.mu.Lock()
	defer fake.mu.Unlock()
	seen := map[string]bool{}
	for _, id := range fake.pulled {
		if id != "" && seen[id] {
			t.Fatalf("the params of %s were pulled twice: %q", id, fake.pulled)
		}
		seen[id] = true
	}
	t.Logf("30 rounds of two racing turns: %d rounds where one turn found nothing (the turns overlapped)", misses)
}
