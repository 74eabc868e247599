package sidechannel

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"net"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"
)

// [b"gonixl_kv_digest", "req-1"]
const kvRequestHex = "92c410676f6e69786c5f6b765f646967657374a57265712d31"

// kvProvider serves fixed answers by request id and counts its calls.
type kvProvider struct {
	mu      sync.Mutex
	answers map[string]func(call int) (string, []byte)
	calls   map[string]int
}

func newKVProvider(answers map[string]func(call int) (string, []byte)) *kvProvider {
	return &kvProvider{answers: answers, calls: map[string]int{}}
}

func (p *kvProvider) serve(id string) (string, []byte) {
	p.mu.Lock()
	p.calls[id]++
	n := p.calls[id]
	f := p.answers[id]
	p.mu.Unlock()
	if f == nil {
		return KVDigestNone, nil
	}
	return f(n)
}

func (p *kvProvider) called(id string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.calls[id]
}

func fixed(status string, digest []byte) func(int) (string, []byte) {
	return func(int) (string, []byte) { return status, digest }
}

func TestKVDigestRequestWire(t *testing.T) {
	enc := EncodeKVDigestRequest("req-1")
	if !bytes.Equal(enc, unhex(t, kvRequestHex)) || !bytes.Equal(enc, mp(t, []any{[]byte(KVDigestMsg), "req-1"})) {
		t.Errorf("EncodeKVDigestRequest = %x, want %s", enc, kvRequestHex)
	}
	long := strings.Repeat("x", MaxKVRequestIDLen)
	for _, in := range [][]byte{enc, mp(t, []any{KVDigestMsg, "req-1"}), EncodeKVDigestRequest(long)} {
		got, err := DecodeKVDigestRequest(in)
		if err != nil || string(got.Tag) != KVDigestMsg || (got.RequestID != "req-1" && got.RequestID != long) {
			t.Errorf("DecodeKVDigestRequest(%.40x) = %+v, %v", in, got, err)
		}
	}
	tag, mac, err := kvDigestAuthTag([]byte("k"), "req-1")
	if err != nil {
		t.Fatal(err)
	}
	got, err := DecodeKVDigestRequest(encodeKVDigestRequest(tag, "req-1"))
	if err != nil || !bytes.Equal(got.Tag, tag) {
		t.Fatalf("authenticated request: %+v, %v", got, err)
	}
	nonce, mac2, ok := splitKVDigestAuthTag(got.Tag)
	if !ok || !bytes.Equal(mac, mac2) || !bytes.Equal(mac, kvDigestRequestMAC([]byte("k"), nonce, "req-1")) {
		t.Error("authenticated tag does not carry the request MAC")
	}
	// The MACs as specified, computed independently.
	specMAC := func(parts ...string) []byte {
		m := hmac.New(sha256.New, []byte("k"))
		for _, p := range parts {
			m.Write([]byte(p))
		}
		return m.Sum(nil)
	}
	be64 := func(n int) string { return string(binary.BigEndian.AppendUint64(nil, uint64(n))) }
	if want := specMAC("gonixl-side-channel kv digest v1\x00", string(nonce), be64(5), "req-1"); !bytes.Equal(mac, want) {
		t.Errorf("request MAC %x, want %x", mac, want)
	}
	body := (&KVDigestReply{Status: KVDigestOK, Digest: []byte("d")}).Encode()
	if got, want := kvDigestReplyMAC([]byte("k"), mac, body), specMAC("gonixl-side-channel kv digest reply v1\x00", string(mac), be64(len(body)), string(body)); !bytes.Equal(got, want) {
		t.Errorf("reply MAC %x, want %x", got, want)
	}
	if len(tag) != len(KVDigestMsg)+len(authMarker)+16+32 || !bytes.HasPrefix(tag, []byte(KVDigestMsg+authMarker)) {
		t.Errorf("authenticated tag %q", tag)
	}

	for _, tc := range []struct {
		description string
		in          []byte
	}{
		{"three elements", mp(t, []any{[]byte(KVDigestMsg), "r", 0})},
		{"one element", mp(t, []any{[]byte(KVDigestMsg)})},
		{"map", mp(t, map[string]any{"a": 1})},
		{"int tag", mp(t, []any{5, "r"})},
		{"bin id", mp(t, []any{[]byte(KVDigestMsg), []byte("r")})},
		{"int id", mp(t, []any{[]byte(KVDigestMsg), 7})},
		{"empty id", mp(t, []any{[]byte(KVDigestMsg), ""})},
		{"id too long", EncodeKVDigestRequest(long + "x")},
		{"id not UTF-8", mp(t, []any{[]byte(KVDigestMsg), "\xff"})},
		{"trailing bytes", append(EncodeKVDigestRequest("r"), 0xc0)},
		{"handshake tag", mp(t, []any{[]byte(GetMetaMsg), "r"})},
		{"tag with a suffix", mp(t, []any{[]byte(KVDigestMsg + "x"), "r"})},
		{"short authenticated tag", encodeKVDigestRequest(tag[:len(tag)-1], "r")},
		{"handshake's authenticated tag", encodeKVDigestRequest(append([]byte(GetMetaMsg), tag[len(KVDigestMsg):]...), "r")},
		{"truncated", enc[:len(enc)-1]},
		{"empty", nil},
	} {
		got, err := DecodeKVDigestRequest(tc.in)
		var de *DecodeError
		if err == nil || got != nil || !errors.As(err, &de) {
			t.Errorf("%s: got %+v, %v; want a *DecodeError", tc.description, got, err)
		}
	}
}

