package sidechannel

import (
	"crypto/hmac"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go.uber.org/zap"
)

// ListenerConfig configures the scheduler-side listener. The zero value of
// every field but BasePort has a safe default.
type ListenerConfig struct {
	Host     string // bind host; "" means DefaultHost (loopback)
	BasePort int    // VLLM_NIXL_SIDE_CHANNEL_PORT; 0 lets the OS pick (tests)
	DPIndex  int    // data-parallel index, added to BasePort
	Secret   []byte // optional shared secret (see auth.go)

	MaxFrameSize     int           // default DefaultMaxFrameSize
	MaxConns         int           // concurrent connections, default 256
	HandshakeTimeout time.Duration // ZMTP greeting/READY, default 5 s
	IdleTimeout      time.Duration // between requests on one connection, default 60 s
	Clock            func() float64
	Logger           *zap.Logger

	// KVDigest serves the gonixl-only KV digest query (see doc.go): given a
	// request id it returns KVDigestOK with the digest, KVDigestPending or
	// KVDigestNone. It runs on the connection's goroutine with no listener
	// lock held and may be called concurrently; a panic or any other status
	// is answered "error". nil answers every query "none".
	KVDigest func(requestID string) (status string, digest []byte)
}

// Listener serves handshake payloads per (pp_rank, tp_rank) to REQ clients
// (vLLM's _nixl_handshake_listener, with bounded frames and connections).
// All methods are safe for concurrent use.
type Listener struct {
	cfg ListenerConfig
	log *zap.Logger
	ln  net.Listener

	mu       sync.RWMutex
	payloads map[Rank][]byte
	conns    map[net.Conn]*connActivity
	stopped  bool

	wg       sync.WaitGroup
	stopOnce sync.Once

	served, refused atomic.Int64
}

// NewListener binds host:BasePort+DPIndex and starts serving. Payloads are
// added with SetPayload; until then a request is answered "not-ready".
func NewListener(cfg ListenerConfig) (*Listener, error) {
	if cfg.Host == "" {
		cfg.Host = DefaultHost
	}
	if cfg.MaxFrameSize <= 0 {
		cfg.MaxFrameSize = DefaultMaxFrameSize
	}
	if cfg.MaxConns <= 0 {
		cfg.MaxConns = 256
	}
	if cfg.HandshakeTimeout <= 0 {
		cfg.HandshakeTimeout = 5 * time.Second
	}
	if cfg.IdleTimeout <= 0 {
		cfg.IdleTimeout = 60 * time.Second
	}
	if cfg.Clock == nil {
		cfg.Clock = MonotonicSeconds
	}
	log := cfg.Logger
	if log == nil {
		log = zap.NewNop()
	}
	port := cfg.BasePort + cfg.DPIndex
	if cfg.BasePort < 0 || cfg.DPIndex < 0 || port > 65535 || (cfg.BasePort == 0 && cfg.DPIndex != 0) {
		return nil, fmt.Errorf("sidechannel: invalid side-channel port %d (%s=%d + data-parallel index %d)",
			port, EnvPort, cfg.BasePort, cfg.DPIndex)
	}
	addr := net.JoinHostPort(cfg.Host, strconv.Itoa(port))
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		if errors.Is(err, syscall.EADDRINUSE) {
			return nil, fmt.Errorf("sidechannel: cannot listen on %s: port %d is already in use "+
				"(%s=%d + data-parallel index %d); choose another base port with %s: %w",
				addr, port, EnvPort, cfg.BasePort, cfg.DPIndex, EnvPort, err)
		}
		return nil, fmt.Errorf("sidechannel: cannot listen on %s (%s=%q, %s=%d + data-parallel index %d): %w",
			addr, EnvHost, cfg.Host, EnvPort, cfg.BasePort, cfg.DPIndex, err)
	}
	l := &Listener{cfg: cfg, log: log, ln: ln, payloads: map[Rank][]byte{}, conns: map[net.Conn]*connActivity{}}
	l.wg.Add(1)
	go l.accept()
	log.Debug("side-channel listener started", zap.String("addr", ln.Addr().String()))
	return l, nil
}

// Addr is the bound address (with the actual port when BasePort was 0).
func (l *Listener) Addr() *net.TCPAddr { return l.ln.Addr().(*net.TCPAddr) }

// SetPayload sets or replaces the encoded NixlHandshakePayload served for
// (pp, tp). It must decode as a NixlHandshakePayload and fit in a frame.
func (l *Listener) SetPayload(pp, tp int, payload []byte) error {
	if len(payload) > l.cfg.MaxFrameSize {
		return fmt.Errorf("sidechannel: payload of %d bytes exceeds the frame limit %d", len(payload), l.cfg.MaxFrameSize)
	}
	if _, err := DecodeHandshakePayload(payload); err != nil {
		return err
	}
	p := append([]byte{}, payload...)
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.stopped {
		return errors.New("sidechannel: listener is stopped")
	}
	l.payloads[Rank{PP: pp, TP: tp}] = p
	return nil
}

