package sidechannel

import (
	"context"
	"os"
	"testing"
)

// go test -run='^$' -bench=. -benchmem ./sidechannel/

func BenchmarkDecodeAgentMetadata(b *testing.B) {
	full, err := os.ReadFile("testdata/golden/agent_metadata_full.hex")
	if err != nil {
		b.Fatal(err)
	}
	raw := unhex(b, string(full))
	b.SetBytes(int64(len(raw)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := DecodeAgentMetadata(raw); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkEncodeAgentMetadata(b *testing.B) {
	m := fullMetadata()
	b.ReportAllocs()
	for b.Loop() {
		_ = m.Encode()
	}
}

// BenchmarkHandshake is one full handshake (connect, 2 ranks, decode) over
// loopback TCP against a gonixl Listener.
func BenchmarkHandshake(b *testing.B) {
	l, err := NewListener(ListenerConfig{})
	if err != nil {
		b.Fatal(err)
	}
	defer l.Stop()
	for tp := 0; tp < 2; tp++ {
		if err := l.SetPayload(0, tp, payloadFor(b, "e", "hash-A", tp)); err != nil {
			b.Fatal(err)
		}
	}
	c := NewClient(ClientConfig{CompatHash: "hash-A"})
	defer c.Close()
	ranks := Ranks(1, 0, 1)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := c.Handshake(context.Background(), "127.0.0.1", l.Addr().Port, "e", ranks...); err != nil {
			b.Fatal(err)
		}
	}
}
