package sidechannel

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

func payloadFor(t testing.TB, engine string, hash string, tp int) []byte {
	m := minimalMetadata()
	m.EngineID, m.DeviceID = engine, int64(tp)
	return (&HandshakePayload{CompatibilityHash: hash, AgentMetadataBytes: m.Encode()}).Encode()
}

func startListener(t *testing.T, cfg ListenerConfig, engine string, tps ...int) *Listener {
	t.Helper()
	l, err := NewListener(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Stop() })
	for _, tp := range tps {
		if err := l.SetPayload(0, tp, payloadFor(t, engine, "hash-A", tp)); err != nil {
			t.Fatal(err)
		}
	}
	return l
}

func newTestClient(t *testing.T, cfg ClientConfig) *Client {
	if cfg.CompatHash == "" {
		cfg.CompatHash = "hash-A"
	}
	if cfg.RecvTimeout == 0 {
		cfg.RecvTimeout = 5 * time.Second
	}
	c := NewClient(cfg)
	t.Cleanup(c.Close)
	return c
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// seqClock returns the given readings in turn.
func seqClock(vals ...float64) func() float64 {
	var mu sync.Mutex
	i := 0
	return func() float64 {
		mu.Lock()
		defer mu.Unlock()
		v := vals[i%len(vals)]
		i++
		return v
	}
}

func TestHandshakeEndToEnd(t *testing.T) {
	l := startListener(t, ListenerConfig{Clock: func() float64 { return 500 }}, "engine-P", 0, 1)
	// RTT 10 then RTT 1: the second sample wins, offset = 500 - (20+21)/2.
	c := newTestClient(t, ClientConfig{Clock: seqClock(0, 10, 20, 21)})
	res, err := c.Handshake(ctxT(t), "127.0.0.1", l.Addr().Port, "engine-P", Ranks(1, 0, 1)...)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Agents) != 2 || res.Agents[Rank{0, 1}].DeviceID != 1 || res.Agents[Rank{0, 0}].EngineID != "engine-P" {
		t.Errorf("agents = %+v", res.Agents)
	}
	if res.ClockOffset != 479.5 || res.BestRTT != time.Second {
		t.Errorf("offset %v rtt %v, want 479.5 and 1s", res.ClockOffset, res.BestRTT)
	}
	if served, _ := l.Counts(); served != 2 {
		t.Errorf("served = %d", served)
	}
}

func TestHandshakeFailures(t *testing.T) {
	l := startListener(t, ListenerConfig{}, "engine-P", 0)
	port := l.Addr().Port
	for _, tc := range []struct {
		description string
		cfg         ClientConfig
		engine      string
		wantIs      error
		wantText    []string
	}{
		{"hash mismatch names both hashes", ClientConfig{CompatHash: "hash-B"}, "engine-P", ErrCompatMismatch,
			[]string{"Local: hash-B", "Remote: hash-A", "enforce_handshake_compat"}},
		{"known other transport says so", ClientConfig{CompatHash: "hash-B", AllowCompatMismatch: true,
			CompatHints: map[string]string{"hash-A": "the remote engine uses another transport"}}, "engine-P", ErrCompatMismatch,
			[]string{"the remote engine uses another transport", "remote hash-A"}},
		{"engine id mismatch", ClientConfig{}, "engine-X", ErrEngineMismatch, []string{`expected "engine-X", received "engine-P"`}},
		{"secret on the client only", ClientConfig{Secret: []byte("s")}, "engine-P", ErrAuth,
			[]string{"auth-unsupported", "this listener has no side-channel secret configured"}},
	} {
		_, err := newTestClient(t, tc.cfg).Handshake(ctxT(t), "127.0.0.1", port, tc.engine, Rank{0, 0})
		if !errors.Is(err, tc.wantIs) {
			t.Errorf("%s: error %v is not %v", tc.description, err, tc.wantIs)
			continue
		}
		for _, s := range tc.wantText {
			if !strings.Contains(err.Error(), s) {
				t.Errorf("%s: error %q lacks %q", tc.description, err, s)
			}
		}
	}
	// enforce_handshake_compat=false lets a mismatch through.
	if _, err := newTestClient(t, ClientConfig{CompatHash: "hash-B", AllowCompatMismatch: true}).
		Handshake(ctxT(t), "127.0.0.1", port, "engine-P", Rank{0, 0}); err != nil {
		t.Errorf("AllowCompatMismatch: %v", err)
	}
}

