package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// Mode selects the proxy's behaviour.
type Mode int

const (
	// ModeToy is toy_proxy_server.py's behaviour.
	ModeToy Mode = iota
	// ModeMultiturn is disagg_proxy_multiturn.py's behaviour.
	ModeMultiturn
)

func (m Mode) String() string {
	switch m {
	case ModeToy:
		return "toy"
	case ModeMultiturn:
		return "multiturn"
	}
	return "Mode(" + strconv.Itoa(int(m)) + ")"
}

// ReuseMode says whether the multi-turn proxy hands a decode instance's
// blocks back to the prefill instance on the next turn.
type ReuseMode string

const (
	// ReuseBidirectional caches the decode instance's kv_transfer_params per
	// conversation and sends them to the prefill instance on the next turn.
	ReuseBidirectional ReuseMode = "bidirectional"
	// ReuseOneway only moves KV from prefill to decode: nothing is cached and
	// every turn is a miss.
	ReuseOneway ReuseMode = "oneway"
)

// DefaultUpstreamIdleTimeout keeps idle upstream connections for less than
// vLLM's HTTP keep-alive timeout (5 s), so the proxy never reuses one the
// server is about to close.
const DefaultUpstreamIdleTimeout = 4 * time.Second

// DefaultAbandonGrace: see Config.AbandonGrace. Long enough for vLLM's API
// server to hand a request it has read to its engine.
const DefaultAbandonGrace = 2 * time.Second

// NoAbandonGrace, as Config.AbandonGrace, cancels the upstream requests as
// soon as the client goes away.
const NoAbandonGrace time.Duration = -1

// DefaultCacheTTL is the lifetime of a conversation's cached decode params:
// the decode side's decoder_kv_blocks_ttl default (vLLM's and gonixl's,
// 480 s), the time the decode holds the blocks those params name. An entry
// is stored a moment after the decode started holding; the prefill checks
// the decode's own expiry in the params (gonixl_expiry_unix, vLLM's
// remote_blocks_expiry_time) and computes the prompt when it has passed.
const DefaultCacheTTL = 480 * time.Second

// Instance is one vLLM OpenAI server.
type Instance struct {
	Host string
	Port int
}

// BaseURL is the instance's OpenAI API root, "http://host:port/v1".
func (i Instance) BaseURL() string {
	return "http://" + net.JoinHostPort(i.Host, strconv.Itoa(i.Port)) + "/v1"
}

func (i Instance) String() string { return net.JoinHostPort(i.Host, strconv.Itoa(i.Port)) }

// Pair zips host and port lists the way the reference proxies do; the counts
// must match.
func Pair(role string, hosts []string, ports []int) ([]Instance, error) {
	if len(hosts) != len(ports) {
		return nil, fmt.Errorf("number of %s hosts (%d) must match number of %s ports (%d)",
			role, len(hosts), role, len(ports))
	}
	out := make([]Instance, len(hosts))
	for i := range hosts {
		out[i] = Instance{Host: hosts[i], Port: ports[i]}
	}
	return out, nil
}

// Config configures a Proxy. Zero values get the documented defaults.
type Config struct {
	Mode    Mode
	Prefill []Instance
	Decode  []Instance

	// APIKey, when non-empty, is sent upstream as "Authorization: Bearer
	// <APIKey>" (the reference proxies read OPENAI_API_KEY). When empty, a
	// client's own Authorization header is forwarded.
	APIKey string

	// Multi-turn options.
	ReuseMode             ReuseMode     // default ReuseBidirectional
	RequireConversationID bool          // reject requests without conversation_id (400)
	CacheTTL              time.Duration // default DefaultCacheTTL
	MaxConversations      int           // in-process cache bound; default 1 << 20
	// StateStore keeps the conversations' decode params between turns; nil
	// means an in-process ConversationCache (CacheTTL, MaxConversations,
	// Clock). A store shared by several proxies (proxy/redisstate) lets a
	// conversation's turns go through any of them.
	StateStore StateStore
	// StateTimeout bounds each call to a StateStore other than a
	// ConversationCache (default DefaultStateTimeout). A call that fails or
	// takes longer makes the turn a full prefill, never a client error.
	StateTimeout time.Duration

	// ConnectTimeout bounds TCP connection set-up to an upstream (default 5 s).
	ConnectTimeout time.Duration
	// UpstreamTimeout bounds the wait for an upstream's response headers, and
	// the whole prefill exchange (default 300 s). A decode stream that has
	// started may run longer.
	UpstreamTimeout time.Duration
	// MaxBodyBytes bounds request and prefill-response bodies (default 64 MiB).
	MaxBodyBytes int64
	// UpstreamIdleTimeout is how long an idle keep-alive connection to an
	// upstream is kept for reuse (default DefaultUpstreamIdleTimeout). It
	// must stay below the upstream's own keep-alive timeout (vLLM's HTTP
	// server closes idle connections after 5 s, VLLM_HTTP_TIMEOUT_KEEP_ALIVE):
	// reusing a connection the server is closing fails the request with
	// "connection reset by peer".
	UpstreamIdleTimeout time.Duration
	// AbandonGrace is how long an upstream request outlives its client
	// (default DefaultAbandonGrace; NoAbandonGrace cancels it at once, as
	// vLLM's toy proxy does). A prefill that answers within it has its
	// decode request sent all the same, so that the decode's connector
	// takes the prompt's blocks or, once cancelled, tells the prefill to
	// free them: a prefill whose decode never hears of the request holds
	// the blocks until their lease ends. Not in push mode, which cancels at
	// once: a push decode aborted before it had blocks cannot tell the
	// prefill to drop a computed prompt.
	AbandonGrace time.Duration

	// Push: the instances run vLLM's push connector (NixlPushConnector or
	// GoNixlPushConnector): once a prefill's identity is known (its first
	// answer), the prefill and decode requests are sent at once, tied by
	// one X-Request-Id (push.go). In multi-turn mode only with ReuseOneway.
	Push bool

	// ForwardClientKVParams lets a client's own kv_transfer_params reach a
	// decode instance when the prefill instance returned none. Off by
	// default: those parameters name remote engines, addresses and block
	// ids, and a client must not be able to point a decode at them.
	ForwardClientKVParams bool

	// Transport, when set, replaces the lean upstream client of the
	// completion requests (upstream.go) by net/http with this transport
	// (tests, comparisons); GET /v1/models always goes through net/http.
	Transport http.RoundTripper
	// DialContext, when set, opens the upstream connections (tests); nil
	// means a net.Dialer with ConnectTimeout.
	DialContext func(ctx context.Context, network, addr string) (net.Conn, error)
	// Registry receives the proxy's metrics; nil means a private registry.
	// /metrics serves this registry.
	Registry *prometheus.Registry
	// Logger; nil means no logging.
	Logger *zap.Logger
	// Clock returns the current time; nil means time.Now. The conversation
	// cache reads time only through it.
	Clock func() time.Time
	// NewRequestID makes the X-Request-Id for a client request that has none;
	// nil means a random UUID v4.
	NewRequestID func() string
}

