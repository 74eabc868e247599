package sidechannel

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"math"
	"net"
	"os"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
)

// Every decoder is fuzzed for one invariant: no panic, and an error exactly
// when no value comes back. Values that do decode must survive a re-encode.
// Seeds: f.Add below plus the committed files in testdata/fuzz/<FuzzName>/.

func addSeeds(f *testing.F, seeds ...[]byte) {
	for _, s := range seeds {
		f.Add(s)
	}
}

func metadataSeeds(f *testing.F) [][]byte {
	full, err := os.ReadFile("testdata/golden/agent_metadata_full.hex")
	if err != nil {
		f.Fatal(err)
	}
	return [][]byte{minimalMetadata().Encode(), unhex(f, string(full)), {0x80}, {0xde, 0xff, 0xff}}
}

func FuzzDecodeAgentMetadata(f *testing.F) {
	addSeeds(f, metadataSeeds(f)...)
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := DecodeAgentMetadata(b)
		if (m == nil) == (err == nil) {
			t.Fatalf("value %v with error %v", m, err)
		}
		if err != nil {
			return
		}
		m2, err := DecodeAgentMetadata(m.Encode())
		if err != nil || !reflect.DeepEqual(m, m2) {
			t.Fatalf("re-encoded metadata does not round-trip: %v", err)
		}
	})
}

func FuzzDecodeHandshakePayload(f *testing.F) {
	addSeeds(f, unhex(f, payloadHex), errorPayload(codeNotReady, "x"),
		(&HandshakePayload{"h", minimalMetadata().Encode()}).Encode(), []byte{0x82, 0xc1})
	f.Fuzz(func(t *testing.T, b []byte) {
		p, err := DecodeHandshakePayload(b)
		if (p == nil) == (err == nil) {
			t.Fatalf("value %v with error %v", p, err)
		}
		if err != nil {
			return
		}
		p2, err := DecodeHandshakePayload(p.Encode())
		if err != nil || p2.CompatibilityHash != p.CompatibilityHash || !bytes.Equal(p2.AgentMetadataBytes, p.AgentMetadataBytes) {
			t.Fatalf("re-encoded payload does not round-trip: %v", err)
		}
	})
}

func FuzzDecodeRequest(f *testing.F) {
	tag, _, _ := authTag([]byte("k"), Rank{1, 2})
	addSeeds(f, unhex(f, requestHex), EncodeRequest(Rank{3, 70000}), encodeRequest(tag, Rank{1, 2}), []byte{0x93, 0xa1, 'x', 0xff, 0xd3})
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := DecodeRequest(b)
		if (r == nil) == (err == nil) {
			t.Fatalf("value %v with error %v", r, err)
		}
		if err == nil {
			r2, err := DecodeRequest(encodeRequest(r.Tag, r.Rank))
			if err != nil || r2.Rank != r.Rank || !bytes.Equal(r2.Tag, r.Tag) {
				t.Fatalf("re-encoded request does not round-trip: %v", err)
			}
		}
	})
}

// FuzzDecodeKVDigestRequest also checks the dispatch: every KV digest query
// takes the KV path, and every handshake request whose tag is not a KV tag
// keeps the handshake path.
func FuzzDecodeKVDigestRequest(f *testing.F) {
	tag, _, _ := kvDigestAuthTag([]byte("k"), "r")
	addSeeds(f, unhex(f, kvRequestHex), encodeKVDigestRequest(tag, "req-1"), EncodeKVDigestRequest(strings.Repeat("x", MaxKVRequestIDLen)),
		append(EncodeKVDigestRequest("r"), 0xc0), []byte{0x92, 0xa1, 'x', 0xa1, 'y'}, []byte{0x93, 0xa0, 0xa1, 'x', 0x00}, unhex(f, requestHex))
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := DecodeKVDigestRequest(b)
		if (r == nil) == (err == nil) {
			t.Fatalf("value %v with error %v", r, err)
		}
		if err == nil {
			if !isKVDigestQuery(b) {
				t.Fatal("a KV digest query takes the handshake path")
			}
			if len(r.RequestID) == 0 || len(r.RequestID) > MaxKVRequestIDLen {
				t.Fatalf("request id of %d bytes accepted", len(r.RequestID))
			}
			r2, err := DecodeKVDigestRequest(encodeKVDigestRequest(r.Tag, r.RequestID))
			if err != nil || r2.RequestID != r.RequestID || !bytes.Equal(r2.Tag, r.Tag) {
				t.Fatalf("re-encoded query does not round-trip: %v", err)
			}
		}
		if hr, err := DecodeRequest(b); err == nil && !bytes.HasPrefix(hr.Tag, []byte(KVDigestMsg)) && isKVDigestQuery(b) {
			t.Fatalf("handshake request with tag %q takes the KV digest path", hr.Tag)
		}
	})
}