func TestKVDigestReplyWire(t *testing.T) {
	for _, r := range []KVDigestReply{{KVDigestOK, "", []byte{1, 2, 3}}, {KVDigestPending, "", []byte{}},
		{KVDigestNone, "", []byte{}}, {KVDigestError, "bad-request: x", []byte{}}} {
		got, err := DecodeKVDigestReply(r.Encode())
		if err != nil || !reflect.DeepEqual(*got, r) {
			t.Errorf("%+v: got %+v, %v", r, got, err)
		}
		var m map[string]any // an independent decoder reads the same fields
		if err := msgpack.Unmarshal(r.Encode(), &m); err != nil || m["status"] != r.Status || !bytes.Equal(m["digest"].([]byte), r.Digest) {
			t.Errorf("%+v: msgpack library read %v, %v", r, m, err)
		}
	}
	// Keys in declaration order, a nil digest as empty bin.
	want := "83a6737461747573a46e6f6e65a76d657373616765a0a6646967657374c400"
	if got := (&KVDigestReply{Status: KVDigestNone}).Encode(); !bytes.Equal(got, unhex(t, want)) {
		t.Errorf("none reply encodes as %x, want %s", got, want)
	}
	// Unknown keys are skipped, message and digest default to empty.
	if got, err := DecodeKVDigestReply(mp(t, map[string]any{"status": "none", "zz": []int{1}})); err != nil || got.Status != KVDigestNone || got.Digest == nil {
		t.Errorf("minimal reply: %+v, %v", got, err)
	}
	for _, tc := range []struct {
		description string
		in          []byte
	}{
		{"unknown status", mp(t, map[string]any{"status": "maybe"})},
		{"missing status", mp(t, map[string]any{"digest": []byte{1}})},
		{"str digest", mp(t, map[string]any{"status": "ok", "digest": "x"})},
		{"bin status", mp(t, map[string]any{"status": []byte("ok")})},
		{"array", mp(t, []any{"ok"})},
		{"trailing bytes", append((&KVDigestReply{Status: KVDigestOK}).Encode(), 0xc0)},
		{"empty", nil},
	} {
		if got, err := DecodeKVDigestReply(tc.in); err == nil || got != nil {
			t.Errorf("%s: got %+v, %v; want an error", tc.description, got, err)
		}
	}
}