// Counts returns how many requests were answered with a payload and how
// many were refused (error reply or dropped). A KV digest query counts as
// served when answered "ok" or "none", as refused when answered "pending"
// (like a not-ready handshake) or "error".
func (l *Listener) Counts() (served, refused int64) { return l.served.Load(), l.refused.Load() }

// Stop closes the socket and every connection and waits for the serving
// goroutines. It is idempotent and returns promptly.
func (l *Listener) Stop() error {
	l.stopOnce.Do(func() {
		l.mu.Lock()
		l.stopped = true
		l.ln.Close()
		for c := range l.conns {
			c.Close()
		}
		l.mu.Unlock()
		l.wg.Wait()
	})
	return nil
}

func (l *Listener) accept() {
	defer l.wg.Done()
	defer func() {
		// A bug here must cost the listener, never the host process; the
		// scheduler's handshakes then fail (logged), vLLM keeps serving.
		if p := recover(); p != nil {
			l.log.Error("side-channel accept loop panicked; handshakes with this engine fail from now on", zap.Any("panic", p), zap.Stack("stack"))
		}
	}()
	for {
		c, err := l.ln.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			l.mu.RLock()
			stopped := l.stopped
			l.mu.RUnlock()
			if stopped || errors.Is(err, net.ErrClosed) {
				return
			}
			l.log.Warn("side-channel accept failed", zap.Error(err))
			time.Sleep(50 * time.Millisecond)
			continue
		}
		l.mu.Lock()
		if !l.stopped && len(l.conns) >= l.cfg.MaxConns {
			// Full: make room by closing the connection idle the longest,
			// if it has been idle a while. Real clients connect, ask and
			// leave within milliseconds; a flood of idle or slow peers
			// must not lock them out.
			l.evictIdlestLocked()
		}
		if l.stopped || len(l.conns) >= l.cfg.MaxConns {
			l.mu.Unlock()
			l.refused.Add(1)
			c.Close()
			continue
		}
		act := &connActivity{}
		act.touch()
		l.conns[c] = act
		l.wg.Add(1)
		l.mu.Unlock()
		go l.serve(c, act)
	}
}

// connActivity is when a connection last made progress (accepted, greeted,
// or delivered a message), in Unix nanoseconds.
type connActivity struct{ last atomic.Int64 }

func (a *connActivity) touch() { a.last.Store(time.Now().UnixNano()) }

// minIdleToEvict: a connection idle for less is never evicted for room (a
// real client's whole exchange takes milliseconds).
const minIdleToEvict = time.Second

func (l *Listener) evictIdlestLocked() {
	var victim net.Conn
	oldest := time.Now().Add(-minIdleToEvict).UnixNano()
	for c, a := range l.conns {
		if t := a.last.Load(); t < oldest {
			victim, oldest = c, t
		}
	}
	if victim != nil {
		delete(l.conns, victim) // its goroutine's own delete is then a no-op
		victim.Close()
		l.refused.Add(1)
	}
}

func (l *Listener) serve(c net.Conn, act *connActivity) {
	defer l.wg.Done()
	defer func() {
		// A bug in the protocol code must cost one connection, never the
		// host process (a panic on this goroutine would end vLLM).
		if p := recover(); p != nil {
			l.log.Error("side-channel connection handler panicked", zap.Any("panic", p), zap.Stack("stack"))
		}
		l.mu.Lock()
		delete(l.conns, c)
		l.mu.Unlock()
		c.Close()
	}()
	c.SetDeadline(time.Now().Add(l.cfg.HandshakeTimeout))
	z, err := zmtpHandshake(c, "ROUTER", []string{"REQ", "DEALER"}, l.cfg.MaxFrameSize, 8)
	if err != nil {
		l.log.Debug("side-channel connection rejected", zap.Stringer("peer", c.RemoteAddr()), zap.Error(err))
		return
	}
	act.touch()
	for {
		c.SetDeadline(time.Now().Add(l.cfg.IdleTimeout))
		frames, err := z.readMsg()
		act.touch()
		if err != nil {
			if errors.Is(err, ErrFrameTooLarge) {
				l.refused.Add(1)
				l.log.Warn("side-channel request refused", zap.Stringer("peer", c.RemoteAddr()), zap.Error(err))
			}
			return
		}
		// A REQ peer's message is [empty delimiter, request]; anything
		// without the delimiter cannot be answered in a form REQ accepts.
		if len(frames[0]) != 0 {
			l.refused.Add(1)
			l.log.Warn("side-channel message without REQ envelope dropped", zap.Stringer("peer", c.RemoteAddr()))
			continue
		}
		reply := l.handle(frames[1:])
		c.SetWriteDeadline(time.Now().Add(l.cfg.HandshakeTimeout))
		if err := z.writeMsg(append([][]byte{{}}, reply...)...); err != nil {
			return
		}
	}
}

