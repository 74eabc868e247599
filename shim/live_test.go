package shim

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gonixl/gonixl/nixl/nixltest"
)

func TestMetricsPorts(t *testing.T) {
	t.Setenv(EnvMetricsPort, "9000")
	for _, c := range []struct {
		tp, pp, tpRank, ppRank, dp int
		worker                     bool
		want                       int
	}{
		{1, 1, 0, 0, 0, true, 9000},
		{1, 1, 0, 0, 0, false, 9001}, // vLLM on CPU: the scheduler's own process
		{2, 1, 1, 0, 0, true, 9001},
		{2, 1, 0, 0, 0, false, 9002},
		{2, 2, 1, 1, 0, true, 9003},
		{2, 1, 1, 0, 1, true, 9004},
		{2, 1, 0, 0, 1, false, 9005},
	} {
		cfg := &Config{TPSize: c.tp, PPSize: c.pp, TPRank: c.tpRank, PPRank: c.ppRank, DPIndex: c.dp}
		if got, err := metricsPortFor(cfg, c.worker); err != nil || got != c.want {
			t.Errorf("%+v: port %d %v, want %d", c, got, err, c.want)
		}
	}
	t.Setenv(EnvMetricsPort, "x")
	if _, err := metricsPortFor(&Config{}, true); err == nil {
		t.Error("a bad port was accepted")
	}
}

func scrape(t *testing.T, addr string) string {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("GET /metrics: %d %v", resp.StatusCode, err)
	}
	return string(b)
}

// metricValue finds `name{...engine_id="id"...} v` in a scrape.
func metricValue(t *testing.T, text, name, engineID string) float64 {
	t.Helper()
	for _, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(line, name+"{") && strings.Contains(line, `engine_id="`+engineID+`"`) {
			v, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
			if err != nil {
				t.Fatal(err)
			}
			return v
		}
	}
	t.Fatalf("%s{engine_id=%q} not in the scrape:\n%s", name, engineID, text)
	return 0
}

// Live counts move with a READ in flight and return to zero at rest, in
// Live(), through the C-ABI-facing JSON, and on the metrics server.
func TestLiveCountsAndMetricsServer(t *testing.T) {
	port := freePortRun(t, 4) // worker base+rank, scheduler base+world
	t.Setenv(EnvMetricsPort, strconv.Itoa(port))
	t.Setenv(EnvDebugPprof, "1")
	clock, eng, p, d := stuckRead(t, 30, "req-live", "req-dlive")
	// The test creates the prefill's scheduler first: the server takes the
	// scheduler's port (base + world), and every later engine joins it.
	addr := MetricsAddr()
	if addr != fmt.Sprintf("127.0.0.1:%d", port+1) {
		t.Fatalf("metrics server at %q, want port %d", addr, port+1)
	}
	l := d.work.Live()
	if l.TransferHandles != 1 || l.ReceivingRequests != 1 || l.PendingHandshakes != 0 || l.RemoteEngines != 1 {
		t.Fatalf("decode with one READ in flight: %+v", l)
	}
	if pl := p.work.Live(); pl.HeldLeases != 1 {
		t.Fatalf("prefill holding one request's blocks: %+v", pl)
	}
	text := scrape(t, addr)
	if v := metricValue(t, text, "gonixl_live_transfer_handles", "engine-d"); v != 1 {
		t.Fatalf("gauge %v", v)
	}
	if v := metricValue(t, text, "gonixl_held_leases", "engine-p"); v != 1 {
		t.Fatalf("held leases gauge %v", v)
	}
	metricValue(t, text, "gonixl_scheduler_awaiting_kv", "engine-d")
	for _, name := range []string{"go_goroutines ", "process_resident_memory_bytes "} {
		if !strings.Contains(text, "\n"+name) {
			t.Errorf("the scrape lacks the process metric %s", name)
		}
	}
	metricValue(t, text, "gonixl_side_channel_served_total", "engine-p")
	// GONIXL_DEBUG_PPROF=1: goroutine stacks on the same server.
	resp, err := http.Get("http://" + addr + "/debug/pprof/goroutine?debug=2")
	if err != nil {
		t.Fatal(err)
	}
	stacks, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(stacks), "goroutine ") || !strings.Contains(string(stacks), "gonixl/shim") {
		t.Fatalf("pprof goroutine dump: HTTP %d, %d bytes", resp.StatusCode, len(stacks))
	}

	eng.Agent(d.work.agent.Name()).SetScript(nixltest.Script{Polls: 0})
	d.waitFinished(t, "completion", func(f Finished) bool { return contains(f.Recving, "req-dlive") })
	p.waitFinished(t, "prefill release", func(f Finished) bool { return contains(f.Sending, "req-live") })
	_ = clock
	l, pl := d.work.Live(), p.work.Live()
	if l.TransferHandles != 0 || l.ReceivingRequests != 0 || l.PendingHandshakes != 0 || pl.HeldLeases != 0 {
		t.Fatalf("at rest: decode %+v prefill %+v", l, pl)
	}
	b, _ := json.Marshal(l)
	for _, k := range []string{"transfer_handles", "stuck_handles", "held_leases", "pending_handshakes", "remote_engines", "panics", "handshakes_refused"} {
		if !strings.Contains(string(b), `"`+k+`"`) {
			t.Errorf("live JSON %s lacks %q", b, k)
		}
	}
	if v := metricValue(t, scrape(t, addr), "gonixl_live_transfer_handles", "engine-d"); v != 0 {
		t.Fatalf("gauge at rest %v", v)
	}
}