// The dispatch leaves every handshake request, well formed or not, to the
// handshake path.
func TestKVDigestDispatch(t *testing.T) {
	tag, _, _ := authTag([]byte("k"), Rank{0, 0})
	kvTag, _, _ := kvDigestAuthTag([]byte("k"), "r")
	for _, tc := range []struct {
		description string
		in          []byte
		want        bool
	}{
		{"vLLM request", unhex(t, requestHex), false},
		{"authenticated handshake", encodeRequest(tag, Rank{0, 0}), false},
		{"unexpected handshake tag", mp(t, []any{[]byte("hello"), 0, 0}), false},
		{"two-element handshake", mp(t, []any{[]byte(GetMetaMsg), 0}), false},
		{"str handshake tag", mp(t, []any{GetMetaMsg, 1, 2}), false},
		{"not msgpack", []byte{0xc1}, false},
		{"empty array", []byte{0x90}, false},
		{"map", mp(t, map[string]any{}), false},
		{"KV query", EncodeKVDigestRequest("r"), true},
		{"authenticated KV query", encodeKVDigestRequest(kvTag, "r"), true},
		{"KV query of three elements", mp(t, []any{[]byte(KVDigestMsg), "r", 0}), true},
		{"KV tag alone", mp(t, []any{KVDigestMsg}), true},
		{"two elements, other tag", mp(t, []any{[]byte("hello"), "r"}), true},
		{"two elements, int tag", mp(t, []any{1, "r"}), true},
	} {
		if got := isKVDigestQuery(tc.in); got != tc.want {
			t.Errorf("%s: isKVDigestQuery = %v, want %v", tc.description, got, tc.want)
		}
	}
}

func TestKVDigestRoundTrip(t *testing.T) {
	p := newKVProvider(map[string]func(int) (string, []byte){
		"ok":    fixed(KVDigestOK, []byte("digest-bytes")),
		"empty": fixed(KVDigestOK, nil),
		"later": func(call int) (string, []byte) {
			if call < 4 {
				return KVDigestPending, []byte("ignored")
			}
			return KVDigestOK, []byte("late digest")
		},
		"gone": fixed(KVDigestNone, []byte("ignored")),
	})
	l := startListener(t, ListenerConfig{KVDigest: p.serve}, "e", 0)
	c := newTestClient(t, ClientConfig{})
	port := l.Addr().Port
	for _, tc := range []struct {
		id   string
		want []byte // nil: "none"
	}{{"ok", []byte("digest-bytes")}, {"empty", []byte{}}, {"later", []byte("late digest")}, {"gone", nil}, {"unknown", nil}} {
		got, err := c.KVDigest(ctxT(t), "127.0.0.1", port, tc.id)
		if err != nil || !bytes.Equal(got, tc.want) || (got == nil) != (tc.want == nil) {
			t.Errorf("%s: got %q, %v; want %q", tc.id, got, err, tc.want)
		}
	}
	if n := p.called("later"); n != 4 {
		t.Errorf("pending request polled %d times, want 4", n)
	}
	// 4 answered ok/none plus 1 final ok after 3 pending.
	if served, refused := l.Counts(); served != 5 || refused != 3 {
		t.Errorf("served %d refused %d, want 5 and 3", served, refused)
	}
	// Without a provider every query is answered "none".
	l2 := startListener(t, ListenerConfig{}, "e", 0)
	if got, err := c.KVDigest(ctxT(t), "127.0.0.1", l2.Addr().Port, "ok"); got != nil || err != nil {
		t.Errorf("no provider: %q, %v", got, err)
	}
	// The handshake still works on a listener that serves digests.
	if _, err := c.Handshake(ctxT(t), "127.0.0.1", port, "e", Rank{0, 0}); err != nil {
		t.Errorf("handshake: %v", err)
	}
}

func TestKVDigestPendingTimeout(t *testing.T) {
	p := newKVProvider(map[string]func(int) (string, []byte){"r": fixed(KVDigestPending, nil)})
	l := startListener(t, ListenerConfig{KVDigest: p.serve}, "e")
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	got, err := newTestClient(t, ClientConfig{}).KVDigest(ctx, "127.0.0.1", l.Addr().Port, "r")
	if got != nil || !errors.Is(err, ErrTimeout) || !strings.Contains(err.Error(), "last status: pending") ||
		!strings.Contains(err.Error(), l.Addr().String()) {
		t.Fatalf("got %q, %v; want an ErrTimeout naming the address and the pending status", got, err)
	}
	if el := time.Since(start); el > 5*time.Second {
		t.Errorf("returned after %v", el)
	}
	if n := p.called("r"); n < 2 {
		t.Errorf("polled %d times", n)
	}
	// A canceled context is not a timeout.
	ctx, cancel = context.WithCancel(context.Background())
	time.AfterFunc(100*time.Millisecond, cancel)
	if _, err := newTestClient(t, ClientConfig{}).KVDigest(ctx, "127.0.0.1", l.Addr().Port, "r"); !errors.Is(err, context.Canceled) || errors.Is(err, ErrTimeout) {
		t.Errorf("canceled: %v", err)
	}
}