func FuzzDecodeKVDigestReply(f *testing.F) {
	addSeeds(f, (&KVDigestReply{Status: KVDigestOK, Digest: []byte("d")}).Encode(), kvDigestErrorReply(codeBadRequest, "x"),
		(&KVDigestReply{Status: KVDigestPending}).Encode(), []byte{0x81, 0xa6, 's', 't', 'a', 't', 'u', 's', 0xa4, 'n', 'o', 'n', 'e'}, []byte{0x83, 0xc1})
	f.Fuzz(func(t *testing.T, b []byte) {
		p, err := DecodeKVDigestReply(b)
		if (p == nil) == (err == nil) {
			t.Fatalf("value %v with error %v", p, err)
		}
		if err != nil {
			return
		}
		p2, err := DecodeKVDigestReply(p.Encode())
		if err != nil || !reflect.DeepEqual(p, p2) {
			t.Fatalf("re-encoded reply does not round-trip: %v", err)
		}
	})
}

// FuzzListenerKVDigest answers arbitrary KV digest request frames. Properties:
// every reply is one well-formed body (two frames only for a verified
// authenticated query); the digest is served only for a well-formed query
// for the id that has one and, with a secret, only to a query whose MAC
// verifies, bound by the reply MAC.
func FuzzListenerKVDigest(f *testing.F) {
	tag, _, err := kvDigestAuthTag([]byte("k"), "r")
	if err != nil {
		f.Fatal(err)
	}
	f.Add(EncodeKVDigestRequest("r"), false)
	f.Add(EncodeKVDigestRequest("r"), true)
	f.Add(encodeKVDigestRequest(tag, "r"), true)
	f.Add(encodeKVDigestRequest(tag, "r"), false)
	f.Add(encodeKVDigestRequest(tag, "s"), true)
	f.Add(EncodeKVDigestRequest("p"), false)
	f.Add(EncodeKVDigestRequest("boom"), false)
	f.Add([]byte{0x92, 0x01, 0xa1, 'r'}, false)
	f.Fuzz(func(t *testing.T, b []byte, withSecret bool) {
		var secret []byte
		if withSecret {
			secret = []byte("k")
		}
		l := &Listener{cfg: ListenerConfig{Secret: secret, MaxFrameSize: 1 << 20, KVDigest: func(id string) (string, []byte) {
			switch id {
			case "r":
				return KVDigestOK, []byte("digest")
			case "p":
				return KVDigestPending, nil
			case "boom":
				panic("provider bug")
			}
			return KVDigestNone, nil
		}}, log: zap.NewNop()}
		if !isKVDigestQuery(b) {
			return
		}
		reply := l.handle([][]byte{b})
		if len(reply) != 1 && len(reply) != 2 {
			t.Fatalf("reply of %d frames", len(reply))
		}
		p, err := DecodeKVDigestReply(reply[0])
		if err != nil {
			t.Fatalf("reply body does not decode: %v", err)
		}
		req, rerr := DecodeKVDigestRequest(b)
		var nonce, mac []byte
		authed := false
		if rerr == nil {
			nonce, mac, authed = splitKVDigestAuthTag(req.Tag)
		}
		verified := rerr == nil && authed == withSecret && (!authed || bytes.Equal(mac, kvDigestRequestMAC(secret, nonce, req.RequestID)))
		if !verified && (p.Status != KVDigestError || len(reply) != 1) {
			t.Fatalf("answered %q in %d frames to an unverified query (%v)", p.Status, len(reply), rerr)
		}
		if !verified {
			return
		}
		if withSecret != (len(reply) == 2) || (withSecret && !bytes.Equal(reply[1], kvDigestReplyMAC(secret, mac, reply[0]))) {
			t.Fatal("reply MAC missing or not binding the reply")
		}
		if (p.Status == KVDigestOK) != (req.RequestID == "r") || (p.Status == KVDigestOK && string(p.Digest) != "digest") {
			t.Fatalf("answered %+v for %q", p, req.RequestID)
		}
	})
}

