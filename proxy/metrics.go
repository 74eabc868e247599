package proxy

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

// Metric names, exported so that clients (the multi-turn benchmark) can read
// them back from /metrics.
const (
	MetricRequests         = "gonixl_proxy_requests_total"
	MetricErrors           = "gonixl_proxy_errors_total"
	MetricInflight         = "gonixl_proxy_inflight_requests"
	MetricUpstreamLatency  = "gonixl_proxy_upstream_latency_seconds"
	MetricUpstreamDuration = "gonixl_proxy_upstream_duration_seconds"
	MetricCacheHits        = "gonixl_proxy_conversation_cache_hits_total"
	MetricCacheMisses      = "gonixl_proxy_conversation_cache_misses_total"
	MetricCacheStale       = "gonixl_proxy_conversation_cache_stale_total"
	MetricCacheEntries     = "gonixl_proxy_conversation_cache_entries"
	MetricStateErrors      = "gonixl_proxy_state_store_errors_total"
	MetricStateSuperseded  = "gonixl_proxy_state_store_superseded_total"
)

// Roles used as the "role" label.
const (
	rolePrefill = "prefill"
	roleDecode  = "decode"
	roleClient  = "client"
)

type metrics struct {
	requests        *prometheus.CounterVec   // route, code
	errors          *prometheus.CounterVec   // role, reason
	inflight        prometheus.Gauge         //
	upstreamLatency *prometheus.HistogramVec // role: request sent → response headers
	upstreamTotal   *prometheus.HistogramVec // role: request sent → body fully read
	cacheHits       prometheus.Counter
	cacheMisses     prometheus.Counter
	cacheStale      prometheus.Counter
	cacheEntries    prometheus.GaugeFunc   // nil for a shared store
	stateErrors     *prometheus.CounterVec // op, reason
	stateSuperseded prometheus.Counter

	// Series resolved once: a vector's label lookup takes a read lock that
	// all requests would share.
	prefillLatency, decodeLatency, prefillTotal, decodeTotal prometheus.Observer
	ok200                                                    map[string]prometheus.Counter // route → requests{code="200"}
}

// countRequest counts a finished client request.
func (m *metrics) countRequest(route string, code int) {
	if c, ok := m.ok200[route]; ok && code == 200 {
		c.Inc()
		return
	}
	m.requests.WithLabelValues(route, strconv.Itoa(code)).Inc()
}

// latencyBuckets spans 0.5 ms (proxy-local fakes) to 10 min (long CPU
// prefills).
var latencyBuckets = []float64{
	0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
	1, 2.5, 5, 10, 30, 60, 120, 300, 600,
}

func newMetrics(reg prometheus.Registerer, cacheLen func() float64) (*metrics, error) {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: MetricRequests,
			Help: "Client requests handled, by route and HTTP status returned to the client.",
		}, []string{"route", "code"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: MetricErrors,
			Help: "Failed requests, by the side that failed (prefill, decode, client) and reason.",
		}, []string{"role", "reason"}),
		inflight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: MetricInflight,
			Help: "Client requests in progress.",
		}),
		upstreamLatency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    MetricUpstreamLatency,
			Help:    "Time from sending an upstream request to receiving its response headers, by role.",
			Buckets: latencyBuckets,
		}, []string{"role"}),
		upstreamTotal: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    MetricUpstreamDuration,
			Help:    "Time from sending an upstream request to the end of its response body, by role.",
			Buckets: latencyBuckets,
		}, []string{"role"}),
		cacheHits: prometheus.NewCounter(prometheus.CounterOpts{
			Name: MetricCacheHits,
			Help: "Multi-turn requests whose conversation had cached decode kv_transfer_params.",
		}),
		cacheMisses: prometheus.NewCounter(prometheus.CounterOpts{
			Name: MetricCacheMisses,
			Help: "Multi-turn requests without usable cached params (no conversation_id, none cached, stale, or oneway mode).",
		}),
		cacheStale: prometheus.NewCounter(prometheus.CounterOpts{
			Name: MetricCacheStale,
			Help: "Cache lookups that found an entry older than the TTL (also counted as misses).",
		}),
		stateErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: MetricStateErrors,
			Help: "Conversation state store calls that failed or timed out, by op (take, put) and reason (timeout, error); each failed take is a full prefill.",
		}, []string{"op", "reason"}),
		stateSuperseded: prometheus.NewCounter(prometheus.CounterOpts{
			Name: MetricStateSuperseded,
			Help: "Decode params not stored because a later turn of the conversation had started.",
		}),
	}
	cs := []prometheus.Collector{m.requests, m.errors, m.inflight, m.upstreamLatency,
		m.upstreamTotal, m.cacheHits, m.cacheMisses, m.cacheStale, m.stateErrors, m.stateSuperseded}
	if cacheLen != nil {
		m.cacheEntries = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: MetricCacheEntries,
			Help: "Conversations with cached decode kv_transfer_params (in-process store).",
		}, cacheLen)
		cs = append(cs, m.cacheEntries)
	}
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	m.prefillLatency, m.decodeLatency = m.upstreamLatency.WithLabelValues(rolePrefill), m.upstreamLatency.WithLabelValues(roleDecode)
	m.prefillTotal, m.decodeTotal = m.upstreamTotal.WithLabelValues(rolePrefill), m.upstreamTotal.WithLabelValues(roleDecode)
	m.ok200 = map[string]prometheus.Counter{}
	for _, route := range []string{"completions", "chat_completions"} {
		m.ok200[route] = m.requests.WithLabelValues(route, "200")
	}
	return m, nil
}
