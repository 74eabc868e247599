package shim

import (
	"fmt"
	"sort"

	"github.com/gonixl/gonixl/nixl"
)

// LayerTensor is one KV-cache tensor as vLLM's worker holds it, flattened
// by the Python connector: no tensor object crosses the boundary, only its
// geometry.
type LayerTensor struct {
	Name         string  `json:"name"`
	DataPtr      uint64  `json:"data_ptr"`
	StoragePtr   uint64  `json:"storage_ptr"`
	StorageBytes uint64  `json:"storage_bytes"`
	ElemSize     int64   `json:"elem_size"`
	Shape        []int64 `json:"shape"`
	Stride       []int64 `json:"stride"` // in elements, as torch reports
	Device       string  `json:"device"` // "cpu", "cuda", ...
	DeviceIndex  int64   `json:"device_index"`
}

// Region is one transferable run of blocks inside a KV-cache tensor: block
// b of the region starts at Base + b*Stride and is Len bytes long.
type Region struct {
	Layer  string
	Base   uint64
	Len    uint64
	Stride uint64
}

// KVLayout is the registered KV cache of one worker.
type KVLayout struct {
	NumBlocks int64
	Regions   []Region
	Mem       nixl.MemType
	DeviceID  uint64
	Storage   []nixl.Region // registration ranges, one per distinct storage
}

// BuildLayout turns vLLM's per-layer tensors into transfer regions. The
// block dimension is the one whose size is numBlocks; dimensions outside it
// (e.g. K/V in FlashAttention's [2, num_blocks, ...]) give one region each,
// and the dimensions inside must be dense so that a block is one
// contiguous range. Every region must lie inside its tensor's storage.
func BuildLayout(layers []LayerTensor, numBlocks int64) (*KVLayout, error) {
	if numBlocks <= 0 {
		return nil, fmt.Errorf("kv caches: num_blocks must be positive, got %d", numBlocks)
	}
	if len(layers) == 0 {
		return nil, fmt.Errorf("kv caches: no layers to register")
	}
	out := &KVLayout{NumBlocks: numBlocks, Mem: nixl.DRAM}
	storages := map[uint64]nixl.Region{}
	for i, l := range layers {
		mem, dev, err := memOf(l)
		if err != nil {
			return nil, err
		}
		if i == 0 {
			out.Mem, out.DeviceID = mem, dev
		} else if mem != out.Mem || dev != out.DeviceID {
			return nil, fmt.Errorf("kv caches: layer %s is on %v device %d, layer %s on %v device %d: mixed placements are not supported",
				l.Name, mem, dev, layers[0].Name, out.Mem, out.DeviceID)
		}
		regs, err := layerRegions(l, numBlocks)
		if err != nil {
			return nil, err
		}
		if l.StorageBytes == 0 || l.StoragePtr == 0 {
			return nil, fmt.Errorf("kv caches: layer %s has no storage range", l.Name)
		}
		end := l.StoragePtr + l.StorageBytes
		for _, r := range regs {
			last := r.Base + uint64(numBlocks-1)*r.Stride + r.Len
			if r.Base < l.StoragePtr || last > end || last < r.Base {
				return nil, fmt.Errorf("kv caches: layer %s region [%#x, %#x) lies outside its storage [%#x, %#x)", l.Name, r.Base, last, l.StoragePtr, end)
			}
		}
		out.Regions = append(out.Regions, regs...)
		if s, ok := storages[l.StoragePtr]; !ok || s.Len < l.StorageBytes {
			storages[l.StoragePtr] = nixl.Region{Addr: l.StoragePtr, Len: l.StorageBytes, DevID: dev}
		}
	}
	for _, s := range storages {
		out.Storage = append(out.Storage, s)
	}
	sort.Slice(out.Storage, func(i, j int) bool { return out.Storage[i].Addr < out.Storage[j].Addr })
	for i := 1; i < len(out.Storage); i++ {
		prev := out.Storage[i-1]
		if prev.Addr+prev.Len > out.Storage[i].Addr {
			return nil, fmt.Errorf("kv caches: storages at %#x and %#x overlap", prev.Addr, out.Storage[i].Addr)
		}
	}
	return out, nil
}