// FuzzClientKVDigestReply feeds arbitrary reply bytes to the KV digest
// query. Properties: no panic; a reply exactly when no error, with status
// ok, pending or none; never accepted with a secret configured (the request
// MAC is random per query).
func FuzzClientKVDigestReply(f *testing.F) {
	ok := (&KVDigestReply{Status: KVDigestOK, Digest: []byte("d")}).Encode()
	f.Add(reqMessage(ok), false)
	f.Add(reqMessage(ok), true)
	f.Add(reqMessage(ok, make([]byte, 32)), true)
	f.Add(reqMessage(ok, make([]byte, 32)), false)
	f.Add(reqMessage(kvDigestErrorReply(codeAuthFailed, "x")), true)
	f.Add(reqMessage(errorPayload(codeBadRequest, "x"), EncodeClock(1)), false)
	f.Add(reqMessage([]byte{0x81, 0xa6, 's', 't', 'a', 't', 'u', 's', 0xa1, 'x'}), false)
	f.Fuzz(func(t *testing.T, b []byte, withSecret bool) {
		var secret []byte
		if withSecret {
			secret = []byte("k")
		}
		c := NewClient(ClientConfig{Secret: secret})
		defer c.Close()
		z := &zconn{c: nopConn{}, r: bufio.NewReader(bytes.NewReader(b)), maxFrame: 1 << 16, maxFrames: 8}
		reply, err := c.kvQuery(context.Background(), z, "r")
		if (reply == nil) == (err == nil) {
			t.Fatalf("reply %v with error %v", reply, err)
		}
		if err != nil {
			return
		}
		if withSecret {
			t.Fatal("accepted a reply that cannot be authenticated")
		}
		if s := reply.Status; s != KVDigestOK && s != KVDigestPending && s != KVDigestNone {
			t.Fatalf("accepted status %q", s)
		}
		if reply.Status == KVDigestOK && reply.Digest == nil {
			t.Fatal("ok without a digest")
		}
	})
}

func FuzzDecodeClock(f *testing.F) {
	addSeeds(f, EncodeClock(123.25), []byte{0xca, 0, 0, 0, 0}, []byte{0xcf, 1, 2, 3, 4, 5, 6, 7, 8}, []byte{0xe0}, []byte{0xcb})
	f.Fuzz(func(t *testing.T, b []byte) {
		v, err := DecodeClock(b)
		if err != nil && v != 0 {
			t.Fatalf("value %v with error %v", v, err)
		}
	})
}

// nopConn is a net.Conn whose writes vanish (PONG replies while fuzzing).
type nopConn struct{}

func (nopConn) Read([]byte) (int, error)         { return 0, net.ErrClosed }
func (nopConn) Write(p []byte) (int, error)      { return len(p), nil }
func (nopConn) Close() error                     { return nil }
func (nopConn) LocalAddr() net.Addr              { return nil }
func (nopConn) RemoteAddr() net.Addr             { return nil }
func (nopConn) SetDeadline(time.Time) error      { return nil }
func (nopConn) SetReadDeadline(time.Time) error  { return nil }
func (nopConn) SetWriteDeadline(time.Time) error { return nil }

