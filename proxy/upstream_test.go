package proxy

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// The request-path tests of the proxy run against the lean client (newRig's
// default); these run a representative set again with net/http's Transport
// injected (Config.Transport).
func TestNetHTTPUpstream(t *testing.T) {
	rigTransport = func() http.RoundTripper { return testTransport() }
	defer func() { rigTransport = nil }()
	for name, f := range map[string]func(*testing.T){
		"ToyRewrites":                    TestToyRewrites,
		"ToyHeaders":                     TestToyHeaders,
		"ToyStreamingPassThrough":        TestToyStreamingPassThrough,
		"UpstreamFailures":               TestUpstreamFailures,
		"ClientDisconnectCancelsPrefill": TestClientDisconnectCancelsPrefill,
		"ClientDisconnectCancelsDecode":  TestClientDisconnectCancelsDecodeStream,
		"DecodeDiesMidStream":            TestDecodeDiesMidStream,
		"MultiturnRewrites":              TestMultiturnRewrites,
		"PushSendsAtOnce":                TestPushSendsPrefillAndDecodeAtOnce,
	} {
		t.Run(name, f)
	}
}

// scriptServer is a raw TCP server: serve handles each accepted connection.
type scriptServer struct {
	ln       net.Listener
	accepted atomic.Int32
	wg       sync.WaitGroup
}

func newScriptServer(t *testing.T, serve func(n int, c net.Conn)) *scriptServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &scriptServer{ln: ln}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			n := int(s.accepted.Add(1))
			s.wg.Add(1)
			go func() { defer s.wg.Done(); defer c.Close(); serve(n, c) }()
		}
	}()
	t.Cleanup(func() { ln.Close(); s.wg.Wait() })
	return s
}

func (s *scriptServer) instance() Instance {
	return Instance{Host: "127.0.0.1", Port: s.ln.Addr().(*net.TCPAddr).Port}
}

// readRequest reads one request and its body from br.
func readRequest(br *bufio.Reader) (*http.Request, string, error) {
	req, err := http.ReadRequest(br)
	if err != nil {
		return nil, "", err
	}
	b, err := io.ReadAll(req.Body)
	return req, string(b), err
}

// okResponse is a keep-alive JSON answer echoing the request body.
func okResponse(body string) string {
	return "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: " +
		strconv.Itoa(len(body)) + "\r\n\r\n" + body
}

// keepAliveServer answers every request on a connection with its own body.
func keepAliveServer(n int, c net.Conn) {
	br := bufio.NewReader(c)
	for {
		_, body, err := readRequest(br)
		if err != nil {
			return
		}
		if _, err := io.WriteString(c, okResponse(body)); err != nil {
			return
		}
	}
}

func newTestPool(inst Instance) *leanPool {
	return newLeanPool(inst, (&net.Dialer{Timeout: 2 * time.Second}).DialContext, time.Minute)
}