func memOf(l LayerTensor) (nixl.MemType, uint64, error) {
	switch l.Device {
	case "cpu", "":
		return nixl.DRAM, 0, nil
	case "cuda", "xpu", "hpu":
		if l.DeviceIndex < 0 {
			return 0, 0, fmt.Errorf("kv caches: layer %s has device index %d", l.Name, l.DeviceIndex)
		}
		return nixl.VRAM, uint64(l.DeviceIndex), nil
	}
	return 0, 0, fmt.Errorf("kv caches: layer %s is on unsupported device %q", l.Name, l.Device)
}

func layerRegions(l LayerTensor, numBlocks int64) ([]Region, error) {
	nd := len(l.Shape)
	if nd == 0 || nd != len(l.Stride) {
		return nil, fmt.Errorf("kv caches: layer %s: shape %v and stride %v do not match", l.Name, l.Shape, l.Stride)
	}
	if l.ElemSize <= 0 || l.DataPtr == 0 {
		return nil, fmt.Errorf("kv caches: layer %s: bad element size %d or null data pointer", l.Name, l.ElemSize)
	}
	for i := range l.Shape {
		if l.Shape[i] <= 0 || l.Stride[i] < 0 {
			return nil, fmt.Errorf("kv caches: layer %s: bad shape %v / stride %v", l.Name, l.Shape, l.Stride)
		}
	}
	bd := blockDim(l.Shape, numBlocks)
	if bd < 0 {
		return nil, fmt.Errorf("kv caches: layer %s: no dimension of shape %v equals num_blocks=%d", l.Name, l.Shape, numBlocks)
	}
	// Inner dimensions must be dense: a block is one contiguous range.
	inner := int64(1)
	for j := nd - 1; j > bd; j-- {
		if l.Shape[j] != 1 && l.Stride[j] != inner {
			return nil, fmt.Errorf("kv caches: layer %s: shape %v stride %v: block contents are not contiguous (layout not supported)", l.Name, l.Shape, l.Stride)
		}
		inner *= l.Shape[j]
	}
	blockLen := uint64(inner * l.ElemSize)
	blockStride := uint64(l.Stride[bd] * l.ElemSize)
	if numBlocks > 1 && blockStride < blockLen {
		return nil, fmt.Errorf("kv caches: layer %s: blocks overlap (stride %d < length %d)", l.Name, blockStride, blockLen)
	}
	// One region per index of the outer dimensions.
	bases := []uint64{l.DataPtr}
	for j := 0; j < bd; j++ {
		step := uint64(l.Stride[j] * l.ElemSize)
		var next []uint64
		for _, b := range bases {
			for k := int64(0); k < l.Shape[j]; k++ {
				next = append(next, b+uint64(k)*step)
			}
		}
		bases = next
		if len(bases) > 1<<16 {
			return nil, fmt.Errorf("kv caches: layer %s: too many regions", l.Name)
		}
	}
	regs := make([]Region, len(bases))
	for i, b := range bases {
		regs[i] = Region{Layer: l.Name, Base: b, Len: blockLen, Stride: blockStride}
	}
	return regs, nil
}

// blockDim picks the block dimension. FlashAttention-style [2, num_blocks,
// ...] is preferred when num_blocks is itself 2 and therefore ambiguous.
func blockDim(shape []int64, numBlocks int64) int {
	if len(shape) >= 2 && shape[0] == 2 && shape[1] == numBlocks {
		return 1
	}
	for i, s := range shape {
		if s == numBlocks {
			return i
		}
	}
	return -1
}

// descs returns one descriptor per (region, block), region-major: the id of
// block b in region r is r*NumBlocks + b.
func layoutDescs(regions []Region, numBlocks int64, dev uint64) []nixl.Desc {
	out := make([]nixl.Desc, 0, int64(len(regions))*numBlocks)
	for _, r := range regions {
		for b := int64(0); b < numBlocks; b++ {
			out = append(out, nixl.Desc{Addr: r.Base + uint64(b)*r.Stride, Len: r.Len, DevID: dev})
		}
	}
	return out
}
