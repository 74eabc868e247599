package ucx

import (
	"encoding/binary"
	"hash/crc32"
	"reflect"
	"strings"
	"testing"

	"github.com/gonixl/gonixl/nixl"
)

func cudaRegion() mdRegion {
	c := &mdCuda{Base: 0x7f0000000000, Size: 1 << 30}
	for i := range c.Handle {
		c.Handle[i] = byte(i * 7)
	}
	copy(c.UUID[:], "GPU-0123456789ab")
	return mdRegion{Mem: nixl.VRAM, Addr: 0x7f0000100000, Len: 1 << 20, DevID: 0, Cuda: c}
}

// A VRAM region exported for CUDA IPC travels in version 4, without an
// rkey; metadata without one stays version 3, readable by older builds.
func TestMetadataCudaRoundTrip(t *testing.T) {
	m := &metadata{Name: "gpu", Address: []byte{1, 2}, Proc: procID{BootID: "b", Pid: 1},
		Regions: []mdRegion{{Mem: nixl.DRAM, Addr: 0x1000, Len: 64, Rkey: []byte{5}}, cudaRegion()}}
	b, err := m.encode()
	if err != nil {
		t.Fatal(err)
	}
	if v := binary.LittleEndian.Uint16(b[len(mdMagic):]); v != 4 {
		t.Fatalf("version %d, want 4", v)
	}
	got, err := decodeMetadata(b)
	if err != nil {
		t.Fatal(err)
	}
	for i := range got.Regions {
		if got.Regions[i].Rkey != nil && len(got.Regions[i].Rkey) == 0 {
			got.Regions[i].Rkey = nil
		}
	}
	if !reflect.DeepEqual(got, m) {
		t.Fatalf("round trip:\n got %+v\nwant %+v", got, m)
	}
	for i := 0; i < len(b); i++ {
		if _, err := decodeMetadata(b[:i]); err == nil {
			t.Fatalf("truncated to %d bytes: no error", i)
		}
	}
	m.Regions = m.Regions[:1]
	if b, _ = m.encode(); binary.LittleEndian.Uint16(b[len(mdMagic):]) != 3 {
		t.Fatal("DRAM-only metadata not written as version 3")
	}
}

// reseal rewrites a blob's version and checksum after an edit.
func reseal(b []byte, version uint16) []byte {
	b = append([]byte(nil), b[:len(b)-4]...)
	binary.LittleEndian.PutUint16(b[len(mdMagic):], version)
	return binary.LittleEndian.AppendUint32(b, crc32.Checksum(b, castagnoli))
}

func TestMetadataCudaRejects(t *testing.T) {
	enc := func(r mdRegion) []byte {
		m := &metadata{Name: "gpu", Address: []byte{1}, Regions: []mdRegion{r}}
		b, err := m.encode()
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	onDRAM := cudaRegion()
	onDRAM.Mem = nixl.DRAM
	outside := cudaRegion()
	outside.Addr = outside.Cuda.Base + outside.Cuda.Size - 10
	good := enc(cudaRegion())
	flagAt := len(good) - 4 - mdCudaBytes - 1
	unknownFlag := append([]byte(nil), good...)
	unknownFlag[flagAt] |= 4
	noCudaNoRkey := append([]byte(nil), good[:flagAt]...)
	noCudaNoRkey = append(noCudaNoRkey, 0)
	noCudaNoRkey = append(noCudaNoRkey, good[len(good)-4:]...)
	for name, tc := range map[string]struct {
		blob []byte
		want string
	}{
		"cuda on DRAM":         {enc(onDRAM), "does not hold"},
		"region outside alloc": {enc(outside), "does not hold"},
		"unknown flag":         {reseal(unknownFlag, 4), "flags"},
		"cuda flag in v3":      {reseal(good, 3), "rkey length 0"},
		"no rkey, no handle":   {reseal(noCudaNoRkey, 4), "no rkey and no CUDA IPC handle"},
	} {
		_, err := decodeMetadata(tc.blob)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %v, want one containing %q", name, err, tc.want)
		}
	}
}