// A READ whose handle the engine will not release (one it cannot cancel)
// fails its request at transfer_timeout (failed_recving, bounded) but
// withholds finished_recving until the handle is released: vLLM keeps the
// blocks of a request not finished receiving, so the blocks the READ may
// still write are never handed back early; the stuck handle is counted.
func TestStuckReleaseHeldUntilReleased(t *testing.T) {
	clock, eng, _, d := stuckRead(t, 3000, "req-stuck", "req-dstuck")
	ag := eng.Agent(d.work.agent.Name())
	ag.SetScript(nixltest.Script{Polls: 1000000, FailStep: nixltest.StepReleaseXfer})
	clock.Advance(1001) // past transfer_timeout
	failedAt := -1
	for i := 0; i < 5; i++ {
		f := d.finished(t)
		if contains(f.Recving, "req-dstuck") {
			t.Fatalf("request reported finished receiving while its READ handle is still live: %+v", f)
		}
		if contains(f.Failed, "req-dstuck") {
			if failedAt >= 0 {
				t.Fatalf("failure reported twice: %+v", f)
			}
			failedAt = i
			if got := d.work.LoadErrors(); len(got) != 1 || got[0] != 9 {
				t.Fatalf("load errors with the failure %v", got)
			}
		}
		clock.Advance(0.5)
	}
	if failedAt != 0 {
		t.Fatalf("failure of the stuck READ reported at poll %d, want at once (transfer_timeout)", failedAt)
	}
	if l := d.work.Live(); l.StuckHandles != 1 || l.TransferHandles != 1 {
		t.Fatalf("live: %+v", l)
	}
	ag.SetScript(nixltest.Script{Polls: 1000000})
	clock.Advance(stuckRetry)
	f := d.waitFinished(t, "report once released", func(f Finished) bool { return contains(f.Recving, "req-dstuck") })
	if contains(f.Failed, "req-dstuck") {
		t.Fatalf("failure reported again at release: %+v", f)
	}
	if got := d.work.LoadErrors(); len(got) != 0 {
		t.Fatalf("load errors again at release %v", got)
	}
	if l := d.work.Live(); l.StuckHandles != 0 || l.TransferHandles != 0 {
		t.Fatalf("live after release: %+v", l)
	}
}