func TestKVDigestAuthentication(t *testing.T) {
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
		p := newKVProvider(map[string]func(int) (string, []byte){"r": func(call int) (string, []byte) {
			if call == 1 {
				return KVDigestPending, nil
			}
			return KVDigestOK, []byte("d")
		}})
		l := startListener(t, ListenerConfig{Secret: lk, KVDigest: p.serve}, "e")
		got, err := newTestClient(t, ClientConfig{Secret: ck}).KVDigest(ctxT(t), "127.0.0.1", l.Addr().Port, "r")
		switch {
		case tc.want == "" && (err != nil || string(got) != "d"):
			t.Errorf("%s: %q, %v", tc.description, got, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want) || !errors.Is(err, ErrAuth) || got != nil):
			t.Errorf("%s: got %q, %v; want an ErrAuth containing %q", tc.description, got, err, tc.want)
		case tc.want != "" && p.called("r") != 0:
			t.Errorf("%s: provider called for an unauthenticated query", tc.description)
		}
		if _, refused := l.Counts(); tc.want != "" && refused != 1 {
			t.Errorf("%s: refused %d, want 1", tc.description, refused)
		}
	}
}

// kvRouter answers each KV digest query with reply(request frames).
func kvRouter(t *testing.T, reply func(frames [][]byte) [][]byte) int {
	return fakeRouter(t, func(z *zconn, frames [][]byte) { z.writeMsg(append([][]byte{{}}, reply(frames)...)...) })
}