func (c *Config) validate() error {
	var errs []error
	if len(c.Prefill) == 0 {
		errs = append(errs, errors.New("at least one prefill instance is required"))
	}
	if len(c.Decode) == 0 {
		errs = append(errs, errors.New("at least one decode instance is required"))
	}
	for _, set := range []struct {
		role string
		list []Instance
	}{{"prefill", c.Prefill}, {"decode", c.Decode}} {
		for _, in := range set.list {
			if in.Host == "" {
				errs = append(errs, fmt.Errorf("%s instance %s: empty host", set.role, in))
			}
			if in.Port <= 0 || in.Port > 65535 {
				errs = append(errs, fmt.Errorf("%s instance %s: port %d out of range 1..65535", set.role, in, in.Port))
			}
		}
	}
	if c.Push && c.Mode == ModeMultiturn && c.ReuseMode != ReuseOneway {
		errs = append(errs, errors.New("push with the multi-turn proxy needs reuse mode oneway (vLLM's push connector refuses bidirectional transfer)"))
	}
	if c.Mode != ModeToy && c.Mode != ModeMultiturn {
		errs = append(errs, fmt.Errorf("unknown mode %d", int(c.Mode)))
	}
	switch c.ReuseMode {
	case "", ReuseBidirectional, ReuseOneway:
	default:
		errs = append(errs, fmt.Errorf("reuse mode %q: want %q or %q", c.ReuseMode, ReuseOneway, ReuseBidirectional))
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"cache TTL", c.CacheTTL}, {"connect timeout", c.ConnectTimeout}, {"upstream timeout", c.UpstreamTimeout}, {"upstream idle timeout", c.UpstreamIdleTimeout}, {"state timeout", c.StateTimeout}} {
		if d.v < 0 {
			errs = append(errs, fmt.Errorf("%s %v is negative", d.name, d.v))
		}
	}
	if c.AbandonGrace < 0 && c.AbandonGrace != NoAbandonGrace {
		errs = append(errs, fmt.Errorf("abandon grace %v is negative", c.AbandonGrace))
	}
	if c.MaxBodyBytes < 0 || c.MaxConversations < 0 {
		errs = append(errs, errors.New("max body bytes and max conversations must not be negative"))
	}
	return errors.Join(errs...)
}

func (c *Config) applyDefaults() {
	if c.ReuseMode == "" {
		c.ReuseMode = ReuseBidirectional
	}
	if c.CacheTTL == 0 {
		c.CacheTTL = DefaultCacheTTL
	}
	if c.MaxConversations == 0 {
		c.MaxConversations = 1 << 20
	}
	if c.StateTimeout == 0 {
		c.StateTimeout = DefaultStateTimeout
	}
	if c.ConnectTimeout == 0 {
		c.ConnectTimeout = 5 * time.Second
	}
	if c.UpstreamTimeout == 0 {
		c.UpstreamTimeout = 300 * time.Second
	}
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = 64 << 20
	}
	if c.UpstreamIdleTimeout == 0 {
		c.UpstreamIdleTimeout = DefaultUpstreamIdleTimeout
	}
	if c.AbandonGrace == 0 {
		c.AbandonGrace = DefaultAbandonGrace
	}
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	if c.Clock == nil {
		c.Clock = time.Now
	}
	if c.NewRequestID == nil {
		c.NewRequestID = newUUID
	}
	if c.Registry == nil {
		c.Registry = prometheus.NewRegistry()
	}
}

// NewTransport returns the upstream transport the proxy uses by default:
// keep-alive connections without a per-host idle cap (as the reference's
// unlimited httpx pools), bounded connection set-up and header waits.
func NewTransport(connectTimeout, headerTimeout time.Duration) *http.Transport {
	d := &net.Dialer{Timeout: connectTimeout, KeepAlive: 30 * time.Second}
	return &http.Transport{
		Proxy:                 nil, // never route upstream traffic through an environment proxy
		DialContext:           d.DialContext,
		MaxIdleConns:          0,
		MaxIdleConnsPerHost:   4096,
		IdleConnTimeout:       DefaultUpstreamIdleTimeout,
		ResponseHeaderTimeout: headerTimeout,
		DisableCompression:    true,
		ForceAttemptHTTP2:     false,
	}
}
