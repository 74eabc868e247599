package proxy

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"syscall"
	"time"
)

// The upstream legs (prefill and decode requests) go through a lean
// HTTP/1.1 client of this file instead of net/http's Transport, unless
// Config.Transport is set. The Transport runs two goroutines per connection
// (one writes the request, one reads the response) and every request hands
// off caller → writer → reader → caller; here the handler's own goroutine
// writes the request in one system call and parses the response with
// http.ReadResponse (Content-Length and chunked bodies), so an upstream
// exchange costs no goroutine switch beyond waiting on the network.
//
// Connections: one pool of idle keep-alive connections per instance, last
// in first out (the most recently used connection is the warmest). A
// connection goes back to the pool only when its response body was read to
// the end cleanly, nothing follows it, the response did not ask to close,
// and the request was not canceled. Idle connections are closed after
// Config.UpstreamIdleTimeout (below vLLM's 5 s keep-alive), by a timer of
// the pool and when a request finds them expired.
//
// Reuse and retries. A POST is not idempotent, so a request is sent again
// only when the upstream cannot have received it whole:
//   - before a pooled connection is reused, a non-blocking peek
//     (MSG_PEEK|MSG_DONTWAIT) checks that the server has not closed it (a
//     FIN or RST that already arrived) and sent nothing unasked; such a
//     connection is dropped and the next one (or a new one) taken. This is
//     what net/http's reader goroutine, always peeking, detects;
//   - when writing the request to a reused connection fails, the request is
//     sent once more on a new connection: a write that fails was not
//     complete, and an incomplete request (its body is sized by
//     Content-Length) is never served.
//
// A reused connection that fails after the request was written (the server
// closed it in the instant between the peek and the write) fails the
// request, as net/http's Transport does for a POST: the server may have
// received it.
//
// Cancellation: the request's context (the client's, with the proxy's
// per-phase upstream timeouts) aborts a blocked write or read by setting a
// past deadline on the connection (context.AfterFunc), so no deadline is set
// per read; such a connection is then closed, never reused.

// upstreamClient sends one POST to an upstream instance.
type upstreamClient interface {
	// post sends body to path; the caller reads and closes the response's
	// body. Errors are *url.Error, as net/http's.
	post(ctx context.Context, path string, h upstreamHeaders, body []byte) (*http.Response, error)
}

// upstreamHeaders are the request headers the proxy sets.
type upstreamHeaders struct {
	requestID     string
	authorization string // empty: none
}

// httpUpstream is the net/http client, used when Config.Transport is set.
type httpUpstream struct {
	base   string // "http://host:port/v1"
	client *http.Client
}

func (u *httpUpstream) post(ctx context.Context, path string, h upstreamHeaders, body []byte) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u.base+path, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", h.requestID)
	if h.authorization != "" {
		req.Header.Set("Authorization", h.authorization)
	}
	return u.client.Do(req)
}

// leanPool is one instance's lean client and its idle connections.
type leanPool struct {
	addr        string // host:port, dialed and sent as Host
	base        string // "http://host:port/v1", for error messages
	dial        func(ctx context.Context, network, addr string) (net.Conn, error)
	idleTimeout time.Duration
	now         func() time.Time // tests

	mu       sync.Mutex
	idle     []*leanConn // oldest first; taken from the end
	sweeping bool        // the sweep timer is armed
	closed   bool
}

// leanConn is one upstream connection.
type leanConn struct {
	c      net.Conn
	br     *bufio.Reader
	idleAt time.Time // when it went back to the pool
	wbuf   []byte    // the request head, reused
}

// maxIdlePerInstance bounds an instance's idle connections (as
// NewTransport's MaxIdleConnsPerHost).
const maxIdlePerInstance = 4096

// leanReadBufSize is a connection's read buffer: response heads and SSE
// events fit; larger body reads bypass it.
const leanReadBufSize = 16 << 10

func newLeanPool(inst Instance, dial func(ctx context.Context, network, addr string) (net.Conn, error), idleTimeout time.Duration) *leanPool {
	return &leanPool{addr: inst.String(), base: inst.BaseURL(), dial: dial, idleTimeout: idleTimeout, now: time.Now}
}

// errConnUnusable marks a pooled connection the server closed or wrote to
// while it was idle.
var errConnUnusable = errors.New("idle connection closed by the server")

func (lp *leanPool) post(ctx context.Context, path string, h upstreamHeaders, body []byte) (*http.Response, error) {
	if !validHeaderValue(h.requestID) || !validHeaderValue(h.authorization) {
		return nil, lp.urlError(path, errors.New("invalid header field value"))
	}
	lc, reused, err := lp.get(ctx)
	if err != nil {
		return nil, lp.urlError(path, err)
	}
	resp, err := lp.roundTrip(ctx, lc, path, h, body)
	if err != nil && reused && errors.Is(err, errWriteFailed) && ctx.Err() == nil {
		// The request did not reach the server whole: safe to send again,
		// once, on a new connection.
		if lc, err = lp.dialConn(ctx); err != nil {
			return nil, lp.urlError(path, err)
		}
		resp, err = lp.roundTrip(ctx, lc, path, h, body)
	}
	if err != nil {
		return nil, lp.urlError(path, err)
	}
	return resp, nil
}

