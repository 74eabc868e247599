package shim

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"
)

// Live counts: what an engine holds right now. At rest (no request in
// flight, every lease ended) each is zero but RemoteEngines, so a soak can
// tell a leak from load. The same numbers are gauges in gonixl's Prometheus
// registry and come through the C ABI (gonixl_worker_live,
// gonixl_scheduler_live).

// WorkerLive is a worker's live state.
type WorkerLive struct {
	TransferHandles   int   `json:"transfer_handles"`   // READ handles posted and not yet released
	StuckHandles      int   `json:"stuck_handles"`      // of those, handles the engine refused to release (their requests failed, blocks held)
	ReceivingRequests int   `json:"receiving_requests"` // requests with READs in flight or waiting for a handshake
	HeldLeases        int   `json:"held_leases"`        // requests whose blocks this prefill holds for a reader
	PendingHandshakes int   `json:"pending_handshakes"` // handshakes started and not finished
	RemoteEngines     int   `json:"remote_engines"`     // handshaken remote engines (a cache, not a leak)
	Panics            int64 `json:"panics"`             // panics recovered on background goroutines
	HandshakesRefused int64 `json:"handshakes_refused"` // new handshakes refused by the caps or the failure cache
	// Push mode: a prefill's pushes not yet ended (blocks held or a WRITE
	// in flight) and registrations waiting for their request; a decode's
	// requests whose blocks are held after a failure until no WRITE can
	// land (push_recv.go).
	PushSends         int   `json:"push_sends"`
	PushRegistrations int   `json:"push_registrations"`
	PushHeldRequests  int   `json:"push_held_requests"`
	PushHoldsTotal    int64 `json:"push_holds_total"` // requests ever held so (a counter)
}

// Live returns the worker's live counts.
func (w *Worker) Live() WorkerLive {
	defer w.lockTimed("live counts")()
	l := WorkerLive{
		ReceivingRequests: len(w.recv),
		PendingHandshakes: len(w.handshakes),
		RemoteEngines:     len(w.remotes),
		Panics:            w.panics.Load(),
		HandshakesRefused: w.hsGuard.refused,
	}
	count := func(xs []*inflight) {
		l.TransferHandles += len(xs)
		for _, f := range xs {
			if f.stuck > 0 {
				l.StuckHandles++
			}
		}
	}
	for _, st := range w.recv {
		count(st.xfers)
		if st.push != nil && st.push.state == pushHolding {
			l.PushHeldRequests++
		}
	}
	for _, ps := range w.push.sends {
		count(ps.xfers)
	}
	l.PushSends = len(w.push.sends) + len(w.push.earlyDone)
	l.PushRegistrations = len(w.push.regs)
	l.PushHoldsTotal = w.pushHolds.Load()
	held := make(map[string]struct{}, w.held.Len()+len(w.toProcess))
	for _, id := range w.held.IDs() {
		held[id] = struct{}{}
	}
	for id := range w.toProcess {
		held[id] = struct{}{}
	}
	l.HeldLeases = len(held)
	return l
}

// SchedulerLive is the scheduler side's live state.
type SchedulerLive struct {
	AwaitingKV         int   `json:"awaiting_kv"`          // requests whose KV is to be read from a remote engine
	SendPending        int   `json:"send_pending"`         // finished requests whose blocks wait for a reader (not yet handed to the worker)
	HeartbeatLeases    int   `json:"heartbeat_leases"`     // remote leases this decode keeps alive with heartbeats
	SideChannelServed  int64 `json:"side_channel_served"`  // handshake requests answered
	SideChannelRefused int64 `json:"side_channel_refused"` // refused: malformed, unauthenticated, over limits
	// PreemptionsDeferred: push mode, a prefill: times vLLM was about to
	// preempt a request for room and waited a step instead, because a
	// prompt announced for an early WRITE was not finished.
	PreemptionsDeferred int64 `json:"preemptions_deferred"`
}

// Live returns the scheduler's live counts.
func (s *Scheduler) Live() SchedulerLive {
	s.mu.Lock()
	defer s.mu.Unlock()
	l := SchedulerLive{AwaitingKV: len(s.reqsNeedRecv), SendPending: len(s.reqsNeedSend), PreemptionsDeferred: s.preemptionsDeferred}
	for _, t := range s.hbByEngine {
		l.HeartbeatLeases += len(t.ids)
	}
	if s.listener != nil {
		l.SideChannelServed, l.SideChannelRefused = s.listener.Counts()
	}
	return l
}

