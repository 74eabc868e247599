package memhash

import (
	"math/rand/v2"
	"testing"
	"unsafe"
)

func spanOf(b []byte) Span {
	return Span{Addr: uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))), Len: uint64(len(b))}
}

// Split spans hash as their concatenation does, and a change of any byte
// changes the hash.
func TestSum64IsTheStreamsHash(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	buf := make([]byte, 1<<16)
	for i := range buf {
		buf[i] = byte(rng.Uint32())
	}
	whole := Bytes(buf)
	if got := Sum64([]Span{spanOf(buf)}); got != whole {
		t.Fatalf("one span: %x, want %x", got, whole)
	}
	for range 50 {
		var spans []Span
		for off := 0; off < len(buf); {
			n := min(len(buf)-off, 1+rng.IntN(3000))
			spans = append(spans, spanOf(buf[off:off+n]))
			off += n
		}
		if got := Sum64(spans); got != whole {
			t.Fatalf("%d spans: %x, want %x", len(spans), got, whole)
		}
	}
	i := rng.IntN(len(buf))
	buf[i] ^= 1
	if Sum64([]Span{spanOf(buf)}) == whole {
		t.Fatalf("flipping bit 0 of byte %d left the hash unchanged", i)
	}
	if Sum64(nil) != Bytes(nil) {
		t.Fatal("no spans is not the empty stream's hash")
	}
}

func BenchmarkSum64(b *testing.B) {
	buf := make([]byte, 14<<20)
	for i := range buf {
		buf[i] = byte(i * 7)
	}
	s := []Span{spanOf(buf)}
	b.SetBytes(int64(len(buf)))
	for b.Loop() {
		Sum64(s)
	}
}
