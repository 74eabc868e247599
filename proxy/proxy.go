package proxy

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// Proxy is the P/D proxy; it is an http.Handler.
type Proxy struct {
	cfg     Config
	clients map[Instance]upstreamClient // one per upstream instance, as the reference's httpx clients
	owned   []*http.Transport           // transports New made, closed by Close
	pools   []*leanPool                 // lean clients New made, closed by Close
	state   StateStore
	cache   *ConversationCache // the in-process store, when it is the one in use
	m       *metrics
	mux     *http.ServeMux
	models  *httputil.ReverseProxy

	prefillRR atomic.Uint64
	decodeRR  atomic.Uint64

	warnNoConvOnce sync.Once
	localState     bool        // the state store is the in-process cache (its calls never wait)
	stateDown      atomic.Bool // the last state store call failed

	pushMu  sync.Mutex
	pushIDs map[Instance]pushIdentity // push mode: what each prefill said it is
}

// New validates cfg and returns a proxy.
func New(cfg Config) (*Proxy, error) {
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("proxy config: %w", err)
	}
	cfg.applyDefaults()
	cfg.Prefill = append([]Instance(nil), cfg.Prefill...)
	cfg.Decode = append([]Instance(nil), cfg.Decode...)
	p := &Proxy{cfg: cfg, clients: make(map[Instance]upstreamClient)}
	// A client per instance: separate connection pools (and pool locks)
	// per upstream. No client-level timeout: a decode stream may legitimately
	// run long; the waits are bounded per phase (see upstreamTimer). The
	// lean client (upstream.go) unless a Transport is injected.
	newRT := func() http.RoundTripper {
		if cfg.Transport != nil {
			return cfg.Transport
		}
		tr := NewTransport(cfg.ConnectTimeout, cfg.UpstreamTimeout)
		tr.IdleConnTimeout = cfg.UpstreamIdleTimeout
		if cfg.DialContext != nil {
			tr.DialContext = cfg.DialContext
		}
		p.owned = append(p.owned, tr)
		return tr
	}
	dial := cfg.DialContext
	if dial == nil {
		dial = (&net.Dialer{Timeout: cfg.ConnectTimeout, KeepAlive: 30 * time.Second}).DialContext
	}
	for _, in := range append(append([]Instance(nil), cfg.Prefill...), cfg.Decode...) {
		if p.clients[in] != nil {
			continue
		}
		if cfg.Transport != nil {
			p.clients[in] = &httpUpstream{base: in.BaseURL(), client: &http.Client{Transport: cfg.Transport}}
			continue
		}
		lp := newLeanPool(in, dial, cfg.UpstreamIdleTimeout)
		p.pools = append(p.pools, lp)
		p.clients[in] = lp
	}
	var cacheLen func() float64
	if cfg.StateStore == nil {
		p.cache = NewConversationCache(cfg.CacheTTL, cfg.MaxConversations, cfg.Clock)
		p.state, p.localState = p.cache, true
		cacheLen = func() float64 { return float64(p.cache.Len()) }
	} else {
		p.state = cfg.StateStore
		p.cache, p.localState = nil, false
		if c, ok := cfg.StateStore.(*ConversationCache); ok {
			p.cache, p.localState = c, true
			cacheLen = func() float64 { return float64(c.Len()) }
		}
	}
	m, err := newMetrics(cfg.Registry, cacheLen)
	if err != nil {
		return nil, fmt.Errorf("proxy metrics: %w", err)
	}
	p.m = m
	p.models = &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			inst := p.nextDecode()
			u, _ := url.Parse(inst.BaseURL()) // BaseURL is always well formed
			pr.SetURL(u)
			pr.Out.URL.Path = "/v1/models"
			pr.Out.URL.RawPath = ""
			p.setAuth(pr.Out.Header, pr.In.Header)
		},
		Transport: newRT(),
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			p.writeFailure(w, r, &upstreamError{role: roleDecode, err: err, reason: reasonOf(r.Context(), err)})
		},
	}

	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, r *http.Request) {
		p.serveCompletion(w, r, "completions", "/completions")
	})
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		p.serveCompletion(w, r, "chat_completions", "/chat/completions")
	})
	mux.HandleFunc("GET /v1/models", p.models.ServeHTTP)
	mux.HandleFunc("GET /healthcheck", p.serveHealthcheck)
	mux.HandleFunc("GET /health", p.serveHealth)
	mux.Handle("GET /metrics", promhttp.HandlerFor(cfg.Registry, promhttp.HandlerOpts{}))
	p.mux = mux
	return p, nil
}