// A panic on a handshake goroutine fails the requests that waited for it,
// is counted, and leaves the worker serving.
func TestHandshakePanicFailsRequestsNotProcess(t *testing.T) {
	eng := nixltest.NewEngine("t")
	p := newSide(t, eng, "kv_producer", "engine-p", nil, 1, nil)
	d := newSide(t, eng, "kv_consumer", "engine-d", nil, 200, nil)
	testPanicHook = func(string) { panic("injected") }
	t.Cleanup(func() { testPanicHook = nil })
	decodeLoad(t, d, "req-panic", prefill(t, p, "p-1", []int64{3}, 8), []int64{9})
	f := d.waitFinished(t, "failure", func(f Finished) bool { return contains(f.Recving, "req-panic") })
	if !contains(f.Failed, "req-panic") {
		t.Fatalf("%+v", f)
	}
	if l := d.work.Live(); l.Panics != 1 || l.PendingHandshakes != 0 {
		t.Fatalf("live after the panic: %+v", l)
	}
	testPanicHook = nil
	decodeLoad(t, d, "req-after", prefill(t, p, "p-2", []int64{4}, 8), []int64{10})
	if f := d.waitFinished(t, "read after the panic", func(f Finished) bool { return contains(f.Recving, "req-after") }); len(f.Failed) != 0 {
		t.Fatalf("%+v", f)
	}
}

// Requests naming unknown engines cannot start handshakes without bound:
// beyond the burst they fail at once, a failed engine/address is
// remembered briefly, and a known engine is not affected.
func TestHandshakeFloodCapped(t *testing.T) {
	eng := nixltest.NewEngine("t")
	p := newSide(t, eng, "kv_producer", "engine-p", nil, 1, nil)
	d := newSide(t, eng, "kv_consumer", "engine-d", nil, 200, nil)
	decodeLoad(t, d, "warm", prefill(t, p, "p-0", []int64{3}, 8), []int64{9})
	d.waitFinished(t, "warm-up read", func(f Finished) bool { return contains(f.Recving, "warm") })

	// A port where nothing listens, as far as the test can arrange:
	// handshakes to it are refused quickly but not instantly.
	dead := freePort(t)
	const n = 3 * handshakeBurst
	start := time.Now()
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("flood-%d", i)
		js := fmt.Sprintf(`{"do_remote_prefill": true, "remote_engine_id": "bogus-%d", "remote_block_ids": [1], "remote_host": "127.0.0.1", "remote_port": %d, "remote_request_id": "x-%d", "tp_size": 1}`, i, dead, i)
		dp := mustParams(t, js)
		if _, err := d.sched.UpdateStateAfterAlloc(ids[i], dp, BlockIDs{{11}}, []int64{0}, tBlockSize); err != nil {
			t.Fatal(err)
		}
	}
	d.step(t)
	if l := d.work.Live(); l.PendingHandshakes > maxPendingHandshakes {
		t.Fatalf("%d handshakes in flight, cap %d", l.PendingHandshakes, maxPendingHandshakes)
	}
	f := d.waitFinished(t, "every flooded request fails", func(f Finished) bool { return len(f.Failed) >= n })
	for _, id := range ids {
		if !contains(f.Failed, id) {
			t.Fatalf("%s not failed: %+v", id, f)
		}
	}
	l := d.work.Live()
	if l.HandshakesRefused < n-handshakeBurst || l.PendingHandshakes != 0 {
		t.Fatalf("live after the flood: %+v", l)
	}
	t.Logf("%d flooded requests failed in %v, %d handshakes refused by the caps", n, time.Since(start), l.HandshakesRefused)

	// The same bogus engine and address again: refused from the failure
	// cache, no new handshake.
	before := l.HandshakesRefused
	dp := mustParams(t, fmt.Sprintf(`{"do_remote_prefill": true, "remote_engine_id": "bogus-0", "remote_block_ids": [1], "remote_host": "127.0.0.1", "remote_port": %d, "remote_request_id": "x-again", "tp_size": 1}`, dead))
	if _, err := d.sched.UpdateStateAfterAlloc("again", dp, BlockIDs{{11}}, []int64{0}, tBlockSize); err != nil {
		t.Fatal(err)
	}
	d.step(t)
	d.waitFinished(t, "cached failure", func(f Finished) bool { return contains(f.Failed, "again") })
	if got := d.work.Live().HandshakesRefused; got != before+1 {
		t.Fatalf("refused %d -> %d, want one more (failure cache)", before, got)
	}
	// The known engine still reads.
	decodeLoad(t, d, "known", prefill(t, p, "p-1", []int64{4}, 8), []int64{10})
	if f := d.waitFinished(t, "known engine", func(f Finished) bool { return contains(f.Recving, "known") }); len(f.Failed) != 0 {
		t.Fatalf("known engine affected by the flood: %+v", f)
	}
}
