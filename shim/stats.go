package shim

import (
	"bytes"
	"encoding/json"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"
)

// Stats accumulates what vLLM's NixlKVConnectorStats holds between two
// collections: per-transfer lists and one entry per failure event. The keys
// of Data are vLLM's, so its reduce() prints the same "KV Transfer metrics"
// line.
type Stats struct {
	mu   sync.Mutex
	data map[string][]float64
	prom *promMetrics
}

var statKeys = []string{
	"transfer_duration", "post_duration", "bytes_transferred", "num_descriptors",
	"num_failed_transfers", "num_failed_notifications", "num_failed_handshakes",
	"num_kv_expired_reqs", "num_notifications_after_expiry",
}

func newStats(prom *promMetrics) *Stats {
	s := &Stats{prom: prom}
	s.reset()
	return s
}

func (s *Stats) reset() {
	s.data = make(map[string][]float64, len(statKeys))
	for _, k := range statKeys {
		s.data[k] = []float64{}
	}
}

func (s *Stats) add(key string, v float64) {
	s.mu.Lock()
	s.data[key] = append(s.data[key], v)
	s.mu.Unlock()
}

// RecordTransfer records one finished transfer.
func (s *Stats) RecordTransfer(xferSec, postSec float64, bytes uint64, descs int) {
	s.mu.Lock()
	s.data["transfer_duration"] = append(s.data["transfer_duration"], xferSec)
	s.data["post_duration"] = append(s.data["post_duration"], postSec)
	s.data["bytes_transferred"] = append(s.data["bytes_transferred"], float64(bytes))
	s.data["num_descriptors"] = append(s.data["num_descriptors"], float64(descs))
	s.mu.Unlock()
	s.prom.xferTime.Observe(xferSec)
	s.prom.postTime.Observe(postSec)
	s.prom.bytes.Observe(float64(bytes))
	s.prom.descs.Observe(float64(descs))
}

func (s *Stats) RecordFailedTransfer()  { s.add("num_failed_transfers", 1); s.prom.failedXfers.Inc() }
func (s *Stats) RecordFailedHandshake() { s.add("num_failed_handshakes", 1); s.prom.failedXfers.Inc() }
func (s *Stats) RecordKVExpired()       { s.add("num_kv_expired_reqs", 1); s.prom.expired.Inc() }
func (s *Stats) RecordNotifAfterExpiry() {
	s.add("num_notifications_after_expiry", 1)
	s.prom.afterExpiry.Inc()
}
func (s *Stats) RecordFailedNotification() {
	s.add("num_failed_notifications", 1)
	s.prom.failedNotifs.Inc()
	s.prom.failedXfers.Inc()
}

// Pending reports whether Take has data to return.
func (s *Stats) Pending() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, v := range s.data {
		if len(v) > 0 {
			return true
		}
	}
	return false
}

// Take returns the accumulated data as JSON (vLLM's data dict) and resets
// it, or nil when nothing happened since the last call.
func (s *Stats) Take() []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	empty := true
	for _, v := range s.data {
		if len(v) > 0 {
			empty = false
			break
		}
	}
	if empty {
		return nil
	}
	b, _ := json.Marshal(s.data) // map of float slices: cannot fail
	s.reset()
	return b
}

// promMetrics mirrors vLLM's NixlPromMetrics in gonixl's own registry.
type promMetrics struct {
	reg                                             *prometheus.Registry
	xferTime, postTime, bytes, descs                prometheus.Histogram
	failedXfers, failedNotifs, expired, afterExpiry prometheus.Counter
	// KV digests (kvdigest.go): requests whose read KV differed from the
	// prefill's digests, blocks checked, requests read unchecked.
	digestMismatch, digestChecked, digestUnchecked prometheus.Counter
}

func newPromMetrics(engineID string) *promMetrics {
	labels := prometheus.Labels{"engine_id": engineID}
	postBuckets := []float64{0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0}
	byteBuckets := make([]float64, 0, 12)
	for i := 1; i < 25; i += 2 {
		byteBuckets = append(byteBuckets, float64(uint64(1)<<(10+i)))
	}
	m := &promMetrics{reg: prometheus.NewRegistry()}
	h := func(name, help string, buckets []float64) prometheus.Histogram {
		x := prometheus.NewHistogram(prometheus.HistogramOpts{Name: name, Help: help, Buckets: buckets, ConstLabels: labels})
		m.reg.MustRegister(x)
		return x
	}
	c := func(name, help string) prometheus.Counter {
		x := prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: labels})
		m.reg.MustRegister(x)
		return x
	}
	m.xferTime = h("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV Cache transfers.", postBuckets[1:])
	m.postTime = h("vllm:nixl_post_time_seconds", "Histogram of transfer post time for NIXL KV Cache transfers.", postBuckets)
	m.bytes = h("vllm:nixl_bytes_transferred", "Histogram of bytes transferred per NIXL KV Cache transfers.", byteBuckets)
	m.descs = h("vllm:nixl_num_descriptors", "Histogram of number of descriptors per NIXL KV Cache transfers.",
		[]float64{10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000})
	m.failedXfers = c("vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers, including handshake and notification failures.")
	m.failedNotifs = c("vllm:nixl_num_failed_notifications", "Number of failed NIXL KV Cache notifications.")
	m.expired = c("vllm:nixl_num_kv_expired_reqs", "Number of requests that had their KV expire.")
	m.afterExpiry = c("vllm:nixl_num_notifications_after_expiry", "Number of completion notifications for requests that were no longer tracked.")
	m.digestMismatch = c("gonixl_kv_digest_mismatches_total", "Requests whose KV read from a prefill differed from the prefill's digests of it (kv_digest).")
	m.digestChecked = c("gonixl_kv_digest_checked_blocks_total", "KV blocks read and checked against the prefill's digests.")
	m.digestUnchecked = c("gonixl_kv_digest_unchecked_total", "Requests whose KV was read unchecked: kv_digest off here, a prefill that sent no digests, or a layout the digests do not follow.")
	return m
}

// Text renders the registry in the Prometheus text exposition format.
func (m *promMetrics) Text() ([]byte, error) {
	mfs, err := m.reg.Gather()
	if err != nil {
		return nil, err
	}
	var buf bytes.Buffer
	enc := expfmt.NewEncoder(&buf, expfmt.NewFormat(expfmt.TypeTextPlain))
	for _, mf := range mfs {
		if err := enc.Encode(mf); err != nil {
			return nil, err
		}
	}
	return buf.Bytes(), nil
}