// ServeHTTP implements http.Handler.
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) { p.mux.ServeHTTP(w, r) }

// Close releases the idle upstream connections of the clients New made;
// connections in use are closed when their request ends.
func (p *Proxy) Close() {
	for _, tr := range p.owned {
		tr.CloseIdleConnections()
	}
	for _, lp := range p.pools {
		lp.close()
	}
}

// Cache returns the in-process conversation cache, or nil when the proxy
// keeps its conversation state in another StateStore.
func (p *Proxy) Cache() *ConversationCache { return p.cache }

// State returns the conversation state store in use.
func (p *Proxy) State() StateStore { return p.state }

func (p *Proxy) nextPrefill() Instance {
	return p.cfg.Prefill[(p.prefillRR.Add(1)-1)%uint64(len(p.cfg.Prefill))]
}

func (p *Proxy) nextDecode() Instance {
	return p.cfg.Decode[(p.decodeRR.Add(1)-1)%uint64(len(p.cfg.Decode))]
}

func (p *Proxy) serveHealthcheck(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, map[string]any{
		"status":            "ok",
		"prefill_instances": len(p.cfg.Prefill),
		"decode_instances":  len(p.cfg.Decode),
	})
}

func (p *Proxy) serveHealth(w http.ResponseWriter, _ *http.Request) {
	if p.cache == nil {
		// A shared store expires its own entries and is not counted here.
		writeJSON(w, http.StatusOK, map[string]any{"status": "ok", "state_store": p.state.String()})
		return
	}
	evicted := p.cache.EvictStale()
	writeJSON(w, http.StatusOK, map[string]any{
		"status":               "ok",
		"cached_conversations": p.cache.Len(),
		"evicted_stale":        evicted,
	})
}

// exchange is one client request on its way through the proxy.
type exchange struct {
	w        *statusWriter
	r        *http.Request
	route    string
	endpoint string // "/completions" or "/chat/completions"
	reqID    string
	body     object
	raw      []byte
	base     *zap.Logger
	lg       *zap.Logger // base with the request's fields, made on first use
	// abort, when set, cancels the exchange's upstream requests at once when
	// it ends (push: the decode's request when the prefill's failed).
	abort context.Context
	// prefillDur is the prefill leg (request sent to its body read), once
	// the prefill has answered: sent to the client as Server-Timing.
	prefillDur time.Duration
}

// setServerTiming adds the prefill leg to the response headers
// ("Server-Timing: prefill;dur=<ms>"), so that a client can tell the
// prefill's share of its TTFT (gonixl-bench multiturn reports it per turn).
func (ex *exchange) setServerTiming(h http.Header) {
	if ex.prefillDur > 0 {
		b := make([]byte, 0, 32)
		b = append(b, "prefill;dur="...)
		b = strconv.AppendFloat(b, float64(ex.prefillDur)/float64(time.Millisecond), 'f', 1, 64)
		h["Server-Timing"] = []string{string(b)}
	}
}

// logAt logs with the request's id and route, building the request logger
// only when something is logged.
func (ex *exchange) logAt(lvl zapcore.Level, msg string, fields ...zap.Field) {
	if !ex.base.Core().Enabled(lvl) {
		return
	}
	if ex.lg == nil {
		ex.lg = ex.base.With(zap.String("request_id", ex.reqID), zap.String("route", ex.route))
	}
	if ce := ex.lg.Check(lvl, msg); ce != nil {
		ce.Write(fields...)
	}
}

