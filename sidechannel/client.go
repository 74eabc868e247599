package sidechannel

import (
	"context"
	"crypto/hmac"
	"errors"
	"fmt"
	"math"
	"net"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"go.uber.org/zap"
)

// ClientConfig configures the worker-side handshake client.
type ClientConfig struct {
	// CompatHash is this engine's compatibility hash (CompatibilityHash).
	CompatHash string
	// AllowCompatMismatch is kv_connector_extra_config
	// enforce_handshake_compat=false: a hash mismatch is logged, not fatal.
	AllowCompatMismatch bool
	// CompatHints explains known remote hashes that differ from CompatHash
	// (e.g. the hash this engine would have with another transfer engine):
	// a mismatch with one of them says why in one line.
	CompatHints map[string]string
	Secret      []byte // optional shared secret

	RecvTimeout  time.Duration // per query (connect + reply), default 5 s
	Timeout      time.Duration // whole handshake, default 30 s
	MaxFrameSize int           // default DefaultMaxFrameSize
	Clock        func() float64
	Logger       *zap.Logger
}

// Result is a completed handshake. It is shared by every caller that joined
// the same handshake and must not be modified.
type Result struct {
	Agents map[Rank]*AgentMetadata
	// ClockOffset is remote clock minus local clock, in seconds, from the
	// lowest-RTT sample: remote - (t_send + t_recv)/2.
	ClockOffset float64
	BestRTT     time.Duration
}

// Sentinel errors; the concrete errors wrap them.
var (
	ErrCompatMismatch = errors.New("sidechannel: NIXL compatibility hash mismatch")
	ErrEngineMismatch = errors.New("sidechannel: remote NIXL agent engine ID mismatch")
	ErrTimeout        = errors.New("sidechannel: handshake timed out")
	ErrClosed         = errors.New("sidechannel: client is closed")
	// ErrRefused: nothing listens at the address (connection refused for
	// longer than RefusedGrace): a dead or moved peer, not a busy one.
	ErrRefused = errors.New("sidechannel: connection refused")
)

// HandshakeError says which peer and rank a handshake failed on.
type HandshakeError struct {
	Addr     string
	EngineID string
	Rank     Rank
	Err      error
}

func (e *HandshakeError) Error() string {
	return fmt.Sprintf("sidechannel: handshake with engine %q at %s (%s) failed: %v", e.EngineID, e.Addr, e.Rank, e.Err)
}

func (e *HandshakeError) Unwrap() error { return e.Err }

// Future is a handshake in progress.
type Future struct {
	done chan struct{}
	res  *Result
	err  error
}

// Done is closed when the handshake has finished.
func (f *Future) Done() <-chan struct{} { return f.done }

// Result returns the outcome; it must only be called after Done is closed.
// Exactly one of the two return values is nil.
func (f *Future) Result() (*Result, error) {
	select {
	case <-f.done:
		return f.res, f.err
	default:
		return nil, errors.New("sidechannel: handshake still in progress")
	}
}