// FuzzZMTPRead feeds arbitrary bytes to the frame reader that faces the
// network: no panic, frames exactly when no error, and every frame within the
// limit.
func FuzzZMTPRead(f *testing.F) {
	var msg bytes.Buffer
	for _, fr := range [][]byte{frameHeader(0, flagMore), frameHeader(17, 0), unhex(f, requestHex)} {
		msg.Write(fr)
	}
	ping := append(frameHeader(11, flagCommand), "\x04PING\x00\x0aabcd"...)
	long := append(frameHeader(300, 0), make([]byte, 300)...)
	addSeeds(f, msg.Bytes(), append(ping, msg.Bytes()...), long, []byte{0x03, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff})
	const limit = 1 << 12
	f.Fuzz(func(t *testing.T, b []byte) {
		z := &zconn{c: nopConn{}, r: bufio.NewReader(bytes.NewReader(b)), maxFrame: limit, maxFrames: 8}
		for i := 0; i < 4; i++ {
			frames, err := z.readMsg()
			if (frames == nil) == (err == nil) {
				t.Fatalf("frames %v with error %v", frames, err)
			}
			if err != nil {
				return
			}
			for _, fr := range frames {
				if len(fr) > limit {
					t.Fatalf("frame of %d bytes passed the %d limit", len(fr), limit)
				}
			}
		}
	})
}

// FuzzZMTPCommand covers READY/ERROR/PING parsing of peer commands.
func FuzzZMTPCommand(f *testing.F) {
	ready := appendProp(appendProp([]byte("\x05READY"), "Socket-Type", "REQ"), "Identity", "")
	addSeeds(f, ready, []byte("\x05ERROR\x03bad"), []byte("\x04PING\x00\x01"), []byte("\x05READY\x01"), []byte{0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		name, props, err := parseCommand(b)
		if err != nil && (name != "" || props != nil) {
			t.Fatalf("value %q %v with error %v", name, props, err)
		}
	})
}

// readConn is a net.Conn that reads the fuzzer's bytes and drops writes.
type readConn struct {
	nopConn
	r io.Reader
}

func (c *readConn) Read(p []byte) (int, error) { return c.r.Read(p) }

// readyFrame is a peer's READY command as a frame.
func readyFrame(socketType string) []byte {
	body := appendProp(appendProp([]byte("\x05READY"), "Socket-Type", socketType), "Identity", "")
	return append(frameHeader(len(body), flagCommand), body...)
}

// reqMessage frames a REQ request: empty delimiter, then the body.
func reqMessage(frames ...[]byte) []byte {
	out := frameHeader(0, flagMore)
	for i, fr := range frames {
		fl := byte(flagMore)
		if i == len(frames)-1 {
			fl = 0
		}
		out = append(append(out, frameHeader(len(fr), fl)...), fr...)
	}
	return out
}

// FuzzZMTPHandshake feeds a peer's greeting and READY (and what follows) to
// both ends of the handshake. Properties: no panic, a connection exactly when
// no error, only with a peer of an accepted socket type, and every later
// frame within the limit.
func FuzzZMTPHandshake(f *testing.F) {
	g := greeting()
	req := append(append(append([]byte{}, g...), readyFrame("REQ")...), reqMessage(unhex(f, requestHex))...)
	router := append(append(append([]byte{}, g...), readyFrame("ROUTER")...), reqMessage(unhex(f, payloadHex), EncodeClock(1))...)
	bad := append([]byte{}, g...)
	bad[12] = 'X'
	errCmd := append(append([]byte{}, g...), append(frameHeader(9, flagCommand), "\x05ERROR\x03bad"...)...)
	f.Add(req, false)
	f.Add(router, true)
	f.Add(bad, false)
	f.Add(errCmd, true)
	f.Add(append(append([]byte{}, g...), readyFrame("PUB")...), false)
	f.Add(append(append([]byte{}, g...), frameHeader(1<<20, flagCommand|flagLong)...), true)
	f.Add(g[:30], false)
	const limit = 1 << 12
	f.Fuzz(func(t *testing.T, b []byte, asClient bool) {
		own, accept := "ROUTER", []string{"REQ", "DEALER"}
		if asClient {
			own, accept = "REQ", []string{"ROUTER", "REP"}
		}
		z, err := zmtpHandshake(&readConn{r: bytes.NewReader(b)}, own, accept, limit, 8)
		if (z == nil) == (err == nil) {
			t.Fatalf("connection %v with error %v", z, err)
		}
		if err != nil {
			return
		}
		if !slices.Contains(accept, z.peerType) {
			t.Fatalf("%s accepted a %q peer", own, z.peerType)
		}
		for i := 0; i < 4; i++ {
			frames, err := z.readMsg()
			if err != nil {
				return
			}
			if len(frames) > 8 {
				t.Fatalf("%d frames passed the limit of 8", len(frames))
			}
			for _, fr := range frames {
				if len(fr) > limit {
					t.Fatalf("frame of %d bytes passed the %d limit", len(fr), limit)
				}
			}
		}
	})
}

