//go:build cgo && !gonixl_noucx

package ucx

import (
	"bytes"
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/gonixl/gonixl/nixl"
)

// gatherOps moves remote addresses into this process's mapping, cuts long
// runs into cudaChunk pieces and, for WRITE, copies local to remote.
func TestGatherOps(t *testing.T) {
	ops := []op{
		{laddr: 0x1000, raddr: 0x50000, len: 3*cudaChunk + 5, rkey: 1},
		{laddr: 0x900000, raddr: 0x60000, len: 100, rkey: 0},
	}
	delta := []uint64{0x1000000, 0x2000000}
	got := gatherOps(nixl.Read, ops, delta, 0)
	want := []cop{
		{src: 0x2050000, dst: 0x1000, len: cudaChunk},
		{src: 0x2050000 + cudaChunk, dst: 0x1000 + cudaChunk, len: cudaChunk},
		{src: 0x2050000 + 2*cudaChunk, dst: 0x1000 + 2*cudaChunk, len: cudaChunk},
		{src: 0x2050000 + 3*cudaChunk, dst: 0x1000 + 3*cudaChunk, len: 5},
		{src: 0x1060000, dst: 0x900000, len: 100},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("read:\n got %+v\nwant %+v", got, want)
	}
	w := gatherOps(nixl.Write, ops, delta, 0)
	for i := range w {
		if w[i].src != want[i].dst || w[i].dst != want[i].src || w[i].len != want[i].len {
			t.Fatalf("write op %d: %+v", i, w[i])
		}
	}
	var total uint64
	for _, c := range got {
		total += c.len
	}
	if total != ops[0].len+ops[1].len {
		t.Fatalf("%d bytes after splitting", total)
	}
}

// Without a CUDA driver the engine moves DRAM only and says why VRAM fails.
func TestVRAMWithoutDriver(t *testing.T) {
	if cudaAvailable() == nil {
		t.Skipf("a CUDA driver is loaded here (version %d): this test covers hosts without one", cudaDriverVersion())
	}
	e := requireUCX(t)
	if e.Supports(nixl.VRAM) {
		t.Fatal("Supports(VRAM) without a CUDA driver")
	}
	if !errors.Is(cudaAvailable(), nixl.ErrUnavailable) {
		t.Fatalf("cudaAvailable: %v", cudaAvailable())
	}
	a := newAgent(t, "novram", nil, false)
	buf := make([]byte, 4096)
	err := a.RegisterMem(nixl.VRAM, []nixl.Region{{Addr: addrOf(buf), Len: 4096}})
	var ne *nixl.Error
	if !errors.As(err, &ne) || ne.Status != nixl.ErrNotSupported || !strings.Contains(err.Error(), "CUDA driver") {
		t.Fatalf("RegisterMem(VRAM): %v", err)
	}
	md, err := a.LocalMetadata()
	if err != nil {
		t.Fatal(err)
	}
	if m, _ := decodeMetadata(md); len(m.Regions) != 0 || bytes.Contains(md, []byte("GPU-")) {
		t.Fatalf("a failed VRAM registration left regions: %+v", m.Regions)
	}
}
