package sidechannel

import (
	"bufio"
	"bytes"
	"net"
	"os"
	"reflect"
	"testing"
	"time"
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