// Wait blocks until the handshake finishes or ctx ends (which abandons the
// wait, not the shared handshake).
func (f *Future) Wait(ctx context.Context) (*Result, error) {
	select {
	case <-f.done:
		return f.res, f.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// Client runs handshakes on their own goroutines. Concurrent Start calls for
// the same (engine, address, ranks) share one handshake. Safe for concurrent
// use.
type Client struct {
	cfg    ClientConfig
	log    *zap.Logger
	ctx    context.Context
	cancel context.CancelFunc

	mu      sync.Mutex
	flights map[string]*Future
	wg      sync.WaitGroup
}

// NewClient returns a client with cfg's defaults filled in.
func NewClient(cfg ClientConfig) *Client {
	if cfg.RecvTimeout <= 0 {
		cfg.RecvTimeout = DefaultRecvTimeout
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.MaxFrameSize <= 0 {
		cfg.MaxFrameSize = DefaultMaxFrameSize
	}
	if cfg.Clock == nil {
		cfg.Clock = MonotonicSeconds
	}
	log := cfg.Logger
	if log == nil {
		log = zap.NewNop()
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Client{cfg: cfg, log: log, ctx: ctx, cancel: cancel, flights: map[string]*Future{}}
}

// Close cancels running handshakes and waits for their goroutines.
func (c *Client) Close() {
	c.cancel()
	c.wg.Wait()
}

// Handshake queries each rank of the engine at host:port and waits for the
// result (or ctx). It runs on a background goroutine shared with concurrent
// callers; see Start.
func (c *Client) Handshake(ctx context.Context, host string, port int, engineID string, ranks ...Rank) (*Result, error) {
	return c.Start(host, port, engineID, ranks...).Wait(ctx)
}

// Start begins (or joins) a handshake and returns at once. The handshake is
// bounded by ClientConfig.Timeout, not by any caller's context.
func (c *Client) Start(host string, port int, engineID string, ranks ...Rank) *Future {
	key := flightKey(host, port, engineID, ranks)
	c.mu.Lock()
	defer c.mu.Unlock()
	if f, ok := c.flights[key]; ok {
		return f
	}
	f := &Future{done: make(chan struct{})}
	if c.ctx.Err() != nil {
		f.err = ErrClosed
		close(f.done)
		return f
	}
	c.flights[key] = f
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		ctx, cancel := context.WithTimeout(c.ctx, c.cfg.Timeout)
		res, err := c.runGuarded(ctx, host, port, engineID, ranks)
		cancel()
		c.mu.Lock()
		delete(c.flights, key)
		c.mu.Unlock()
		f.res, f.err = res, err
		close(f.done)
	}()
	return f
}

func flightKey(host string, port int, engineID string, ranks []Rank) string {
	var b strings.Builder
	b.WriteString(strconv.Quote(engineID))
	b.WriteString("@" + net.JoinHostPort(host, strconv.Itoa(port)))
	for _, r := range ranks {
		fmt.Fprintf(&b, "/%d.%d", r.PP, r.TP)
	}
	return b.String()
}

// runGuarded turns a panic in the handshake into an error for the waiters
// instead of ending the host process.
func (c *Client) runGuarded(ctx context.Context, host string, port int, engineID string, ranks []Rank) (res *Result, err error) {
	defer func() {
		if p := recover(); p != nil {
			c.log.Error("side-channel handshake panicked", zap.Any("panic", p), zap.Stack("stack"))
			res, err = nil, fmt.Errorf("sidechannel: internal error during handshake: %v", p)
		}
	}()
	return c.run(ctx, host, port, engineID, ranks)
}

func (c *Client) run(ctx context.Context, host string, port int, engineID string, ranks []Rank) (*Result, error) {
	addr := net.JoinHostPort(host, strconv.Itoa(port))
	var notReady error // last "not-ready" reply, reported if the deadline passes
	fail := func(r Rank, err error) (*Result, error) {
		if errors.Is(err, context.DeadlineExceeded) {
			if notReady != nil {
				err = fmt.Errorf("%v (last reply: %v)", err, notReady)
			}
			err = fmt.Errorf("%w: %v", ErrTimeout, err)
		} else if errors.Is(err, context.Canceled) && c.ctx.Err() != nil {
			err = ErrClosed
		}
		return nil, &HandshakeError{Addr: addr, EngineID: engineID, Rank: r, Err: err}
	}
	if len(ranks) == 0 {
		return fail(Rank{}, errors.New("no target ranks"))
	}
	res := &Result{Agents: make(map[Rank]*AgentMetadata, len(ranks)), BestRTT: time.Duration(math.MaxInt64)}
	var conn *zconn
	defer func() {
		if conn != nil {
			conn.c.Close()
		}
	}()
	for _, rank := range ranks {
		var meta *AgentMetadata
		for {
			var err error
			if conn == nil {
				if conn, err = c.connect(ctx, addr); err != nil {
					return fail(rank, err)
				}
			}
			var retry bool
			meta, retry, err = c.query(ctx, conn, rank, res)
			if !retry {
				if err != nil {
					return fail(rank, err)
				}
				break
			}
			notReady = err
			select { // the listener has no payload for this rank yet
			case <-ctx.Done():
				return fail(rank, ctx.Err())
			case <-time.After(100 * time.Millisecond):
			}
		}
		if meta.EngineID != engineID {
			return fail(rank, fmt.Errorf("%w: expected %q, received %q", ErrEngineMismatch, engineID, meta.EngineID))
		}
		res.Agents[rank] = meta
		notReady = nil
	}
	return res, nil
}

// RefusedGrace is how long a refused dial is retried (a listener that is
// just being restarted) before the query fails with ErrRefused instead of
// waiting out its timeout.
var RefusedGrace = time.Second

// connect dials and completes the ZMTP handshake, retrying a refused dial
// for RefusedGrace (as a libzmq REQ socket would reconnect), other dial
// errors until the per-query timeout.
func (c *Client) connect(ctx context.Context, addr string) (*zconn, error) {
	qctx, cancel := context.WithTimeout(ctx, c.cfg.RecvTimeout)
	defer cancel()
	var d net.Dialer
	start := time.Now()
	for {
		nc, err := d.DialContext(qctx, "tcp", addr)
		if err != nil && errors.Is(err, syscall.ECONNREFUSED) && time.Since(start) >= RefusedGrace {
			return nil, fmt.Errorf("connect to %s: %w (%v)", addr, ErrRefused, err)
		}
		if err == nil {
			dl, _ := qctx.Deadline()
			nc.SetDeadline(dl)
			z, err := zmtpHandshake(nc, "REQ", []string{"ROUTER", "REP"}, c.cfg.MaxFrameSize, 8)
			if err != nil {
				nc.Close()
				return nil, fmt.Errorf("ZMTP handshake with %s: %w", addr, err)
			}
			return z, nil
		}
		select {
		case <-qctx.Done():
			return nil, fmt.Errorf("connect to %s: %w (last error: %v)", addr, qctx.Err(), err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// armQuery bounds one query on z by RecvTimeout and ctx; the caller
// calls the returned func when the query is done.
func (c *Client) armQuery(ctx context.Context, z *zconn) (stop func() bool) {
	dl := time.Now().Add(c.cfg.RecvTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(dl) {
		dl = d
	}
	z.c.SetDeadline(dl)
	return context.AfterFunc(ctx, func() { z.c.SetDeadline(time.Unix(1, 0)) })
}

// query sends one request and decodes the reply; retry reports a
// "not-ready" reply.
func (c *Client) query(ctx context.Context, z *zconn, rank Rank, res *Result) (*AgentMetadata, bool, error) {
	defer c.armQuery(ctx, z)()

	tag, reqMAC := []byte(GetMetaMsg), []byte(nil)
	if c.cfg.Secret != nil {
		var err error
		if tag, reqMAC, err = authTag(c.cfg.Secret, rank); err != nil {
			return nil, false, err
		}
	}
	tSend := c.cfg.Clock()
	if err := z.writeMsg([]byte{}, encodeRequest(tag, rank)); err != nil {
		return nil, false, c.ioErr(ctx, "send request", err)
	}
	frames, err := z.readMsg()
	tRecv := c.cfg.Clock()
	if err != nil {
		return nil, false, c.ioErr(ctx, "receive reply", err)
	}
	if len(frames[0]) != 0 {
		return nil, false, errors.New("reply lacks the REQ envelope delimiter")
	}
	body := frames[1:]
	if len(body) != 2 && len(body) != 3 {
		return nil, false, fmt.Errorf("expected a 2-frame reply, got %d frames", len(body))
	}
	payload, err := DecodeHandshakePayload(body[0])
	if err != nil {
		return nil, false, fmt.Errorf("failed to decode NixlHandshakePayload; this likely indicates an incompatibility between connector versions: %w", err)
	}
	if rerr := parseErrorPayload(payload); rerr != nil {
		return nil, rerr.Code == codeNotReady, rerr
	}
	switch {
	case c.cfg.Secret != nil && len(body) != 3:
		return nil, false, fmt.Errorf("%w: the reply is not authenticated: the listener has no side-channel secret configured but this side has one; %s", ErrAuth, secretHint)
	case c.cfg.Secret != nil && !hmac.Equal(body[2], replyMAC(c.cfg.Secret, reqMAC, body[0], body[1])):
		return nil, false, fmt.Errorf("%w: reply authentication failed: the side-channel secrets differ", ErrAuth)
	case c.cfg.Secret == nil && len(body) != 2:
		return nil, false, fmt.Errorf("%w: the reply is authenticated but this side has no side-channel secret configured; %s", ErrAuth, secretHint)
	}
	remote, err := DecodeClock(body[1])
	if err != nil {
		return nil, false, err
	}
	if rtt := tRecv - tSend; time.Duration(rtt*1e9) < res.BestRTT {
		res.BestRTT = time.Duration(rtt * 1e9)
		res.ClockOffset = remote - (tSend+tRecv)/2
	}
	if payload.CompatibilityHash != c.cfg.CompatHash {
		if hint, ok := c.cfg.CompatHints[payload.CompatibilityHash]; ok {
			return nil, false, fmt.Errorf("%w: %s (local %s, remote %s)", ErrCompatMismatch, hint, c.cfg.CompatHash, payload.CompatibilityHash)
		}
		if !c.cfg.AllowCompatMismatch {
			return nil, false, fmt.Errorf("%w. Local: %s, Remote: %s. Prefill and decode instances have incompatible "+
				"configurations (vLLM version, model, dtype, attention backend, transfer engine, ...). "+
				`Disable this check with kv_connector_extra_config {"enforce_handshake_compat": false}`,
				ErrCompatMismatch, c.cfg.CompatHash, payload.CompatibilityHash)
		}
		c.log.Warn("NIXL compatibility hash mismatch ignored (enforce_handshake_compat=false)",
			zap.String("local", c.cfg.CompatHash), zap.String("remote", payload.CompatibilityHash))
	} else {
		c.log.Info("NIXL compatibility check passed", zap.String("hash", payload.CompatibilityHash))
	}
	meta, err := DecodeAgentMetadata(payload.AgentMetadataBytes)
	if err != nil {
		return nil, false, fmt.Errorf("failed to decode NixlAgentMetadata: %w", err)
	}
	return meta, false, nil
}

func (c *Client) ioErr(ctx context.Context, what string, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("%s: %w", what, ctx.Err())
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return fmt.Errorf("%w: %s: no reply before the deadline (per query %v, whole handshake %v)", ErrTimeout, what, c.cfg.RecvTimeout, c.cfg.Timeout)
	}
	return fmt.Errorf("%s: %w", what, err)
}

// kvDigestPollInterval is how long KVDigest waits between "pending" replies.
const kvDigestPollInterval = 20 * time.Millisecond

// KVDigest asks the listener at host:port for the KV digest of requestID
// (gonixl only; see doc.go) and returns it. A "none" reply returns (nil,
// nil); a "pending" reply is polled on the same connection every 20 ms until
// ctx is done, which is then a wrapped ErrTimeout (deadline) or ctx's error.
// Each query is bounded by ClientConfig.RecvTimeout; ClientConfig.Timeout
// does not apply. Authentication failures match ErrAuth, an "error" reply
// is a *RemoteError, and after Close the error matches ErrClosed.
func (c *Client) KVDigest(ctx context.Context, host string, port int, requestID string) (digest []byte, err error) {
	addr := net.JoinHostPort(host, strconv.Itoa(port))
	wrap := func(err error) error {
		return fmt.Errorf("sidechannel: KV digest query for request %.64q at %s: %w", requestID, addr, err)
	}
	if err := checkKVRequestID(requestID); err != nil {
		return nil, wrap(err)
	}
	c.mu.Lock()
	if c.ctx.Err() != nil {
		c.mu.Unlock()
		return nil, wrap(ErrClosed)
	}
	c.wg.Add(1)
	c.mu.Unlock()
	defer c.wg.Done()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(c.ctx, cancel)()
	defer func() {
		if p := recover(); p != nil {
			c.log.Error("side-channel KV digest query panicked", zap.Any("panic", p), zap.Stack("stack"))
			digest, err = nil, wrap(fmt.Errorf("internal error: %v", p))
		}
	}()

	last := "no reply yet"
	fail := func(err error) ([]byte, error) {
		switch {
		case c.ctx.Err() != nil && errors.Is(err, context.Canceled):
			err = ErrClosed
		case errors.Is(err, context.DeadlineExceeded):
			err = fmt.Errorf("%w: %v (last status: %s)", ErrTimeout, err, last)
		case errors.Is(err, ErrTimeout):
			err = fmt.Errorf("%w (last status: %s)", err, last)
		}
		return nil, wrap(err)
	}
	// One connection per poll: a reader waiting for a decode that has not
	// digested yet must not hold one of the listener's MaxConns slots (it
	// evicts only connections idle for a second, and a poller never is),
	// or hundreds of pending read-backs would lock handshakes out.
	for {
		z, err := c.connect(ctx, addr)
		if err != nil {
			return fail(err)
		}
		reply, err := c.kvQuery(ctx, z, requestID)
		z.c.Close()
		if err != nil {
			return fail(err)
		}
		switch reply.Status {
		case KVDigestOK:
			return reply.Digest, nil
		case KVDigestNone:
			return nil, nil
		}
		last = reply.Status
		select {
		case <-ctx.Done():
			return fail(ctx.Err())
		case <-time.After(kvDigestPollInterval):
		}
	}
}

// kvQuery sends one KV digest query on z and returns a verified reply whose
// status is ok (Digest non-nil), pending or none.
func (c *Client) kvQuery(ctx context.Context, z *zconn, requestID string) (*KVDigestReply, error) {
	defer c.armQuery(ctx, z)()

	tag, reqMAC := []byte(KVDigestMsg), []byte(nil)
	if c.cfg.Secret != nil {
		var err error
		if tag, reqMAC, err = kvDigestAuthTag(c.cfg.Secret, requestID); err != nil {
			return nil, err
		}
	}
	ioErr := func(what string, err error) error {
		if ctx.Err() != nil {
			return fmt.Errorf("%s: %w", what, ctx.Err())
		}
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return fmt.Errorf("%w: %s: no reply within the per-query timeout %v", ErrTimeout, what, c.cfg.RecvTimeout)
		}
		return fmt.Errorf("%s: %w", what, err)
	}
	if err := z.writeMsg([]byte{}, encodeKVDigestRequest(tag, requestID)); err != nil {
		return nil, ioErr("send KV digest query", err)
	}
	frames, err := z.readMsg()
	if err != nil {
		return nil, ioErr("receive KV digest reply", err)
	}
	if len(frames[0]) != 0 {
		return nil, errors.New("reply lacks the REQ envelope delimiter")
	}
	body := frames[1:]
	if len(body) != 1 && len(body) != 2 {
		return nil, fmt.Errorf("expected a 1- or 2-frame KV digest reply, got %d frames", len(body))
	}
	reply, err := DecodeKVDigestReply(body[0])
	if err != nil {
		if p, perr := DecodeHandshakePayload(body[0]); perr == nil {
			return nil, fmt.Errorf("the listener does not serve KV digest queries (it answered with a handshake reply, hash %.200q)", p.CompatibilityHash)
		}
		return nil, fmt.Errorf("malformed KV digest reply: %w", err)
	}
	if reply.Status == KVDigestError {
		return nil, parseKVDigestError(reply.Message)
	}
	switch {
	case c.cfg.Secret != nil && len(body) != 2:
		return nil, fmt.Errorf("%w: the reply is not authenticated: the listener has no side-channel secret configured but this side has one; %s", ErrAuth, secretHint)
	case c.cfg.Secret != nil && !hmac.Equal(body[1], kvDigestReplyMAC(c.cfg.Secret, reqMAC, body[0])):
		return nil, fmt.Errorf("%w: reply authentication failed: the side-channel secrets differ", ErrAuth)
	case c.cfg.Secret == nil && len(body) != 1:
		return nil, fmt.Errorf("%w: the reply is authenticated but this side has no side-channel secret configured; %s", ErrAuth, secretHint)
	}
	return reply, nil
}