func (p *Proxy) serveCompletion(w http.ResponseWriter, r *http.Request, route, endpoint string) {
	p.m.inflight.Inc()
	sw := &statusWriter{ResponseWriter: w}
	defer func() {
		p.m.inflight.Dec()
		code := sw.code
		if code == 0 {
			code = 499 // the client went away before a response was written
		}
		p.m.countRequest(route, code)
	}()

	raw, err := readBody(http.MaxBytesReader(sw, r.Body, p.cfg.MaxBodyBytes), r.ContentLength, p.cfg.MaxBodyBytes)
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			p.m.errors.WithLabelValues(roleClient, "bad_request").Inc()
			writeError(sw, http.StatusRequestEntityTooLarge, "invalid_request_error", "request_too_large",
				fmt.Sprintf("request body exceeds %d bytes", mbe.Limit))
			return
		}
		if r.Context().Err() != nil {
			p.m.errors.WithLabelValues(roleClient, "canceled").Inc()
			return
		}
		p.m.errors.WithLabelValues(roleClient, "bad_request").Inc()
		writeError(sw, http.StatusBadRequest, "invalid_request_error", "invalid_body", "reading the request body: "+err.Error())
		return
	}
	body, err := parseObject(raw)
	if err != nil {
		p.m.errors.WithLabelValues(roleClient, "bad_request").Inc()
		writeError(sw, http.StatusBadRequest, "invalid_request_error", "invalid_json",
			"request body is not a JSON object: "+err.Error())
		return
	}
	if r.Context().Err() != nil {
		// Gone before any upstream request: nothing to free anywhere.
		p.m.errors.WithLabelValues(roleClient, "canceled").Inc()
		return
	}
	reqID := r.Header.Get("X-Request-Id")
	if reqID == "" {
		reqID = p.cfg.NewRequestID()
	}
	ex := &exchange{w: sw, r: r, route: route, endpoint: endpoint, reqID: reqID, body: body, raw: raw,
		base: p.cfg.Logger}
	if p.cfg.Mode == ModeMultiturn {
		p.serveMultiturn(ex)
		return
	}
	p.serveToy(ex)
}

// setAuth sets the upstream Authorization header: the configured API key, or
// else the client's own header.
func (p *Proxy) setAuth(h http.Header, client http.Header) {
	switch {
	case p.cfg.APIKey != "":
		h.Set("Authorization", "Bearer "+p.cfg.APIKey)
	case client.Get("Authorization") != "":
		h.Set("Authorization", client.Get("Authorization"))
	default:
		h.Del("Authorization")
	}
}

// send posts body to inst at the exchange's endpoint.
func (p *Proxy) send(ctx context.Context, ex *exchange, inst Instance, body []byte) (*http.Response, error) {
	h := upstreamHeaders{requestID: ex.reqID, authorization: ex.r.Header.Get("Authorization")}
	if p.cfg.APIKey != "" {
		h.authorization = "Bearer " + p.cfg.APIKey
	}
	return p.clients[inst].post(ctx, ex.endpoint, h, body)
}

// errClientGone is the cancellation cause of an upstream request whose client
// went away Config.AbandonGrace earlier.
var errClientGone = errors.New("the client went away")

// upstreamContext is the context of one upstream request of ex. It ends
// Config.AbandonGrace after the client went away (at once in push mode), counted from the call when
// the client has already gone (so a request sent then still reaches vLLM's
// engine, whose connector then gives the prompt's blocks back through its
// own abort path), or at once when ex.abort ends. The caller calls cancel.
func (p *Proxy) upstreamContext(ex *exchange) (context.Context, context.CancelCauseFunc) {
	ctx, cancel := context.WithCancelCause(context.WithoutCancel(ex.r.Context()))
	grace := p.cfg.AbandonGrace
	if p.cfg.Push {
		// A push decode aborted before vLLM gave it blocks has registered
		// nothing and cannot tell the prefill to drop a computed prompt
		// (nor can vLLM's): outliving the client would only let more
		// prefills compute and hold prompts until their lease.
		grace = NoAbandonGrace
	}
	stopClient := context.AfterFunc(ex.r.Context(), func() {
		if grace <= 0 {
			cancel(errClientGone)
			return
		}
		t := time.AfterFunc(grace, func() { cancel(errClientGone) })
		context.AfterFunc(ctx, func() { t.Stop() })
	})
	stopAbort := func() bool { return false }
	if ex.abort != nil {
		stopAbort = context.AfterFunc(ex.abort, func() { cancel(context.Cause(ex.abort)) })
	}
	return ctx, func(err error) {
		stopClient()
		stopAbort()
		cancel(err)
	}
}

// errUpstreamTimeout is the cancellation cause when an upstream wait runs
// past Config.UpstreamTimeout.
var errUpstreamTimeout = errors.New("upstream timeout")