// handle turns one request body into reply frames (after the delimiter).
func (l *Listener) handle(body [][]byte) [][]byte {
	fail := func(code, msg string) [][]byte {
		l.refused.Add(1)
		lvl := zap.WarnLevel
		if code == codeNotReady { // clients poll until the payload is set
			lvl = zap.DebugLevel
		}
		l.log.Log(lvl, "side-channel request refused", zap.String("code", code), zap.String("reason", msg))
		return [][]byte{errorPayload(code, msg), EncodeClock(l.cfg.Clock())}
	}
	if len(body) != 1 {
		return fail(codeBadRequest, fmt.Sprintf("expected 1 request frame, got %d", len(body)))
	}
	if isKVDigestQuery(body[0]) {
		return l.handleKVDigest(body[0])
	}
	req, err := DecodeRequest(body[0])
	if err != nil {
		return fail(codeBadRequest, err.Error())
	}
	nonce, mac, authed := splitAuthTag(req.Tag)
	if !authed && string(req.Tag) != GetMetaMsg {
		l.log.Warn("side-channel listener got unexpected message", zap.ByteString("msg", req.Tag))
	}
	switch {
	case l.cfg.Secret != nil && !authed:
		return fail(codeAuthRequired, "this listener requires side-channel authentication but the request carries none; "+secretHint)
	case l.cfg.Secret == nil && authed:
		return fail(codeAuthUnsupported, "the request is authenticated but this listener has no side-channel secret configured; "+secretHint)
	case authed && !hmac.Equal(mac, requestMAC(l.cfg.Secret, nonce, req.Rank)):
		return fail(codeAuthFailed, "request authentication failed: the side-channel secrets differ")
	}
	l.mu.RLock()
	payload, ok := l.payloads[req.Rank]
	l.mu.RUnlock()
	if !ok {
		return fail(codeNotReady, fmt.Sprintf("no handshake payload for %s (yet)", req.Rank))
	}
	clock := EncodeClock(l.cfg.Clock())
	l.served.Add(1)
	if authed {
		return [][]byte{payload, clock, replyMAC(l.cfg.Secret, mac, payload, clock)}
	}
	return [][]byte{payload, clock}
}

// handleKVDigest answers one KV digest query: [body], or [body, mac] when
// the request is authenticated and verified.
func (l *Listener) handleKVDigest(b []byte) [][]byte {
	fail := func(code, msg string) [][]byte {
		l.refused.Add(1)
		l.log.Warn("side-channel KV digest query refused", zap.String("code", code), zap.String("reason", msg))
		return [][]byte{kvDigestErrorReply(code, msg)}
	}
	req, err := DecodeKVDigestRequest(b)
	if err != nil {
		return fail(codeBadRequest, err.Error())
	}
	nonce, mac, authed := splitKVDigestAuthTag(req.Tag)
	switch {
	case l.cfg.Secret != nil && !authed:
		return fail(codeAuthRequired, "this listener requires side-channel authentication but the request carries none; "+secretHint)
	case l.cfg.Secret == nil && authed:
		return fail(codeAuthUnsupported, "the request is authenticated but this listener has no side-channel secret configured; "+secretHint)
	case authed && !hmac.Equal(mac, kvDigestRequestMAC(l.cfg.Secret, nonce, req.RequestID)):
		return fail(codeAuthFailed, "request authentication failed: the side-channel secrets differ")
	}
	seal := func(body []byte) [][]byte {
		if authed {
			return [][]byte{body, kvDigestReplyMAC(l.cfg.Secret, mac, body)}
		}
		return [][]byte{body}
	}
	id := zap.String("request_id", req.RequestID)
	providerFailed := func(msg string) [][]byte {
		l.refused.Add(1)
		l.log.Error("side-channel KV digest provider failed", id, zap.String("reason", msg))
		return seal(kvDigestErrorReply(codeProviderFailed, msg))
	}
	status, digest, perr := l.kvDigest(req.RequestID)
	var reply KVDigestReply
	switch {
	case perr != nil:
		return providerFailed(perr.Error())
	case status == KVDigestOK:
		reply = KVDigestReply{Status: KVDigestOK, Digest: digest}
	case status == KVDigestPending || status == KVDigestNone:
		reply = KVDigestReply{Status: status}
	default:
		return providerFailed(fmt.Sprintf("the KV digest provider returned status %q", status))
	}
	body := reply.Encode()
	if len(body) > l.cfg.MaxFrameSize {
		return providerFailed(fmt.Sprintf("a digest of %d bytes exceeds the frame limit %d", len(digest), l.cfg.MaxFrameSize))
	}
	if status == KVDigestPending {
		l.refused.Add(1)
	} else {
		l.served.Add(1)
	}
	l.log.Debug("side-channel KV digest query answered", id, zap.String("status", status), zap.Int("digest_bytes", len(reply.Digest)))
	return seal(body)
}

// kvDigest calls the provider, turning a panic into an error.
func (l *Listener) kvDigest(requestID string) (status string, digest []byte, err error) {
	if l.cfg.KVDigest == nil {
		return KVDigestNone, nil, nil
	}
	defer func() {
		if p := recover(); p != nil {
			l.log.Error("side-channel KV digest provider panicked", zap.String("request_id", requestID), zap.Any("panic", p), zap.Stack("stack"))
			status, digest, err = "", nil, fmt.Errorf("the KV digest provider panicked: %v", p)
		}
	}()
	status, digest = l.cfg.KVDigest(requestID)
	return status, digest, nil
}
