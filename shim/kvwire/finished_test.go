package kvwire

import (
	"reflect"
	"testing"
)

// The binary form round-trips, and an empty step is its 24-byte header.
func TestFinishedRoundTrip(t *testing.T) {
	for _, f := range []*Finished{
		{Sending: []string{}, Recving: []string{}, Failed: []string{}},
		{Sending: []string{"a", "b:c"}, Recving: []string{"é-1"}, Failed: []string{""}, LoadErrorsPending: true},
		{Sending: []string{}, Recving: []string{}, Failed: []string{}, PushArrivalsPending: true, DigestsPending: true},
		{Sending: []string{}, Recving: []string{"r"}, Failed: []string{}, StatsPending: true,
			Reshape: map[string][]BlockReshape{"r": {{Ratio: 2, Blocks: []int64{5, 1 << 40}, Covered: 3}, {Ratio: 4, Blocks: []int64{}, Covered: 0}}}},
	} {
		b := AppendFinished(nil, f)
		if n := FinishedSize(f); n != len(b) {
			t.Fatalf("FinishedSize %d, binary form %d bytes", n, len(b))
		}
		if f.Empty() && len(b) != 24 {
			t.Fatalf("an empty step is %d bytes", len(b))
		}
		got, err := DecodeFinished(b)
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(got, f) {
			t.Fatalf("round trip:\n%+v\n%+v", got, f)
		}
	}
}

// FuzzDecodeFinished: the reader allocates nothing a header announces
// beyond the bytes present, and what it accepts re-encodes to its input.
func FuzzDecodeFinished(f *testing.F) {
	f.Add(AppendFinished(nil, &Finished{Sending: []string{"x"}, Reshape: map[string][]BlockReshape{"y": {{Ratio: 2, Blocks: []int64{1}}}}}))
	f.Add(AppendFinished(nil, &Finished{}))
	f.Add([]byte{1, 0, 0, 0, 0, 0, 0, 0, 255, 255, 255, 255})
	f.Fuzz(func(t *testing.T, b []byte) {
		got, err := DecodeFinished(b)
		if err != nil {
			return
		}
		if n := FinishedSize(got); n != len(b) {
			t.Fatalf("FinishedSize %d of an accepted %d-byte form", n, len(b))
		}
		if again := AppendFinished(nil, got); string(again) != string(b) {
			t.Fatalf("accepted %x, re-encoded %x", b, again)
		}
	})
}