func TestKVDigestClientChecksReplies(t *testing.T) {
	ok := (&KVDigestReply{Status: KVDigestOK, Digest: []byte("d")}).Encode()
	// The reply MAC a correct listener would send for this request.
	sealed := func(frames [][]byte) [][]byte {
		req, err := DecodeKVDigestRequest(frames[1])
		if err != nil {
			t.Errorf("request: %v", err)
			return [][]byte{ok}
		}
		_, mac, _ := splitKVDigestAuthTag(req.Tag)
		return [][]byte{ok, kvDigestReplyMAC([]byte("k"), mac, ok)}
	}
	for _, tc := range []struct {
		description string
		reply       func([][]byte) [][]byte
		secret      []byte
		want        string // "" = success
		auth        bool
	}{
		{"correct MAC", sealed, []byte("k"), "", false},
		{"plain reply", func([][]byte) [][]byte { return [][]byte{ok} }, nil, "", false},
		{"unauthenticated reply to a secret", func([][]byte) [][]byte { return [][]byte{ok} }, []byte("k"), "reply is not authenticated", true},
		{"forged MAC", func([][]byte) [][]byte { return [][]byte{ok, make([]byte, 32)} }, []byte("k"), "secrets differ", true},
		{"MAC under another secret", sealed, []byte("other"), "secrets differ", true},
		{"authenticated reply without a secret", func([][]byte) [][]byte { return [][]byte{ok, make([]byte, 32)} }, nil, "this side has no side-channel secret", true},
		{"error reply", func([][]byte) [][]byte { return [][]byte{kvDigestErrorReply(codeBadRequest, "no good")} }, nil, "bad-request: no good", false},
		{"auth error reply", func([][]byte) [][]byte { return [][]byte{kvDigestErrorReply(codeAuthFailed, "x")} }, nil, "auth-failed", true},
		{"garbage", func([][]byte) [][]byte { return [][]byte{{0xc1}} }, nil, "malformed KV digest reply", false},
		{"unknown status", func([][]byte) [][]byte { return [][]byte{mp(t, map[string]any{"status": "later"})} }, nil, "malformed KV digest reply", false},
		{"handshake reply", func([][]byte) [][]byte { return [][]byte{errorPayload(codeBadRequest, "x"), EncodeClock(1)} }, nil, "does not serve KV digest queries", false},
		{"three frames", func([][]byte) [][]byte { return [][]byte{ok, ok, ok} }, nil, "1- or 2-frame", false},
	} {
		port := kvRouter(t, tc.reply)
		got, err := newTestClient(t, ClientConfig{Secret: tc.secret}).KVDigest(ctxT(t), "127.0.0.1", port, "r")
		switch {
		case tc.want == "" && (err != nil || string(got) != "d"):
			t.Errorf("%s: %q, %v", tc.description, got, err)
		case tc.want != "" && (err == nil || got != nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%s: got %q, %v; want an error containing %q", tc.description, got, err, tc.want)
		case tc.want != "" && errors.Is(err, ErrAuth) != tc.auth:
			t.Errorf("%s: errors.Is(%v, ErrAuth) = %v", tc.description, err, !tc.auth)
		}
	}
}

// With no secret the query on the wire is [b"", msgpack([b"gonixl_kv_digest", id])].
func TestKVDigestRequestBytesOnTheWire(t *testing.T) {
	got := make(chan [][]byte, 1)
	port := kvRouter(t, func(frames [][]byte) [][]byte {
		got <- frames
		return [][]byte{(&KVDigestReply{Status: KVDigestNone}).Encode()}
	})
	if d, err := newTestClient(t, ClientConfig{}).KVDigest(ctxT(t), "127.0.0.1", port, "req-1"); d != nil || err != nil {
		t.Fatal(d, err)
	}
	frames := <-got
	if len(frames) != 2 || len(frames[0]) != 0 || !bytes.Equal(frames[1], unhex(t, kvRequestHex)) {
		t.Errorf("request frames = %x", frames)
	}
}

// kvExchange sends raw frames and decodes the KV digest reply body.
func kvExchange(t *testing.T, z *zconn, frames ...[]byte) (*KVDigestReply, int) {
	t.Helper()
	if err := z.writeMsg(frames...); err != nil {
		t.Fatal(err)
	}
	reply, err := z.readMsg()
	if err != nil {
		t.Fatal(err)
	}
	if len(reply) < 2 || len(reply[0]) != 0 {
		t.Fatalf("reply frames %x", reply)
	}
	r, err := DecodeKVDigestReply(reply[1])
	if err != nil {
		t.Fatalf("reply %x: %v", reply[1], err)
	}
	return r, len(reply) - 1
}

func TestKVDigestListenerSurvivesBadQueries(t *testing.T) {
	p := newKVProvider(map[string]func(int) (string, []byte){"r": fixed(KVDigestOK, []byte("d"))})
	l := startListener(t, ListenerConfig{KVDigest: p.serve}, "e", 0)
	z := rawConn(t, l.Addr().Port)
	for _, tc := range []struct {
		description string
		body        []byte
	}{
		{"three elements", mp(t, []any{[]byte(KVDigestMsg), "r", 0})},
		{"one element", mp(t, []any{[]byte(KVDigestMsg)})},
		{"int id", mp(t, []any{[]byte(KVDigestMsg), 1})},
		{"bin id", mp(t, []any{[]byte(KVDigestMsg), []byte("r")})},
		{"int tag", mp(t, []any{1, "r"})},
		{"other tag", mp(t, []any{[]byte("hello"), "r"})},
		{"empty id", mp(t, []any{[]byte(KVDigestMsg), ""})},
		{"id too long", EncodeKVDigestRequest(strings.Repeat("r", MaxKVRequestIDLen+1))},
		{"trailing bytes", append(EncodeKVDigestRequest("r"), 0xc0)},
	} {
		r, n := kvExchange(t, z, []byte{}, tc.body)
		if r.Status != KVDigestError || n != 1 || !strings.HasPrefix(r.Message, codeBadRequest+": ") {
			t.Errorf("%s: reply %+v in %d frames, want a 1-frame bad-request error", tc.description, r, n)
		}
	}
	if p.called("r") != 0 {
		t.Error("provider called for a malformed query")
	}
	// The same connection, and the listener, keep serving both kinds.
	if r, _ := kvExchange(t, z, []byte{}, EncodeKVDigestRequest("r")); r.Status != KVDigestOK || string(r.Digest) != "d" {
		t.Errorf("valid query after bad ones: %+v", r)
	}
	if err := z.writeMsg([]byte{}, EncodeRequest(Rank{0, 0})); err != nil {
		t.Fatal(err)
	}
	if reply, err := z.readMsg(); err != nil || len(reply) != 3 || !bytes.Equal(reply[1], payloadFor(t, "e", "hash-A", 0)) {
		t.Errorf("handshake on the same connection: %x, %v", reply, err)
	}
	if _, err := newTestClient(t, ClientConfig{}).Handshake(ctxT(t), "127.0.0.1", l.Addr().Port, "e", Rank{0, 0}); err != nil {
		t.Errorf("handshake after bad queries: %v", err)
	}
	if served, refused := l.Counts(); served != 3 || refused != 9 {
		t.Errorf("served %d refused %d, want 3 and 9", served, refused)
	}
}

func TestKVDigestProviderFailures(t *testing.T) {
	p := newKVProvider(map[string]func(int) (string, []byte){
		"panic":   func(int) (string, []byte) { panic("provider bug") },
		"odd":     fixed("maybe", nil),
		"error":   fixed(KVDigestError, nil),
		"huge":    fixed(KVDigestOK, make([]byte, 8192)),
		"fine":    fixed(KVDigestOK, []byte("d")),
		"pending": fixed(KVDigestPending, nil),
	})
	for _, secret := range [][]byte{nil, []byte("k")} {
		l := startListener(t, ListenerConfig{KVDigest: p.serve, MaxFrameSize: 4096, Secret: secret}, "e", 0)
		c := newTestClient(t, ClientConfig{Secret: secret})
		for _, tc := range []struct{ id, want string }{
			{"panic", "provider bug"}, {"odd", `status "maybe"`}, {"error", `status "error"`}, {"huge", "exceeds the frame limit"},
		} {
			got, err := c.KVDigest(ctxT(t), "127.0.0.1", l.Addr().Port, tc.id)
			var re *RemoteError
			if got != nil || !errors.As(err, &re) || re.Code != codeProviderFailed || !strings.Contains(err.Error(), tc.want) || errors.Is(err, ErrAuth) {
				t.Errorf("secret %q, %s: got %d bytes, %v; want a provider-failed error containing %q", secret, tc.id, len(got), err, tc.want)
			}
		}
		if got, err := c.KVDigest(ctxT(t), "127.0.0.1", l.Addr().Port, "fine"); err != nil || string(got) != "d" {
			t.Errorf("secret %q: after provider failures: %q, %v", secret, got, err)
		}
		if _, err := c.Handshake(ctxT(t), "127.0.0.1", l.Addr().Port, "e", Rank{0, 0}); err != nil {
			t.Errorf("secret %q: handshake after provider failures: %v", secret, err)
		}
		if served, refused := l.Counts(); served != 2 || refused != 4 {
			t.Errorf("secret %q: served %d refused %d, want 2 and 4", secret, served, refused)
		}
	}
}

// The provider runs with no listener lock held, so it may call back into
// the listener (SetPayload takes the write lock).
func TestKVDigestProviderUnlocked(t *testing.T) {
	var l *Listener
	ready := make(chan struct{})
	provider := func(string) (string, []byte) {
		<-ready
		if !l.mu.TryLock() { // held (even read-locked) by the caller
			return KVDigestError, nil
		}
		l.mu.Unlock()
		return KVDigestOK, []byte("d")
	}
	l = startListener(t, ListenerConfig{KVDigest: provider}, "e")
	close(ready)
	c := newTestClient(t, ClientConfig{RecvTimeout: 3 * time.Second})
	if got, err := c.KVDigest(ctxT(t), "127.0.0.1", l.Addr().Port, "r"); err != nil || string(got) != "d" {
		t.Fatalf("got %q, %v", got, err)
	}
}

func TestKVDigestClientLifecycle(t *testing.T) {
	var inflight atomic.Int64
	p := newKVProvider(map[string]func(int) (string, []byte){"wait": fixed(KVDigestPending, nil)})
	l := startListener(t, ListenerConfig{KVDigest: func(id string) (string, []byte) {
		if strings.HasPrefix(id, "id-") {
			inflight.Add(1)
			return KVDigestOK, []byte(id)
		}
		return p.serve(id)
	}}, "e")
	port := l.Addr().Port
	c := newTestClient(t, ClientConfig{})
	for _, id := range []string{"", strings.Repeat("x", MaxKVRequestIDLen+1)} {
		if got, err := c.KVDigest(ctxT(t), "127.0.0.1", port, id); err == nil || got != nil || !strings.Contains(err.Error(), "request id of") {
			t.Errorf("id of %d bytes: %q, %v", len(id), got, err)
		}
	}
	// Concurrent queries each get their own answer.
	var wg sync.WaitGroup
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			id := "id-" + strconv.Itoa(i)
			if got, err := c.KVDigest(ctxT(t), "127.0.0.1", port, id); err != nil || string(got) != id {
				t.Errorf("%s: %q, %v", id, got, err)
			}
		}(i)
	}
	wg.Wait()
	if inflight.Load() != 8 {
		t.Errorf("provider saw %d queries, want 8", inflight.Load())
	}
	// Close ends a query that is polling a pending digest.
	errc := make(chan error, 1)
	go func() {
		_, err := c.KVDigest(context.Background(), "127.0.0.1", port, "wait")
		errc <- err
	}()
	for deadline := time.Now().Add(10 * time.Second); p.called("wait") < 2; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the pending query is not polled")
		}
	}
	done := make(chan struct{})
	go func() { c.Close(); close(done) }()
	select {
	case err := <-errc:
		if !errors.Is(err, ErrClosed) {
			t.Errorf("query during Close: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not end the polling query")
	}
	<-done
	if _, err := c.KVDigest(ctxT(t), "127.0.0.1", port, "id-0"); !errors.Is(err, ErrClosed) {
		t.Errorf("after Close: %v", err)
	}
	// Nothing listening: refused quickly, not a hang.
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	dead := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	if _, err := newTestClient(t, ClientConfig{}).KVDigest(ctxT(t), "127.0.0.1", dead, "r"); !errors.Is(err, ErrRefused) {
		t.Errorf("no listener: %v", err)
	}
	// A listener that never answers: the per-query timeout fires.
	silent := fakeRouter(t, func(*zconn, [][]byte) {})
	if _, err := newTestClient(t, ClientConfig{RecvTimeout: 300 * time.Millisecond}).KVDigest(ctxT(t), "127.0.0.1", silent, "r"); !errors.Is(err, ErrTimeout) || !strings.Contains(err.Error(), "no reply yet") {
		t.Errorf("silent listener: %v", err)
	}
}