func TestAuthentication(t *testing.T) {
	for _, tc := range []struct {
		description            string
		listenerKey, clientKey string
		want                   string // "" = success
	}{
		{"same secret", "k1", "k1", ""},
		{"listener only", "k1", "", "requires side-channel authentication but the request carries none"},
		{"client only", "", "k1", "has no side-channel secret configured"},
		{"different secrets", "k1", "k2", "secrets differ"},
	} {
		var lk, ck []byte
		if tc.listenerKey != "" {
			lk = []byte(tc.listenerKey)
		}
		if tc.clientKey != "" {
			ck = []byte(tc.clientKey)
		}
		l := startListener(t, ListenerConfig{Secret: lk}, "e", 0)
		_, err := newTestClient(t, ClientConfig{Secret: ck}).Handshake(ctxT(t), "127.0.0.1", l.Addr().Port, "e", Rank{0, 0})
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%s: %v", tc.description, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want) || !errors.Is(err, ErrAuth)):
			t.Errorf("%s: got %v, want an ErrAuth containing %q", tc.description, err, tc.want)
		}
	}
}

// fakeRouter accepts one connection and hands its messages to handle.
func fakeRouter(t *testing.T, handle func(z *zconn, frames [][]byte)) int {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { ln.Close(); <-done })
	go func() {
		defer close(done)
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(10 * time.Second))
		z, err := zmtpHandshake(c, "ROUTER", []string{"REQ"}, 1<<20, 8)
		if err != nil {
			return
		}
		for {
			frames, err := z.readMsg()
			if err != nil {
				return
			}
			handle(z, frames)
		}
	}()
	return ln.Addr().(*net.TCPAddr).Port
}

// With no secret the request on the wire is exactly vLLM's: [b"", msgpack((b"get_meta_msg", pp, tp))].
func TestRequestWireBytes(t *testing.T) {
	got := make(chan [][]byte, 1)
	port := fakeRouter(t, func(z *zconn, frames [][]byte) {
		got <- frames
		z.writeMsg([]byte{}, payloadFor(t, "e", "hash-A", 1), EncodeClock(1))
	})
	if _, err := newTestClient(t, ClientConfig{}).Handshake(ctxT(t), "127.0.0.1", port, "e", Rank{0, 1}); err != nil {
		t.Fatal(err)
	}
	frames := <-got
	if len(frames) != 2 || len(frames[0]) != 0 || !bytes.Equal(frames[1], unhex(t, requestHex)) {
		t.Errorf("request frames = %x", frames)
	}
}

func TestClientRefusesBadReplies(t *testing.T) {
	for _, tc := range []struct {
		description string
		reply       func() [][]byte
		cfg         ClientConfig
		want        string
	}{
		{"one frame", func() [][]byte { return [][]byte{{}, payloadFor(t, "e", "hash-A", 0)} }, ClientConfig{}, "2-frame reply, got 1"},
		{"garbage payload", func() [][]byte { return [][]byte{{}, {0xc1}, EncodeClock(1)} }, ClientConfig{}, "NixlHandshakePayload"},
		{"bad clock", func() [][]byte { return [][]byte{{}, payloadFor(t, "e", "hash-A", 0), {0xa1, 'x'}} }, ClientConfig{}, "clock"},
		{"bad metadata", func() [][]byte {
			return [][]byte{{}, (&HandshakePayload{"hash-A", []byte{0x80}}).Encode(), EncodeClock(1)}
		}, ClientConfig{}, "missing required field `engine_id`"},
		{"forged MAC", func() [][]byte {
			return [][]byte{{}, payloadFor(t, "e", "hash-A", 0), EncodeClock(1), make([]byte, 32)}
		}, ClientConfig{Secret: []byte("k")}, "reply authentication failed"},
		{"too large", func() [][]byte { return [][]byte{{}, make([]byte, 2000), EncodeClock(1)} },
			ClientConfig{MaxFrameSize: 1000}, "exceeds the size limit"},
	} {
		reply := tc.reply()
		port := fakeRouter(t, func(z *zconn, _ [][]byte) { z.writeMsg(reply...) })
		_, err := newTestClient(t, tc.cfg).Handshake(ctxT(t), "127.0.0.1", port, "e", Rank{0, 0})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: got %v, want error containing %q", tc.description, err, tc.want)
		}
	}
}