// newSchedulerRegistry is a scheduler's registry: its live gauges.
func newSchedulerRegistry(engineID string, live func() SchedulerLive) *prometheus.Registry {
	reg := prometheus.NewRegistry()
	labels := prometheus.Labels{"engine_id": engineID}
	g := func(name, help string, f func(SchedulerLive) float64) {
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: labels},
			func() float64 { return f(live()) }))
	}
	g("gonixl_scheduler_awaiting_kv", "Requests the scheduler waits on for remote KV.", func(l SchedulerLive) float64 { return float64(l.AwaitingKV) })
	g("gonixl_scheduler_send_pending", "Finished requests whose blocks wait for a reader, not yet handed to the worker.", func(l SchedulerLive) float64 { return float64(l.SendPending) })
	g("gonixl_scheduler_heartbeat_leases", "Remote leases this decode keeps alive with heartbeats.", func(l SchedulerLive) float64 { return float64(l.HeartbeatLeases) })
	c := func(name, help string, f func(SchedulerLive) float64) {
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: labels},
			func() float64 { return f(live()) }))
	}
	c("gonixl_side_channel_served_total", "Side-channel handshake requests answered.", func(l SchedulerLive) float64 { return float64(l.SideChannelServed) })
	c("gonixl_scheduler_preemptions_deferred_total", "Push mode, a prefill: times vLLM was about to preempt a request to make room and waited a step instead (has_pending_block_frees), because a prompt announced for an early WRITE was not finished.",
		func(l SchedulerLive) float64 { return float64(l.PreemptionsDeferred) })
	c("gonixl_side_channel_refused_total", "Side-channel requests refused: malformed frames, failed authentication, limits.", func(l SchedulerLive) float64 { return float64(l.SideChannelRefused) })
	return reg
}

// registerLive adds the worker's live gauges to its registry.
func (m *promMetrics) registerLive(engineID string, live func() WorkerLive) {
	labels := prometheus.Labels{"engine_id": engineID}
	g := func(name, help string, f func(WorkerLive) float64) {
		m.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: labels},
			func() float64 { return f(live()) }))
	}
	g("gonixl_live_transfer_handles", "READ and WRITE handles posted and not yet released.", func(l WorkerLive) float64 { return float64(l.TransferHandles) })
	g("gonixl_stuck_transfer_handles", "Transfer handles the engine would not release: their requests failed, their blocks stay held until it does.", func(l WorkerLive) float64 { return float64(l.StuckHandles) })
	g("gonixl_push_sends", "Push mode, a prefill: requests whose push has not ended (blocks held for a registration or a WRITE in flight).", func(l WorkerLive) float64 { return float64(l.PushSends) })
	g("gonixl_push_registrations", "Push mode, a prefill: decode registrations waiting for their request.", func(l WorkerLive) float64 { return float64(l.PushRegistrations) })
	g("gonixl_push_held_requests", "Push mode, a decode: failed requests whose blocks stay held until no WRITE from the prefill can land in them.", func(l WorkerLive) float64 { return float64(l.PushHeldRequests) })
	g("gonixl_receiving_requests", "Requests whose KV is being read (READs in flight or waiting for a handshake).", func(l WorkerLive) float64 { return float64(l.ReceivingRequests) })
	g("gonixl_held_leases", "Requests whose blocks this engine holds for a remote reader (until notified or the lease ends).", func(l WorkerLive) float64 { return float64(l.HeldLeases) })
	g("gonixl_pending_handshakes", "Side-channel handshakes started and not finished.", func(l WorkerLive) float64 { return float64(l.PendingHandshakes) })
	g("gonixl_remote_engines", "Remote engines with a loaded agent and prepared descriptors.", func(l WorkerLive) float64 { return float64(l.RemoteEngines) })
	m.reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "gonixl_push_holds_total",
		Help: "Push mode, a decode: failed requests whose blocks were held after the failure until no WRITE from the prefill could land in them.", ConstLabels: labels},
		func() float64 { return float64(live().PushHoldsTotal) }))
	m.reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "gonixl_handshakes_refused_total",
		Help: "New handshakes refused by the count or rate cap, or because the same engine and address failed moments ago.", ConstLabels: labels},
		func() float64 { return float64(live().HandshakesRefused) }))
	m.reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "gonixl_background_panics_total",
		Help: "Panics recovered on gonixl's background goroutines (each failed the work it was doing).", ConstLabels: labels},
		func() float64 { return float64(live().Panics) }))
}

// The metrics server: with GONIXL_METRICS_PORT set, each process that holds
// a gonixl engine serves its registries at http://<host>:<port>/metrics,
// host GONIXL_METRICS_HOST (default 127.0.0.1). A worker listens on
// port + dp_index*(world+1) + its rank (world = tp_size*pp_size, rank =
// pp_rank*tp_size + tp_rank); the scheduler on port + dp_index*(world+1) +
// world. An engine created in a process that already serves joins that
// server (vLLM's in-process executor creates the worker first, so both are
// then on the worker's port).
//
// With GONIXL_DEBUG_PPROF=1 the same server also serves Go's profiles at
// /debug/pprof/ (goroutine stacks: /debug/pprof/goroutine?debug=2), for an
// operator looking at a stuck or slow process. Off by default: the stacks
// name requests and peers.
const (
	EnvMetricsPort = "GONIXL_METRICS_PORT"
	EnvMetricsHost = "GONIXL_METRICS_HOST"
	EnvDebugPprof  = "GONIXL_DEBUG_PPROF"
)