func (lp *leanPool) urlError(path string, err error) error {
	var we *reqWriteError
	if errors.As(err, &we) {
		err = we.err
	}
	return &url.Error{Op: "Post", URL: lp.base + path, Err: err}
}

// errWriteFailed marks an error writing the request (see reqWriteError).
var errWriteFailed = errors.New("writing the request failed")

// reqWriteError is a failed request write: the upstream did not get it whole.
type reqWriteError struct{ err error }

func (e *reqWriteError) Error() string { return e.err.Error() }
func (e *reqWriteError) Unwrap() []error {
	return []error{e.err, errWriteFailed}
}

// roundTrip sends one request on lc and reads the response head. On error lc
// is closed; on success the response body owns lc.
func (lp *leanPool) roundTrip(ctx context.Context, lc *leanConn, path string, h upstreamHeaders, body []byte) (*http.Response, error) {
	stop := context.AfterFunc(ctx, func() { _ = lc.c.SetDeadline(aLongTimeAgo) })
	lc.wbuf = appendRequestHead(lc.wbuf[:0], lp.addr, path, h, len(body))
	var werr error
	if len(body) <= 32<<10 {
		// One write: head and body copied into one buffer.
		lc.wbuf = append(lc.wbuf, body...)
		_, werr = lc.c.Write(lc.wbuf)
	} else {
		bufs := net.Buffers{lc.wbuf, body}
		_, werr = bufs.WriteTo(lc.c) // writev
	}
	if werr != nil {
		stop()
		_ = lc.c.Close()
		return nil, &reqWriteError{err: werr}
	}
	resp, err := http.ReadResponse(lc.br, postRequest)
	for err == nil && resp.StatusCode < 200 && resp.StatusCode != http.StatusSwitchingProtocols {
		// An informational answer (103 Early Hints, ...): the final one follows.
		resp, err = http.ReadResponse(lc.br, postRequest)
	}
	if err == nil && resp.StatusCode == http.StatusSwitchingProtocols {
		err = errors.New("unexpected 101 Switching Protocols")
	}
	if err != nil {
		stop()
		_ = lc.c.Close()
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return nil, err
	}
	resp.Body = &leanBody{rc: resp.Body, lp: lp, lc: lc, stop: stop, keep: !resp.Close}
	return resp, nil
}

// postRequest is what http.ReadResponse needs to know of the request (a
// response to a POST has a body).
var postRequest = &http.Request{Method: http.MethodPost}

var aLongTimeAgo = time.Unix(1, 0)

func appendRequestHead(b []byte, host, path string, h upstreamHeaders, n int) []byte {
	b = append(b, "POST /v1"...)
	b = append(b, path...)
	b = append(b, " HTTP/1.1\r\nHost: "...)
	b = append(b, host...)
	b = append(b, "\r\nUser-Agent: gonixl-proxy\r\nContent-Type: application/json\r\nX-Request-Id: "...)
	b = append(b, h.requestID...)
	if h.authorization != "" {
		b = append(b, "\r\nAuthorization: "...)
		b = append(b, h.authorization...)
	}
	b = append(b, "\r\nContent-Length: "...)
	b = strconv.AppendInt(b, int64(n), 10)
	return append(b, "\r\n\r\n"...)
}

// validHeaderValue is net/http's rule for a field value: no control bytes
// other than tab.
func validHeaderValue(v string) bool {
	for i := 0; i < len(v); i++ {
		if c := v[i]; (c < ' ' && c != '\t') || c == 0x7f {
			return false
		}
	}
	return true
}

// leanBody is a response body on a pooled connection: read to its end
// cleanly, the connection goes back to the pool on Close.
type leanBody struct {
	rc   io.ReadCloser // http.ReadResponse's body
	lp   *leanPool
	lc   *leanConn
	stop func() bool // unregisters the context's abort
	keep bool        // the response allows reuse
	eof  bool
	err  bool
	done bool
}

func (b *leanBody) Read(p []byte) (int, error) {
	if b.done {
		return 0, errors.New("read on a closed response body")
	}
	n, err := b.rc.Read(p)
	if err == io.EOF {
		b.eof = true
	} else if err != nil {
		b.err = true
	}
	return n, err
}

