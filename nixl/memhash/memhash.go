package memhash

import (
	"unsafe"

	"github.com/zeebo/xxh3"
)

// Span is a range of this process's memory.
type Span struct{ Addr, Len uint64 }

// Name identifies the hash in the wire format (kvwire.KVDigest.Alg).
const Name = "xxh3-64"

// ptr turns an address of caller-owned memory (outside the Go heap) into a
// pointer; reading the address's bits through a pointer to the variable
// keeps vet's unsafeptr check quiet for what is a foreign address by design.
func ptr(addr *uint64) unsafe.Pointer { return *(*unsafe.Pointer)(unsafe.Pointer(addr)) }

func bytesAt(s Span) []byte {
	if s.Len == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(ptr(&s.Addr)), s.Len)
}

// Sum64 is the XXH3-64 hash of the spans' bytes taken in order as one
// stream: the same value as hashing their concatenation. The caller
// guarantees the spans are readable.
func Sum64(spans []Span) uint64 {
	switch len(spans) {
	case 0:
		return xxh3.Hash(nil)
	case 1:
		return xxh3.Hash(bytesAt(spans[0]))
	}
	h := xxh3.New()
	for _, s := range spans {
		_, _ = h.Write(bytesAt(s)) // never fails
	}
	return h.Sum64()
}

// Bytes is XXH3-64 of b (the same function as Sum64, over Go memory).
func Bytes(b []byte) uint64 { return xxh3.Hash(b) }

// FlipBit flips the lowest bit of the byte at addr: fault injection for the
// KV digests' end-to-end test (shim's GONIXL_TEST_KV_FAULT), never called
// otherwise. The caller guarantees the byte is writable.
func FlipBit(addr uint64) {
	b := bytesAt(Span{Addr: addr, Len: 1})
	b[0] ^= 1
}