// prefill sends the rewritten request to a prefill instance and returns its
// parsed JSON response.
func (p *Proxy) prefill(ex *exchange, inst Instance, body []byte) (object, *upstreamError) {
	up, upCancel := p.upstreamContext(ex)
	defer upCancel(nil)
	ctx, cancel := context.WithTimeoutCause(up, p.cfg.UpstreamTimeout, errUpstreamTimeout)
	defer cancel()
	fail := func(reason string, err error) *upstreamError {
		return &upstreamError{role: rolePrefill, target: inst.String(), reason: reason, err: err}
	}
	start := time.Now()
	resp, err := p.send(ctx, ex, inst, body)
	if err != nil {
		return nil, fail(reasonOf(ctx, err), err)
	}
	defer resp.Body.Close()
	p.m.prefillLatency.Observe(time.Since(start).Seconds())
	data, err := readBody(io.LimitReader(resp.Body, p.cfg.MaxBodyBytes+1), resp.ContentLength, p.cfg.MaxBodyBytes)
	if err != nil {
		return nil, fail(reasonOf(ctx, err), err)
	}
	ex.prefillDur = time.Since(start)
	p.m.prefillTotal.Observe(ex.prefillDur.Seconds())
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		ue := fail("status", fmt.Errorf("HTTP %d", resp.StatusCode))
		ue.status, ue.body, ue.ctype = resp.StatusCode, data, resp.Header.Get("Content-Type")
		return nil, ue
	}
	if int64(len(data)) > p.cfg.MaxBodyBytes {
		return nil, fail("bad_response", fmt.Errorf("response exceeds %d bytes", p.cfg.MaxBodyBytes))
	}
	o, err := parseObject(data)
	if err != nil {
		return nil, fail("bad_response", fmt.Errorf("response is not a JSON object: %w", err))
	}
	return o, nil
}

// upstreamTimer cancels an upstream request when no progress (response
// headers, then each body read) happens within the timeout.
type upstreamTimer struct {
	t *time.Timer
	d time.Duration
}

func startUpstreamTimer(d time.Duration, cancel context.CancelCauseFunc) *upstreamTimer {
	return &upstreamTimer{t: time.AfterFunc(d, func() { cancel(errUpstreamTimeout) }), d: d}
}

func (u *upstreamTimer) progress() { u.t.Reset(u.d) }
func (u *upstreamTimer) stop()     { u.t.Stop() }

// openDecode sends body to a decode instance and returns the response once its
// headers arrived with a 2xx status. The caller reads and closes the body,
// calls timer.progress() after each read and finally cancel(nil).
func (p *Proxy) openDecode(ex *exchange, inst Instance, body []byte) (*http.Response, context.Context, context.CancelCauseFunc, *upstreamTimer, *upstreamError) {
	ctx, cancel := p.upstreamContext(ex)
	timer := startUpstreamTimer(p.cfg.UpstreamTimeout, cancel)
	fail := func(reason string, err error) *upstreamError {
		timer.stop()
		cancel(nil)
		return &upstreamError{role: roleDecode, target: inst.String(), reason: reason, err: err}
	}
	start := time.Now()
	resp, err := p.send(ctx, ex, inst, body)
	if err != nil {
		return nil, nil, nil, nil, fail(reasonOf(ctx, err), err)
	}
	timer.progress()
	p.m.decodeLatency.Observe(time.Since(start).Seconds())
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		data, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		resp.Body.Close()
		ue := fail("status", fmt.Errorf("HTTP %d", resp.StatusCode))
		ue.status, ue.body, ue.ctype = resp.StatusCode, data, resp.Header.Get("Content-Type")
		return nil, nil, nil, nil, ue
	}
	return resp, ctx, cancel, timer, nil
}

// reasonOf classifies an upstream error.
func reasonOf(ctx context.Context, err error) string {
	if errors.Is(context.Cause(ctx), errUpstreamTimeout) {
		return "timeout"
	}
	if ctx.Err() != nil {
		return "canceled"
	}
	var oe *net.OpError
	if errors.As(err, &oe) && oe.Op == "dial" && oe.Timeout() {
		return "connect_timeout"
	}
	var ne interface{ Timeout() bool }
	if errors.As(err, &ne) && ne.Timeout() {
		return "timeout"
	}
	return "transport"
}

// upstreamError is a failed upstream exchange.
type upstreamError struct {
	role   string
	target string
	reason string // transport, connect_timeout, timeout, canceled, status, bad_response
	err    error
	status int    // upstream HTTP status when reason is "status"
	body   []byte // upstream body when reason is "status"
	ctype  string
}