// FuzzListenerHandle answers arbitrary request frames as the listener does.
// Properties: every reply is a well-formed payload and clock; the payload is
// served only for a well-formed request for a rank that has one, and, with a
// secret, only to a request whose MAC verifies (which the fuzzer cannot
// forge: any served reply with a secret must carry the request's own MAC).
func FuzzListenerHandle(f *testing.F) {
	tag, _, err := authTag([]byte("k"), Rank{0, 0})
	if err != nil {
		f.Fatal(err)
	}
	f.Add(EncodeRequest(Rank{0, 0}), []byte{}, uint8(1), false)
	f.Add(encodeRequest(tag, Rank{0, 0}), []byte{}, uint8(1), true)
	f.Add(encodeRequest(tag, Rank{0, 0}), []byte{}, uint8(1), false)
	f.Add(EncodeRequest(Rank{0, 0}), []byte{}, uint8(1), true)
	f.Add(EncodeRequest(Rank{1, 0}), []byte{}, uint8(1), false)
	f.Add(unhex(f, requestHex), []byte("x"), uint8(2), false)
	f.Add([]byte{}, []byte{}, uint8(0), false)
	payload := (&HandshakePayload{"h", minimalMetadata().Encode()}).Encode()
	f.Fuzz(func(t *testing.T, a, b []byte, n uint8, withSecret bool) {
		var secret []byte
		if withSecret {
			secret = []byte("k")
		}
		l := &Listener{cfg: ListenerConfig{Secret: secret, Clock: func() float64 { return 42.5 }}, log: zap.NewNop(),
			payloads: map[Rank][]byte{{0, 0}: payload}}
		body := [][]byte{a, b, a}[:n%4]
		if len(body) == 1 && isKVDigestQuery(body[0]) {
			return // the KV digest path: FuzzListenerKVDigest
		}
		reply := l.handle(body)
		if len(reply) != 2 && len(reply) != 3 {
			t.Fatalf("reply of %d frames", len(reply))
		}
		p, err := DecodeHandshakePayload(reply[0])
		if err != nil {
			t.Fatalf("reply payload does not decode: %v", err)
		}
		if c, err := DecodeClock(reply[1]); err != nil || c != 42.5 {
			t.Fatalf("reply clock %v %v", c, err)
		}
		if parseErrorPayload(p) != nil {
			if len(reply) != 2 {
				t.Fatalf("error reply of %d frames", len(reply))
			}
			return
		}
		if !bytes.Equal(reply[0], payload) || len(body) != 1 {
			t.Fatalf("served %x for %d frames", reply[0], len(body))
		}
		req, err := DecodeRequest(body[0])
		if err != nil || req.Rank != (Rank{0, 0}) {
			t.Fatalf("served a payload for request %v (%v)", req, err)
		}
		nonce, mac, authed := splitAuthTag(req.Tag)
		switch {
		case withSecret && (!authed || !bytes.Equal(mac, requestMAC(secret, nonce, req.Rank)) || len(reply) != 3):
			t.Fatal("served without a verified request MAC")
		case withSecret && !bytes.Equal(reply[2], replyMAC(secret, mac, reply[0], reply[1])):
			t.Fatal("reply MAC does not bind the reply")
		case !withSecret && (authed || len(reply) != 2):
			t.Fatal("unauthenticated listener answered an authenticated request")
		}
	})
}