func TestNotReadyThenServed(t *testing.T) {
	l := startListener(t, ListenerConfig{}, "e")
	f := newTestClient(t, ClientConfig{}).Start("127.0.0.1", l.Addr().Port, "e", Rank{0, 0})
	for { // wait until the listener has refused at least once
		if _, refused := l.Counts(); refused > 0 {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := l.SetPayload(0, 0, payloadFor(t, "e", "hash-A", 0)); err != nil {
		t.Fatal(err)
	}
	if res, err := f.Wait(ctxT(t)); err != nil || res.Agents[Rank{0, 0}] == nil {
		t.Fatalf("got %v, %v", res, err)
	}
}

func TestDeadlines(t *testing.T) {
	l := startListener(t, ListenerConfig{}, "e")
	// 2 s leaves room for at least one not-ready reply on a loaded machine.
	_, err := newTestClient(t, ClientConfig{Timeout: 2 * time.Second}).Handshake(ctxT(t), "127.0.0.1", l.Addr().Port, "e", Rank{0, 0})
	if !errors.Is(err, ErrTimeout) || !strings.Contains(err.Error(), "not-ready") {
		t.Errorf("never-ready listener: %v", err)
	}
	// Nothing listening: the per-query timeout bounds the reconnect attempts.
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	_, err = newTestClient(t, ClientConfig{RecvTimeout: 300 * time.Millisecond}).Handshake(ctxT(t), "127.0.0.1", port, "e", Rank{0, 0})
	if !errors.Is(err, ErrTimeout) {
		t.Errorf("no listener: %v", err)
	}
	// A listener that never answers: the receive timeout fires.
	port = fakeRouter(t, func(*zconn, [][]byte) {})
	_, err = newTestClient(t, ClientConfig{RecvTimeout: 300 * time.Millisecond}).Handshake(ctxT(t), "127.0.0.1", port, "e", Rank{0, 0})
	if !errors.Is(err, ErrTimeout) {
		t.Errorf("silent listener: %v", err)
	}
}

func TestSharedHandshake(t *testing.T) {
	l := startListener(t, ListenerConfig{}, "e")
	c := newTestClient(t, ClientConfig{})
	f1 := c.Start("127.0.0.1", l.Addr().Port, "e", Rank{0, 0})
	f2 := c.Start("127.0.0.1", l.Addr().Port, "e", Rank{0, 0})
	f3 := c.Start("127.0.0.1", l.Addr().Port, "e", Rank{0, 1})
	if f1 != f2 || f1 == f3 {
		t.Errorf("futures: f1==f2 %v, f1==f3 %v", f1 == f2, f1 == f3)
	}
	if _, err := f1.Result(); err == nil {
		t.Error("Result before Done returned no error")
	}
	l.SetPayload(0, 0, payloadFor(t, "e", "hash-A", 0))
	l.SetPayload(0, 1, payloadFor(t, "e", "hash-A", 1))
	r1, err1 := f1.Wait(ctxT(t))
	r2, err2 := f2.Wait(ctxT(t))
	if err1 != nil || err2 != nil || r1 != r2 {
		t.Errorf("shared results differ: %v %v", err1, err2)
	}
	if _, err := f3.Wait(ctxT(t)); err != nil {
		t.Error(err)
	}
	c.Close()
	if _, err := c.Start("127.0.0.1", l.Addr().Port, "e", Rank{0, 0}).Wait(ctxT(t)); !errors.Is(err, ErrClosed) {
		t.Errorf("after Close: %v", err)
	}
}

// rawConn opens a ZMTP REQ connection to the listener for hand-made requests.
func rawConn(t *testing.T, port int) *zconn {
	c, err := net.DialTimeout("tcp", "127.0.0.1:"+strconv.Itoa(port), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(10 * time.Second))
	z, err := zmtpHandshake(c, "REQ", []string{"ROUTER"}, 1<<20, 8)
	if err != nil {
		t.Fatal(err)
	}
	return z
}

func TestListenerSurvivesBadInput(t *testing.T) {
	l := startListener(t, ListenerConfig{MaxFrameSize: 1 << 16}, "e", 0)
	port := l.Addr().Port

	// A peer that connects and says nothing must not block other peers.
	idle, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer idle.Close()

	z := rawConn(t, port)
	for _, tc := range []struct {
		description string
		frames      [][]byte
		wantCode    string
	}{
		{"not msgpack", [][]byte{{}, {0xc1}}, codeBadRequest},
		{"two-element tuple", [][]byte{{}, mp(t, []any{[]byte(GetMetaMsg), 0})}, codeBadRequest},
		{"extra frame", [][]byte{{}, EncodeRequest(Rank{0, 0}), {1}}, codeBadRequest},
		{"unknown rank", [][]byte{{}, EncodeRequest(Rank{0, 9})}, codeNotReady},
		{"unexpected tag is still served", [][]byte{{}, mp(t, []any{[]byte("hello"), 0, 0})}, ""},
		{"valid", [][]byte{{}, EncodeRequest(Rank{0, 0})}, ""},
	} {
		if err := z.writeMsg(tc.frames...); err != nil {
			t.Fatal(err)
		}
		reply, err := z.readMsg()
		if err != nil {
			t.Fatalf("%s: %v", tc.description, err)
		}
		p, err := DecodeHandshakePayload(reply[1])
		if err != nil {
			t.Fatalf("%s: %v", tc.description, err)
		}
		re := parseErrorPayload(p)
		switch {
		case tc.wantCode == "" && re != nil:
			t.Errorf("%s: error reply %v", tc.description, re)
		case tc.wantCode != "" && (re == nil || re.Code != tc.wantCode):
			t.Errorf("%s: reply %q, want code %s", tc.description, p.CompatibilityHash, tc.wantCode)
		}
	}

	// An oversized frame closes that connection only.
	big := rawConn(t, port)
	hdr := make([]byte, 9)
	hdr[0] = flagLong | flagMore
	binary.BigEndian.PutUint64(hdr[1:], 1<<40)
	big.c.Write(hdr)
	if _, err := big.readMsg(); err == nil {
		t.Error("oversized frame: connection stayed open")
	}
	// A READY whose command-name length byte is 255 (the fuzzer's first find).
	hostile, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer hostile.Close()
	hostile.SetDeadline(time.Now().Add(10 * time.Second))
	body := append([]byte{0xff}, make([]byte, 255)...)
	hostile.Write(append(append(greeting(), frameHeader(len(body), flagCommand)...), body...))
	buf := make([]byte, 4096)
	for { // read until the listener closes the connection
		if _, err := hostile.Read(buf); err != nil {
			break
		}
	}
	if _, err := newTestClient(t, ClientConfig{}).Handshake(ctxT(t), "127.0.0.1", port, "e", Rank{0, 0}); err != nil {
		t.Errorf("listener stopped serving: %v", err)
	}
}

func TestListenerLifecycle(t *testing.T) {
	l := startListener(t, ListenerConfig{}, "e", 0)
	// Port in use: the error names the port and the environment variable.
	_, err := NewListener(ListenerConfig{Host: "127.0.0.1", BasePort: l.Addr().Port})
	if err == nil || !strings.Contains(err.Error(), strconv.Itoa(l.Addr().Port)) || !strings.Contains(err.Error(), EnvPort) {
		t.Errorf("port in use: %v", err)
	}
	if l.Addr().IP.IsLoopback() == false {
		t.Errorf("default host bound %v, want loopback", l.Addr().IP)
	}
	if err := l.SetPayload(0, 1, []byte{0x80}); err == nil {
		t.Error("SetPayload accepted an invalid payload")
	}
	z := rawConn(t, l.Addr().Port) // an open connection must not delay Stop
	_ = z
	done := make(chan struct{})
	go func() { l.Stop(); l.Stop(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Stop did not return")
	}
	if err := l.SetPayload(0, 0, payloadFor(t, "e", "h", 0)); err == nil {
		t.Error("SetPayload after Stop succeeded")
	}
	if _, err := newTestClient(t, ClientConfig{RecvTimeout: 200 * time.Millisecond}).Handshake(ctxT(t), "127.0.0.1", l.Addr().Port, "e", Rank{0, 0}); err == nil {
		t.Error("handshake after Stop succeeded")
	}
	if _, err := NewListener(ListenerConfig{BasePort: 0, DPIndex: 1}); err == nil {
		t.Error("BasePort 0 with a DP index accepted")
	}
}

func TestFromEnv(t *testing.T) {
	env := func(m map[string]string) func(string) string { return func(k string) string { return m[k] } }
	e, err := FromEnv(env(nil))
	if err != nil || e.Host != "localhost" || e.BasePort != 5600 || e.Secret != nil {
		t.Errorf("defaults: %+v %v", e, err)
	}
	e, err = FromEnv(env(map[string]string{EnvHost: "10.0.0.1", EnvPort: " 7000 ", EnvSecret: "s"}))
	if err != nil || e.Host != "10.0.0.1" || e.BasePort != 7000 || string(e.Secret) != "s" {
		t.Errorf("set: %+v %v", e, err)
	}
	if _, err := FromEnv(env(map[string]string{EnvPort: "x"})); err == nil || !strings.Contains(err.Error(), EnvPort) {
		t.Errorf("bad port: %v", err)
	}
	if got := string(ResolveSecret("a", e)); got != "a" {
		t.Errorf("extra config secret not preferred: %q", got)
	}
	if got := string(ResolveSecret("", e)); got != "s" {
		t.Errorf("env secret not used: %q", got)
	}
}