// A query polling a pending digest holds no listener connection between
// its polls: hundreds of read-backs waiting on a slow decode must not take
// the listener's MaxConns slots from handshakes.
func TestKVDigestPollerHoldsNoConnection(t *testing.T) {
	p := newKVProvider(map[string]func(int) (string, []byte){"r": func(call int) (string, []byte) {
		if call < 6 {
			return KVDigestPending, nil
		}
		return KVDigestOK, []byte("d")
	}})
	l := startListener(t, ListenerConfig{KVDigest: p.serve, MaxConns: 1}, "e", 0)
	c := newTestClient(t, ClientConfig{})
	done := make(chan error, 1)
	go func() {
		_, err := c.KVDigest(ctxT(t), "127.0.0.1", l.Addr().Port, "r")
		done <- err
	}()
	// While it polls, the listener's one slot serves a handshake: the
	// slot is free between polls (a held connection, not idle for a
	// second, would be refused room).
	for p.called("r") < 2 {
		time.Sleep(time.Millisecond)
	}
	if _, err := c.Handshake(ctxT(t), "127.0.0.1", l.Addr().Port, "e", Rank{0, 0}); err != nil {
		t.Fatalf("a handshake while a digest query polls: %v", err)
	}
	if err := <-done; err != nil {
		t.Fatalf("the query: %v", err)
	}
	if n := p.called("r"); n != 6 {
		t.Errorf("polled %d times, want 6", n)
	}
}