// writeFailure answers the client for a failed upstream exchange.
func (p *Proxy) writeFailure(w http.ResponseWriter, r *http.Request, ue *upstreamError) {
	log := p.cfg.Logger.With(zap.String("role", ue.role), zap.String("upstream", ue.target),
		zap.String("reason", ue.reason), zap.Error(ue.err))
	if r.Context().Err() != nil {
		// The client went away; the upstream request was canceled with it.
		p.m.errors.WithLabelValues(roleClient, "canceled").Inc()
		log.Debug("client disconnected")
		return
	}
	p.m.errors.WithLabelValues(ue.role, ue.reason).Inc()
	switch {
	case ue.reason == "status" && ue.status >= 400 && ue.status < 500:
		// The client's own error (bad model, bad parameters): relay it.
		log.Info("upstream rejected the request", zap.Int("status", ue.status))
		if ue.ctype != "" {
			w.Header().Set("Content-Type", ue.ctype)
		}
		w.WriteHeader(ue.status)
		_, _ = w.Write(ue.body)
	case ue.reason == "connect_timeout":
		log.Warn("upstream connection timed out")
		writeError(w, http.StatusGatewayTimeout, "upstream_timeout", "upstream_timeout",
			fmt.Sprintf("could not connect to %s instance %s within %v", ue.role, ue.target, p.cfg.ConnectTimeout))
	case ue.reason == "timeout":
		log.Warn("upstream timed out")
		writeError(w, http.StatusGatewayTimeout, "upstream_timeout", "upstream_timeout",
			fmt.Sprintf("%s instance %s did not answer within %v", ue.role, ue.target, p.cfg.UpstreamTimeout))
	case ue.reason == "status":
		log.Warn("upstream failed", zap.Int("status", ue.status), zap.ByteString("body", truncate(ue.body, 512)))
		writeError(w, http.StatusBadGateway, "upstream_error", "upstream_error",
			fmt.Sprintf("%s instance %s returned HTTP %d: %s", ue.role, ue.target, ue.status, truncate(ue.body, 512)))
	default:
		log.Warn("upstream unreachable or invalid")
		writeError(w, http.StatusBadGateway, "upstream_error", "upstream_error",
			fmt.Sprintf("%s instance %s: %v", ue.role, ue.target, ue.err))
	}
}

// readBody reads a whole body, sized up front when its length is known.
// (bytes.Buffer.ReadFrom would grow a buffer of the exact size before its
// first read.)
func readBody(r io.Reader, length, limit int64) ([]byte, error) {
	if length <= 0 || length > limit {
		return io.ReadAll(r)
	}
	b := make([]byte, 0, length+1) // +1: room to see EOF without growing
	for {
		n, err := r.Read(b[len(b):cap(b)])
		b = b[:len(b)+n]
		if err == io.EOF {
			return b, nil
		}
		if err != nil {
			return b, err
		}
		if len(b) == cap(b) { // longer than announced
			b = append(b, 0)[:len(b)]
		}
	}
}

func truncate(b []byte, n int) []byte {
	if len(b) <= n {
		return b
	}
	return b[:n]
}

// errorBody is an OpenAI-style error.
type errorBody struct {
	Error errorDetail `json:"error"`
}

type errorDetail struct {
	Message string `json:"message"`
	Type    string `json:"type"`
	Param   any    `json:"param"`
	Code    any    `json:"code"`
}

func writeError(w http.ResponseWriter, status int, typ string, code any, msg string) {
	writeJSON(w, status, errorBody{Error: errorDetail{Message: msg, Type: typ, Code: code}})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		status, b = http.StatusInternalServerError, []byte(`{"error":{"message":"encoding response failed","type":"internal_error"}}`)
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

// statusWriter records the status code written; Flush and Unwrap keep
// streaming working through it.
type statusWriter struct {
	http.ResponseWriter
	code int
}

func (s *statusWriter) WriteHeader(code int) {
	if s.code == 0 {
		s.code = code
	}
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusWriter) Write(b []byte) (int, error) {
	if s.code == 0 {
		s.code = http.StatusOK
	}
	return s.ResponseWriter.Write(b)
}

func (s *statusWriter) Flush() {
	if f, ok := s.ResponseWriter.(http.Flusher); ok {
		f.Flush()
		return
	}
	_ = http.NewResponseController(s.ResponseWriter).Flush()
}

func (s *statusWriter) Unwrap() http.ResponseWriter { return s.ResponseWriter }

// newUUID returns a random RFC 4122 version 4 UUID, as Python's uuid4().
func newUUID() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails on Linux
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	var out [36]byte
	hex.Encode(out[0:8], b[0:4])
	out[8] = '-'
	hex.Encode(out[9:13], b[4:6])
	out[13] = '-'
	hex.Encode(out[14:18], b[6:8])
	out[18] = '-'
	hex.Encode(out[19:23], b[8:10])
	out[23] = '-'
	hex.Encode(out[24:36], b[10:16])
	return string(out[:])
}
