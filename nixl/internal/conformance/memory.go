package conformance

import (
	"encoding/binary"
	"fmt"
	"os"
	"reflect"
	"strconv"
	"strings"
	"syscall"

	"github.com/gonixl/gonixl/nixl"
)

// Shape is the KV-cache layout of one side: Layers × 2 (K and V) regions,
// each of Blocks blocks of BlockSize bytes.
type Shape struct {
	Layers    int
	Blocks    int
	BlockSize int
}

// DefaultShape is small enough for two shared cores.
func DefaultShape() Shape { return Shape{Layers: 8, Blocks: 64, BlockSize: 16 << 10} }

// BigShape is a real model's layout (1 GiB a side).
func BigShape() Shape { return Shape{Layers: 32, Blocks: 512, BlockSize: 32 << 10} }

// ShapeFromEnv reads GONIXL_CONFORMANCE_SHAPE ("big" or "LxBxS"); unset
// means DefaultShape.
func ShapeFromEnv() (Shape, error) {
	v := strings.TrimSpace(os.Getenv("GONIXL_CONFORMANCE_SHAPE"))
	switch v {
	case "":
		return DefaultShape(), nil
	case "big":
		return BigShape(), nil
	}
	f := strings.Split(v, "x")
	if len(f) != 3 {
		return Shape{}, fmt.Errorf("GONIXL_CONFORMANCE_SHAPE=%q: want \"big\" or LAYERSxBLOCKSxBLOCKSIZE", v)
	}
	var n [3]int
	for i, s := range f {
		x, err := strconv.Atoi(s)
		if err != nil {
			return Shape{}, fmt.Errorf("GONIXL_CONFORMANCE_SHAPE=%q: %v", v, err)
		}
		n[i] = x
	}
	sh := Shape{Layers: n[0], Blocks: n[1], BlockSize: n[2]}
	return sh, sh.validate()
}

func (s Shape) validate() error {
	if s.Layers <= 0 || s.Blocks <= 0 || s.BlockSize <= 0 || s.BlockSize%8 != 0 {
		return fmt.Errorf("conformance: bad shape %+v (all positive, block size a multiple of 8)", s)
	}
	return nil
}

// Regions is the number of registered regions (K and V per layer).
func (s Shape) Regions() int { return 2 * s.Layers }

// Descs is the number of block descriptors.
func (s Shape) Descs() int { return s.Regions() * s.Blocks }

// RegionBytes is the size of one region.
func (s Shape) RegionBytes() int { return s.Blocks * s.BlockSize }

func (s Shape) String() string {
	return fmt.Sprintf("%d layers x 2 x %d blocks x %d B", s.Layers, s.Blocks, s.BlockSize)
}

// kvMem is one side's KV cache: one anonymous mapping per region, so that
// registrations are separate regions as vLLM's per-layer tensors are.
type kvMem struct {
	shape Shape
	maps  [][]byte
	// expect[i] is the (seed, source index) the pattern in block i was
	// made from; it tracks what every byte should hold.
	expect []blockSrc
}

type blockSrc struct {
	Seed uint64
	Idx  int32
}

func newKVMem(s Shape, seed uint64) (*kvMem, error) {
	if err := s.validate(); err != nil {
		return nil, err
	}
	m := &kvMem{shape: s, expect: make([]blockSrc, s.Descs())}
	for r := 0; r < s.Regions(); r++ {
		b, err := syscall.Mmap(-1, 0, s.RegionBytes(), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
		if err != nil {
			m.free()
			return nil, fmt.Errorf("conformance: mmap %d bytes: %w", s.RegionBytes(), err)
		}
		m.maps = append(m.maps, b)
	}
	for i := range m.expect {
		m.fill(int32(i), seed, int32(i))
	}
	return m, nil
}

func (m *kvMem) free() {
	for _, b := range m.maps {
		_ = syscall.Munmap(b)
	}
	m.maps = nil
}

// addr returns the address of mmap-ed memory. The mapping is outside the Go
// heap and never moves.
func addr(b []byte) uint64 { return uint64(reflect.ValueOf(b).Pointer()) }

// regions are the registration descriptors (one per region, devID 0).
func (m *kvMem) regions() []nixl.Region {
	out := make([]nixl.Region, len(m.maps))
	for i, b := range m.maps {
		out[i] = nixl.Region{Addr: addr(b), Len: uint64(len(b))}
	}
	return out
}

// blockDescs returns one descriptor per block, indexed region*Blocks+block,
// for a side whose regions start at bases.
func blockDescs(s Shape, bases []nixl.Region) []nixl.Desc {
	out := make([]nixl.Desc, 0, s.Descs())
	for _, r := range bases {
		for b := 0; b < s.Blocks; b++ {
			out = append(out, nixl.Desc{Addr: r.Addr + uint64(b*s.BlockSize), Len: uint64(s.BlockSize), DevID: r.DevID})
		}
	}
	return out
}

func (m *kvMem) block(i int32) []byte {
	s := m.shape
	r, b := int(i)/s.Blocks, int(i)%s.Blocks
	return m.maps[r][b*s.BlockSize : (b+1)*s.BlockSize]
}

// word is the pattern: every 8-byte word of a block is a hash of the seed,
// the source block index and the word's position, so a misplaced, shifted
// or stale block never matches.
func word(seed uint64, idx int32, w int) uint64 {
	x := seed ^ uint64(uint32(idx))<<32 ^ uint64(w)
	x += 0x9e3779b97f4a7c15
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	return x ^ x>>31
}

func (m *kvMem) fill(i int32, seed uint64, src int32) {
	blk := m.block(i)
	for w := 0; w < len(blk)/8; w++ {
		binary.LittleEndian.PutUint64(blk[8*w:], word(seed, src, w))
	}
	m.expect[i] = blockSrc{Seed: seed, Idx: src}
}

// expectCopy records that block dst now holds what src held in from.
func (m *kvMem) expectCopy(dst int32, from blockSrc) { m.expect[dst] = from }

// verify checks every byte of every block against expect.
func (m *kvMem) verify() error {
	bad := 0
	var first error
	for i := range m.expect {
		e := m.expect[i]
		blk := m.block(int32(i))
		for w := 0; w < len(blk)/8; w++ {
			if got, want := binary.LittleEndian.Uint64(blk[8*w:]), word(e.Seed, e.Idx, w); got != want {
				if first == nil {
					first = fmt.Errorf("block %d word %d: got %#x, want %#x (pattern seed %#x of block %d)", i, w, got, want, e.Seed, e.Idx)
				}
				bad++
				break
			}
		}
	}
	if first != nil {
		return fmt.Errorf("%d of %d blocks differ; first: %w", bad, len(m.expect), first)
	}
	return nil
}