func (b *leanBody) Close() error {
	if b.done {
		return nil
	}
	b.done = true
	// stop reports false when the context's abort already ran (or runs):
	// the connection's deadline is then spoiled.
	notCanceled := b.stop()
	if b.eof && !b.err && b.keep && notCanceled && b.lc.br.Buffered() == 0 {
		b.lp.put(b.lc)
	} else {
		_ = b.lc.c.Close()
	}
	b.lc = nil
	return nil
}

// bodyBuffered reports whether a response body from the lean client has
// bytes waiting in its buffer (a read returns without waiting).
func bodyBuffered(body io.Reader) bool {
	b, ok := body.(*leanBody)
	return ok && !b.done && b.lc.br.Buffered() > 0
}

// get returns an idle connection that is still open, or a new one; reused
// says which.
func (lp *leanPool) get(ctx context.Context) (lc *leanConn, reused bool, err error) {
	for {
		lc = lp.takeIdle()
		if lc == nil {
			break
		}
		if connAlive(lc) {
			return lc, true, nil
		}
		_ = lc.c.Close()
	}
	lc, err = lp.dialConn(ctx)
	return lc, false, err
}

func (lp *leanPool) takeIdle() *leanConn {
	now := lp.now()
	lp.mu.Lock()
	defer lp.mu.Unlock()
	n := len(lp.idle)
	if n == 0 {
		return nil
	}
	lc := lp.idle[n-1]
	lp.idle[n-1] = nil
	lp.idle = lp.idle[:n-1]
	if now.Sub(lc.idleAt) >= lp.idleTimeout {
		// The newest idle connection has expired, so have all the others.
		lp.closeLocked(lp.idle)
		lp.idle = lp.idle[:0]
		_ = lc.c.Close()
		return nil
	}
	return lc
}

func (lp *leanPool) closeLocked(cs []*leanConn) {
	for i, c := range cs {
		_ = c.c.Close()
		cs[i] = nil
	}
}

func (lp *leanPool) put(lc *leanConn) {
	lc.idleAt = lp.now()
	lp.mu.Lock()
	if lp.closed {
		lp.mu.Unlock()
		_ = lc.c.Close()
		return
	}
	if len(lp.idle) >= maxIdlePerInstance {
		lp.mu.Unlock()
		_ = lc.c.Close()
		return
	}
	lp.idle = append(lp.idle, lc)
	arm := !lp.sweeping
	lp.sweeping = true
	lp.mu.Unlock()
	if arm {
		time.AfterFunc(lp.idleTimeout, lp.sweep)
	}
}

// sweep closes the expired idle connections, and rearms itself while some
// remain.
func (lp *leanPool) sweep() {
	now := lp.now()
	lp.mu.Lock()
	i := 0
	for i < len(lp.idle) && now.Sub(lp.idle[i].idleAt) >= lp.idleTimeout {
		i++
	}
	lp.closeLocked(lp.idle[:i])
	lp.idle = append(lp.idle[:0], lp.idle[i:]...)
	clear(lp.idle[len(lp.idle):cap(lp.idle)])
	var next time.Duration
	if len(lp.idle) > 0 && !lp.closed {
		next = lp.idleTimeout - now.Sub(lp.idle[0].idleAt)
	}
	lp.sweeping = next > 0
	lp.mu.Unlock()
	if next > 0 {
		time.AfterFunc(next, lp.sweep)
	}
}

func (lp *leanPool) dialConn(ctx context.Context) (*leanConn, error) {
	c, err := lp.dial(ctx, "tcp", lp.addr)
	if err != nil {
		return nil, err
	}
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetNoDelay(true)
	}
	return &leanConn{c: c, br: bufio.NewReaderSize(c, leanReadBufSize)}, nil
}

func (lp *leanPool) closeIdle() {
	lp.mu.Lock()
	defer lp.mu.Unlock()
	lp.closeLocked(lp.idle)
	lp.idle = lp.idle[:0]
}

// close closes the idle connections and every connection put back later.
func (lp *leanPool) close() {
	lp.mu.Lock()
	lp.closed = true
	lp.mu.Unlock()
	lp.closeIdle()
}

// connAlive reports whether an idle connection can carry a request: the
// server has neither closed it nor sent anything. It costs one non-blocking
// recv(MSG_PEEK).
func connAlive(lc *leanConn) bool {
	if lc.br.Buffered() > 0 {
		return false
	}
	sc, ok := lc.c.(syscall.Conn)
	if !ok {
		return true // not a socket (tests' pipes): nothing to check
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	alive := false
	var buf [1]byte
	err = rc.Read(func(fd uintptr) bool {
		n, _, rerr := syscall.Recvfrom(int(fd), buf[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		// Nothing to read (EAGAIN) is the only good answer: 0 bytes is the
		// server's FIN, data is unasked, any other error a reset.
		alive = n < 0 && (rerr == syscall.EAGAIN || rerr == syscall.EWOULDBLOCK)
		return true
	})
	return err == nil && alive
}