var metricsSrv struct {
	sync.Mutex
	addr string
	srv  *http.Server
	regs map[*prometheus.Registry]struct{}
	proc *prometheus.Registry // the process: go_goroutines, process_resident_memory_bytes, ...
}

// metricsPortFor returns the port an engine of cfg listens on, 0 when the
// server is off.
func metricsPortFor(cfg *Config, worker bool) (int, error) {
	v := os.Getenv(EnvMetricsPort)
	if v == "" {
		return 0, nil
	}
	base, err := strconv.Atoi(v)
	if err != nil || base <= 0 || base > 65535 {
		return 0, fmt.Errorf("%s=%q: want a port number", EnvMetricsPort, v)
	}
	tp, pp := max(cfg.TPSize, 1), max(cfg.PPSize, 1)
	world := tp * pp
	off := cfg.DPIndex * (world + 1)
	if worker {
		off += cfg.PPRank*tp + cfg.TPRank
	} else {
		// The scheduler's own port: vLLM usually runs it in a process of
		// its own (EngineCore; on CPU even at TP = PP = 1). When a worker
		// in its process already serves, it joins that server instead.
		off += world
	}
	if base+off > 65535 {
		return 0, fmt.Errorf("%s=%d: port %d for this engine is out of range", EnvMetricsPort, base, base+off)
	}
	return base + off, nil
}

// gatherAll merges every registered registry of this process.
var gatherAll = prometheus.GathererFunc(func() ([]*dto.MetricFamily, error) {
	metricsSrv.Lock()
	gs := make(prometheus.Gatherers, 0, len(metricsSrv.regs)+1)
	if metricsSrv.proc != nil {
		gs = append(gs, metricsSrv.proc)
	}
	for r := range metricsSrv.regs {
		gs = append(gs, r)
	}
	metricsSrv.Unlock()
	return gs.Gather()
})

// serveMetrics registers reg (a worker's or a scheduler's registry) with
// the process's metrics server, starting it when none runs. Errors are
// logged, never fatal: metrics must not stop serving.
func serveMetrics(cfg *Config, reg *prometheus.Registry, worker bool, log *zap.Logger) {
	port, err := metricsPortFor(cfg, worker)
	if err != nil {
		log.Warn("metrics server disabled", zap.Error(err))
		return
	}
	if port == 0 {
		return
	}
	metricsSrv.Lock()
	defer metricsSrv.Unlock()
	if metricsSrv.regs == nil {
		metricsSrv.regs = map[*prometheus.Registry]struct{}{}
	}
	metricsSrv.regs[reg] = struct{}{}
	if metricsSrv.srv != nil {
		return
	}
	host := os.Getenv(EnvMetricsHost)
	if host == "" {
		host = "127.0.0.1"
	}
	addr := net.JoinHostPort(host, strconv.Itoa(port))
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		if errors.Is(err, syscall.EADDRINUSE) {
			err = fmt.Errorf("%w (another process of this engine, or something else, holds it; see %s in docs/ENVIRONMENT.md)", err, EnvMetricsPort)
		}
		log.Warn("metrics server not started", zap.String("addr", addr), zap.Error(err))
		return
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(gatherAll, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError}))
	if os.Getenv(EnvDebugPprof) == "1" {
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	}
	// WriteTimeout bounds the whole answer (gathering included): a process
	// starved of CPU for tens of seconds, as vLLM's on a loaded host can be,
	// still answers a scrape that waits rather than closing it unanswered.
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 10 * time.Second,
		WriteTimeout: 60 * time.Second, IdleTimeout: 30 * time.Second, MaxHeaderBytes: 16 << 10}
	metricsSrv.srv, metricsSrv.addr = srv, ln.Addr().String()
	if metricsSrv.proc == nil {
		proc := prometheus.NewRegistry()
		proc.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
		metricsSrv.proc = proc
	}
	go func() {
		defer func() { _ = recover() }() // never take the host process down
		_ = srv.Serve(ln)
	}()
	log.Info("gonixl metrics served", zap.String("url", "http://"+metricsSrv.addr+"/metrics"))
}

// unserveMetrics removes reg; the server stops with the last one.
func unserveMetrics(reg *prometheus.Registry) {
	metricsSrv.Lock()
	defer metricsSrv.Unlock()
	delete(metricsSrv.regs, reg)
	if metricsSrv.srv != nil && len(metricsSrv.regs) == 0 {
		_ = metricsSrv.srv.Close()
		metricsSrv.srv, metricsSrv.addr = nil, ""
	}
}

// MetricsAddr is the metrics server's address in this process, "" when none
// runs (tests, logs).
func MetricsAddr() string {
	metricsSrv.Lock()
	defer metricsSrv.Unlock()
	return metricsSrv.addr
}