// FuzzClientReply feeds arbitrary reply bytes to the client's query (what a
// remote listener, or anything at remote_host:remote_port, sends back).
// Properties: no panic; metadata exactly when no error; "retry" only with an
// error; a reply is accepted only with this engine's compatibility hash and
// never with a secret configured (the request MAC is random per query, so no
// input can authenticate).
func FuzzClientReply(f *testing.F) {
	md := minimalMetadata().Encode()
	ok := reqMessage((&HandshakePayload{"h", md}).Encode(), EncodeClock(2))
	f.Add(ok, false)
	f.Add(ok, true)
	f.Add(reqMessage((&HandshakePayload{"h", md}).Encode(), EncodeClock(2), make([]byte, 32)), true)
	f.Add(reqMessage(errorPayload(codeNotReady, "later"), EncodeClock(2)), false)
	f.Add(reqMessage((&HandshakePayload{"other", md}).Encode(), EncodeClock(2)), false)
	f.Add(reqMessage((&HandshakePayload{"h", []byte{0x80}}).Encode(), []byte{0xcb}), false)
	f.Add(reqMessage(unhex(f, payloadHex)), false)
	f.Fuzz(func(t *testing.T, b []byte, withSecret bool) {
		var secret []byte
		if withSecret {
			secret = []byte("k")
		}
		c := NewClient(ClientConfig{CompatHash: "h", Secret: secret, Clock: func() float64 { return 1 }})
		defer c.Close()
		z := &zconn{c: nopConn{}, r: bufio.NewReader(bytes.NewReader(b)), maxFrame: 1 << 16, maxFrames: 8}
		res := &Result{BestRTT: time.Duration(math.MaxInt64)}
		meta, retry, err := c.query(context.Background(), z, Rank{0, 0}, res)
		if (meta == nil) == (err == nil) {
			t.Fatalf("metadata %v with error %v", meta, err)
		}
		if retry && err == nil {
			t.Fatal("retry without an error")
		}
		if err != nil {
			return
		}
		if withSecret {
			t.Fatal("accepted a reply that cannot be authenticated")
		}
		if math.IsNaN(res.ClockOffset) {
			t.Fatal("NaN clock offset from an accepted reply")
		}
		if _, err := DecodeAgentMetadata(meta.Encode()); err != nil {
			t.Fatalf("accepted metadata does not re-encode: %v", err)
		}
	})
}

// FuzzHashFactorsJSON hashes the factor dictionary that crosses from Python
// as JSON. Properties: no panic, deterministic, a SHA-256 hex digest, and
// "" and "nixl" are the same (stock) engine kind.
func FuzzHashFactorsJSON(f *testing.F) {
	f.Add([]byte(`{"vllm_version": "0.11.0", "model": "m", "dtype": "torch.bfloat16", "num_kv_heads": 8, "speculative_config": null, "x": [1, "a", true, {"y": []}]}`), "ucx")
	f.Add([]byte(`{"a": 1.5}`), "")
	f.Add([]byte(`{"a": 99999999999999999999}`), "nixl")
	f.Add([]byte(`{"a": "\ud800\udc00\ud800"}`), "ucx")
	f.Add([]byte(`{"a": `+strings.Repeat("[", 300)+strings.Repeat("]", 300)+`}`), "")
	f.Add([]byte(`{} {}`), "")
	f.Add([]byte(`[]`), "")
	f.Fuzz(func(t *testing.T, data []byte, kind string) {
		h, err := HashFactorsJSON(data, kind)
		if err != nil {
			if h != "" {
				t.Fatalf("hash %q with error %v", h, err)
			}
			return
		}
		if len(h) != 64 || strings.Trim(h, "0123456789abcdef") != "" {
			t.Fatalf("hash %q is not a SHA-256 hex digest", h)
		}
		if h2, err := HashFactorsJSON(data, kind); err != nil || h2 != h {
			t.Fatalf("second hash %q (%v) differs from %q", h2, err, h)
		}
		if kind == "" {
			if h3, err := HashFactorsJSON(data, StockTransferEngine); err != nil || h3 != h {
				t.Fatalf(`engine kind "" and %q hash differently`, StockTransferEngine)
			}
		}
	})
}