// postAll sends body and returns the response's status and body.
func postAll(t *testing.T, lp *leanPool, ctx context.Context, body string) (int, string, error) {
	t.Helper()
	resp, err := lp.post(ctx, "/completions", upstreamHeaders{requestID: "r1"}, []byte(body))
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

func (lp *leanPool) idleLen() int { lp.mu.Lock(); defer lp.mu.Unlock(); return len(lp.idle) }

func TestLeanPoolReusesConnection(t *testing.T) {
	var heads []string
	var mu sync.Mutex
	srv := newScriptServer(t, func(n int, c net.Conn) {
		br := bufio.NewReader(c)
		for {
			req, body, err := readRequest(br)
			if err != nil {
				return
			}
			mu.Lock()
			heads = append(heads, fmt.Sprintf("%s %s %s %s %q", req.Method, req.URL.Path, req.Host,
				req.Header.Get("X-Request-Id"), req.Header.Get("Authorization")))
			mu.Unlock()
			_, _ = io.WriteString(c, okResponse(body))
		}
	})
	lp := newTestPool(srv.instance())
	defer lp.close()
	for i := 0; i < 3; i++ {
		status, body, err := postAll(t, lp, context.Background(), fmt.Sprintf(`{"i":%d}`, i))
		if err != nil || status != 200 || body != fmt.Sprintf(`{"i":%d}`, i) {
			t.Fatalf("request %d: %d %q %v", i, status, body, err)
		}
		if lp.idleLen() != 1 {
			t.Fatalf("after request %d: %d idle connections, want 1", i, lp.idleLen())
		}
	}
	if n := srv.accepted.Load(); n != 1 {
		t.Errorf("%d connections for 3 sequential requests, want 1", n)
	}
	head := func(i int) string { mu.Lock(); defer mu.Unlock(); return heads[i] }
	want := fmt.Sprintf(`POST /v1/completions %s r1 ""`, srv.instance())
	if head(0) != want {
		t.Errorf("request head %s, want %s", head(0), want)
	}
	// A large body goes out with writev; an Authorization header is sent.
	big := `{"p":"` + strings.Repeat("x", 100<<10) + `"}`
	resp, err := lp.post(context.Background(), "/chat/completions", upstreamHeaders{requestID: "r2", authorization: "Bearer k"}, []byte(big))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(b) != big {
		t.Errorf("large body echoed with %d bytes, want %d", len(b), len(big))
	}
	want = fmt.Sprintf(`POST /v1/chat/completions %s r2 "Bearer k"`, srv.instance())
	if head(3) != want {
		t.Errorf("request head %s, want %s", head(3), want)
	}
}

// A response that asks to close, one whose body is not read to its end,
// and one followed by unasked bytes leave no connection in the pool.
func TestLeanPoolDoesNotReuse(t *testing.T) {
	tests := []struct {
		description string
		answer      string
		readAll     bool
	}{
		{"Connection: close", "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}", true},
		{"body not read", okResponse(`{"a":"` + strings.Repeat("y", 64<<10) + `"}`), false},
		{"bytes after the body", okResponse(`{}`) + "junk", true},
		{"HTTP/1.0", "HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n{}", true},
	}
	for _, tc := range tests {
		t.Run(tc.description, func(t *testing.T) {
			srv := newScriptServer(t, func(n int, c net.Conn) {
				br := bufio.NewReader(c)
				for {
					if _, _, err := readRequest(br); err != nil {
						return
					}
					_, _ = io.WriteString(c, tc.answer)
				}
			})
			lp := newTestPool(srv.instance())
			defer lp.close()
			for i := 0; i < 2; i++ {
				resp, err := lp.post(context.Background(), "/completions", upstreamHeaders{requestID: "r"}, []byte(`{}`))
				if err != nil {
					t.Fatalf("request %d: %v", i, err)
				}
				if tc.readAll {
					_, _ = io.ReadAll(resp.Body)
				} else {
					_, _ = resp.Body.Read(make([]byte, 10))
				}
				resp.Body.Close()
				if n := lp.idleLen(); n != 0 {
					t.Fatalf("%d idle connections, want 0", n)
				}
			}
			if n := srv.accepted.Load(); n != 2 {
				t.Errorf("%d connections for 2 requests, want 2", n)
			}
		})
	}
}

func TestLeanPoolChunkedResponse(t *testing.T) {
	srv := newScriptServer(t, func(n int, c net.Conn) {
		br := bufio.NewReader(c)
		for {
			if _, _, err := readRequest(br); err != nil {
				return
			}
			_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
			for _, ev := range []string{"data: a\n\n", "data: b\n\n"} {
				_, _ = fmt.Fprintf(c, "%x\r\n%s\r\n", len(ev), ev)
				time.Sleep(5 * time.Millisecond)
			}
			_, _ = io.WriteString(c, "0\r\n\r\n")
		}
	})
	lp := newTestPool(srv.instance())
	defer lp.close()
	for i := 0; i < 2; i++ {
		resp, err := lp.post(context.Background(), "/completions", upstreamHeaders{requestID: "r"}, []byte(`{}`))
		if err != nil {
			t.Fatal(err)
		}
		if resp.ContentLength != -1 {
			t.Errorf("chunked response with ContentLength %d", resp.ContentLength)
		}
		// The first event arrives alone (streamed, not buffered to the end).
		buf := make([]byte, 64)
		n, err := resp.Body.Read(buf)
		if err != nil || string(buf[:n]) != "data: a\n\n" {
			t.Fatalf("first read %q %v", buf[:n], err)
		}
		rest, err := io.ReadAll(resp.Body)
		if err != nil || string(rest) != "data: b\n\n" {
			t.Fatalf("rest %q %v", rest, err)
		}
		resp.Body.Close()
	}
	if n := srv.accepted.Load(); n != 1 {
		t.Errorf("%d connections for 2 chunked responses, want 1 (reused)", n)
	}
}

// A pooled connection the server closed while idle (vLLM's keep-alive
// timeout, a restart) is detected and not used: the request succeeds on a
// new connection.
func TestLeanPoolServerClosedIdleConnection(t *testing.T) {
	for _, reset := range []bool{false, true} {
		t.Run(fmt.Sprintf("reset=%v", reset), func(t *testing.T) {
			closed := make(chan struct{})
			srv := newScriptServer(t, func(n int, c net.Conn) {
				br := bufio.NewReader(c)
				_, body, err := readRequest(br)
				if err != nil {
					return
				}
				_, _ = io.WriteString(c, okResponse(body))
				if n == 1 {
					// Idle now: close it as a keep-alive timeout does.
					time.Sleep(20 * time.Millisecond)
					if reset {
						_ = c.(*net.TCPConn).SetLinger(0)
					}
					c.Close()
					close(closed)
					return
				}
				keepAliveServer(n, c)
			})
			lp := newTestPool(srv.instance())
			defer lp.close()
			if _, _, err := postAll(t, lp, context.Background(), `{}`); err != nil {
				t.Fatal(err)
			}
			waitClosed(t, closed, "server close")
			waitDead(t, lp)
			status, body, err := postAll(t, lp, context.Background(), `{"b":1}`)
			if err != nil || status != 200 || body != `{"b":1}` {
				t.Fatalf("request after the server closed the idle connection: %d %q %v", status, body, err)
			}
			if n := srv.accepted.Load(); n != 2 {
				t.Errorf("%d connections, want 2", n)
			}
		})
	}
}

// waitDead waits until the pool's idle connection shows the server's close
// (loopback delivers it at once; this only guards a slow machine).
func waitDead(t *testing.T, lp *leanPool) {
	t.Helper()
	deadline := time.Now().Add(waitLimit)
	for time.Now().Before(deadline) {
		lp.mu.Lock()
		dead := len(lp.idle) == 1 && !connAlive(lp.idle[0])
		lp.mu.Unlock()
		if dead {
			return
		}
		time.Sleep(time.Millisecond)
	}
	t.Fatal("the server's close never reached the idle connection")
}

func TestConnAlive(t *testing.T) {
	unasked := make(chan struct{})
	srv := newScriptServer(t, func(n int, c net.Conn) {
		_, _ = io.WriteString(c, "surprise")
		close(unasked)
		_, _ = io.Copy(io.Discard, c)
	})
	lp := newTestPool(srv.instance())
	lc, err := lp.dialConn(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer lc.c.Close()
	waitClosed(t, unasked, "unasked write")
	deadline := time.Now().Add(waitLimit)
	for connAlive(lc) {
		if time.Now().After(deadline) {
			t.Fatal("a connection with unasked bytes from the server reads as alive")
		}
		time.Sleep(time.Millisecond)
	}
	quiet := newScriptServer(t, func(n int, c net.Conn) { _, _ = io.Copy(io.Discard, c) })
	lc2, err := newTestPool(quiet.instance()).dialConn(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer lc2.c.Close()
	if !connAlive(lc2) {
		t.Error("an open, quiet connection reads as dead")
	}
}

// failConn fails its writes after the first, as a reused connection the
// server reset does; it is no syscall.Conn, so the idle check passes it.
type failConn struct {
	net.Conn
	writes int
}

func (c *failConn) Write(b []byte) (int, error) {
	c.writes++
	if c.writes > 1 {
		return 0, &net.OpError{Op: "write", Net: "tcp", Err: syscall.EPIPE}
	}
	return c.Conn.Write(b)
}

// A request whose write fails on a reused connection is sent again on a new
// one; one that the server received and dropped without an answer is not.
func TestLeanPoolRetryRule(t *testing.T) {
	t.Run("write fails: retried", func(t *testing.T) {
		srv := newScriptServer(t, keepAliveServer)
		var dials atomic.Int32
		d := &net.Dialer{}
		lp := newLeanPool(srv.instance(), func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := d.DialContext(ctx, network, addr)
			if err != nil || dials.Add(1) > 1 {
				return c, err
			}
			return &failConn{Conn: c}, nil
		}, time.Minute)
		defer lp.close()
		for i := 0; i < 2; i++ {
			if status, body, err := postAll(t, lp, context.Background(), `{"x":1}`); err != nil || status != 200 || body != `{"x":1}` {
				t.Fatalf("request %d: %d %q %v", i, status, body, err)
			}
		}
		if n := dials.Load(); n != 2 {
			t.Errorf("%d dials, want 2 (the retry's)", n)
		}
	})
	t.Run("no answer after the write: not retried", func(t *testing.T) {
		var received atomic.Int32
		srv := newScriptServer(t, func(n int, c net.Conn) {
			br := bufio.NewReader(c)
			for {
				_, body, err := readRequest(br)
				if err != nil {
					return
				}
				if received.Add(1) == 2 {
					return // received, then gone without an answer
				}
				_, _ = io.WriteString(c, okResponse(body))
			}
		})
		lp := newTestPool(srv.instance())
		defer lp.close()
		if _, _, err := postAll(t, lp, context.Background(), `{}`); err != nil {
			t.Fatal(err)
		}
		_, _, err := postAll(t, lp, context.Background(), `{}`)
		if err == nil {
			t.Fatal("a request the server dropped succeeded")
		}
		if !strings.Contains(err.Error(), "unexpected EOF") {
			t.Errorf("error %v, want unexpected EOF", err)
		}
		time.Sleep(20 * time.Millisecond)
		if n := received.Load(); n != 2 {
			t.Errorf("server received %d requests, want 2 (no retry)", n)
		}
	})
}

func TestLeanPoolIdleTimeout(t *testing.T) {
	srv := newScriptServer(t, keepAliveServer)
	lp := newTestPool(srv.instance())
	defer lp.close()
	var now atomic.Int64
	now.Store(time.Unix(1000, 0).UnixNano())
	lp.now = func() time.Time { return time.Unix(0, now.Load()) }
	lp.idleTimeout = time.Hour // the sweep timer stays out of the way
	if _, _, err := postAll(t, lp, context.Background(), `{}`); err != nil {
		t.Fatal(err)
	}
	now.Add(int64(59 * time.Minute))
	if _, _, err := postAll(t, lp, context.Background(), `{}`); err != nil {
		t.Fatal(err)
	}
	if n := srv.accepted.Load(); n != 1 {
		t.Fatalf("%d connections within the idle timeout, want 1", n)
	}
	now.Add(int64(time.Hour))
	if _, _, err := postAll(t, lp, context.Background(), `{}`); err != nil {
		t.Fatal(err)
	}
	if n := srv.accepted.Load(); n != 2 {
		t.Errorf("%d connections after the idle timeout, want 2 (expired one not reused)", n)
	}
	// The sweep closes expired idle connections without a request.
	now.Add(int64(time.Hour))
	lp.sweep()
	if n := lp.idleLen(); n != 0 {
		t.Errorf("%d idle connections after the sweep, want 0", n)
	}
}

func TestLeanPoolSweepTimer(t *testing.T) {
	closed := make(chan struct{})
	srv := newScriptServer(t, func(n int, c net.Conn) {
		keepAliveServer(n, c) // returns at the client's close
		close(closed)
	})
	lp := newLeanPool(srv.instance(), (&net.Dialer{}).DialContext, 30*time.Millisecond)
	defer lp.close()
	if _, _, err := postAll(t, lp, context.Background(), `{}`); err != nil {
		t.Fatal(err)
	}
	waitClosed(t, closed, "idle connection closed by the pool's timer")
	if n := lp.idleLen(); n != 0 {
		t.Errorf("%d idle connections, want 0", n)
	}
}

// A canceled or timed-out request stops a blocked read at once, and its
// connection is not reused.
func TestLeanPoolCancel(t *testing.T) {
	release := make(chan struct{})
	srv := newScriptServer(t, func(n int, c net.Conn) {
		br := bufio.NewReader(c)
		if _, _, err := readRequest(br); err != nil {
			return
		}
		if n == 2 {
			// Headers, part of the body, then silence.
			_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
		}
		select {
		case <-release:
		case <-time.After(waitLimit):
		}
	})
	defer close(release)
	lp := newTestPool(srv.instance())
	defer lp.close()

	ctx, cancel := context.WithTimeoutCause(context.Background(), 50*time.Millisecond, errUpstreamTimeout)
	defer cancel()
	start := time.Now()
	_, err := lp.post(ctx, "/completions", upstreamHeaders{requestID: "r"}, []byte(`{}`))
	if err == nil || reasonOf(ctx, err) != "timeout" {
		t.Fatalf("waiting for headers: err %v (reason %q), want a timeout", err, reasonOf(ctx, err))
	}
	if d := time.Since(start); d > waitLimit/2 {
		t.Errorf("timeout took %v", d)
	}

	ctx2, cancel2 := context.WithCancel(context.Background())
	resp, err := lp.post(ctx2, "/completions", upstreamHeaders{requestID: "r"}, []byte(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan error, 1)
	go func() { _, err := io.ReadAll(resp.Body); got <- err }()
	time.Sleep(20 * time.Millisecond)
	cancel2()
	select {
	case err := <-got:
		if err == nil {
			t.Error("body read ended cleanly after the cancel")
		}
		if reasonOf(ctx2, err) != "canceled" {
			t.Errorf("reason %q, want canceled", reasonOf(ctx2, err))
		}
	case <-time.After(waitLimit):
		t.Fatal("a canceled body read did not return")
	}
	resp.Body.Close()
	if n := lp.idleLen(); n != 0 {
		t.Errorf("%d idle connections after canceled requests, want 0", n)
	}
}

func TestLeanPoolErrors(t *testing.T) {
	srv := newScriptServer(t, keepAliveServer)
	lp := newTestPool(srv.instance())
	defer lp.close()
	_, err := lp.post(context.Background(), "/completions", upstreamHeaders{requestID: "a\r\nEvil: 1"}, []byte(`{}`))
	if err == nil || !strings.Contains(err.Error(), "invalid header field value") {
		t.Errorf("CR LF in a header value: %v", err)
	}
	if n := srv.accepted.Load(); n != 0 {
		t.Errorf("%d connections for an invalid request, want 0", n)
	}
	dead := newTestPool(deadInstance(t))
	_, err = dead.post(context.Background(), "/completions", upstreamHeaders{requestID: "r"}, []byte(`{}`))
	var ue interface{ Unwrap() error }
	if err == nil || !errors.As(err, &ue) || !strings.Contains(err.Error(), `Post "http://127.0.0.1:`) ||
		reasonOf(context.Background(), err) != "transport" {
		t.Errorf("dead instance: %v", err)
	}
	// After Close, a connection coming back is closed, not pooled.
	resp, err := lp.post(context.Background(), "/completions", upstreamHeaders{requestID: "r"}, []byte(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.ReadAll(resp.Body)
	lp.close()
	resp.Body.Close()
	if n := lp.idleLen(); n != 0 {
		t.Errorf("%d idle connections after close, want 0", n)
	}
}

// Through the proxy: the fakes drop their idle connections between two
// requests (as vLLM does after 5 s idle); the second request still succeeds.
func TestProxySurvivesUpstreamIdleClose(t *testing.T) {
	pf := newFake(t, "p0", prefillHandler("p0"))
	df := newFake(t, "d0", decodeHandler("d0", false))
	r := newRig(t, []*fakeOpenAI{pf}, []*fakeOpenAI{df}, nil)
	for i := 0; i < 3; i++ {
		status, _, body := r.post("/v1/completions", map[string]any{"prompt": "x"}, nil)
		if status != 200 {
			t.Fatalf("request %d: %d %s", i, status, body)
		}
		pf.srv.CloseClientConnections()
		df.srv.CloseClientConnections()
		for _, lp := range r.p.pools {
			waitDead(t, lp)
		}
	}
}

// A decode stream's headers reach the client before its first event when
// the decode sends them alone; an event that came with them goes out in the
// same write (the client sees both at once either way).
func TestStreamHeadersBeforeFirstEvent(t *testing.T) {
	for _, mode := range []Mode{ModeToy, ModeMultiturn} {
		t.Run(mode.String(), func(t *testing.T) {
			release := make(chan struct{})
			pf := newFake(t, "p0", prefillHandler("p0"))
			df := newFake(t, "d0", func(w http.ResponseWriter, r *http.Request, _ received) {
				w.Header().Set("Content-Type", "text/event-stream")
				w.WriteHeader(200)
				w.(http.Flusher).Flush()
				select {
				case <-release:
				case <-time.After(waitLimit):
				}
				fmt.Fprint(w, "data: {\"choices\":[{\"text\":\"a\"}]}\n\n")
			})
			r := newRig(t, []*fakeOpenAI{pf}, []*fakeOpenAI{df}, func(c *Config) { c.Mode = mode })
			type result struct {
				resp *http.Response
				err  error
			}
			got := make(chan result, 1)
			go func() {
				resp, err := r.srv.Client().Post(r.srv.URL+"/v1/completions", "application/json",
					strings.NewReader(`{"prompt":"x","stream":true}`))
				got <- result{resp, err}
			}()
			var res result
			select {
			case res = <-got:
				close(release)
			case <-time.After(waitLimit / 2):
				close(release)
				t.Fatal("the stream's headers waited for its first event")
			}
			if res.err != nil {
				t.Fatalf("POST: %v", res.err)
			}
			resp := res.resp
			defer resp.Body.Close()
			b, err := io.ReadAll(resp.Body)
			if err != nil || !strings.Contains(string(b), `"text":"a"`) {
				t.Errorf("body %q %v", b, err)
			}
		})
	}
}
