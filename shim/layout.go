package shim

import (
	"fmt"
	"math"
	"math/bits"
	"sort"
	"strings"

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

	// From vLLM's KV-cache config: the index of the layer's group among
	// kv_cache_config.transfer_groups, or -1 for a layer without a cache
	// spec of its own (it shares another layer's cache; vLLM's connector
	// skips it too); nil means group 0. Kind is the spec's kind (LayerKind*),
	// "" meaning full attention.
	Group         *int   `json:"group,omitempty"`
	Kind          string `json:"kind,omitempty"`
	SlidingWindow int64  `json:"sliding_window,omitempty"` // tokens, for LayerKindSlidingWindow
}

// Layer kinds gonixl transfers. Anything else (Mamba state, chunked local
// attention, circular buffers) is refused at registration.
const (
	LayerKindFull          = "full"
	LayerKindMLA           = "mla"
	LayerKindSlidingWindow = "sliding_window"
)

// SharedGroup is a region's group when layers of several KV-cache groups
// share its memory (vLLM's hybrid allocator gives layer i of every group
// one tensor): every group's blocks are read from it.
const SharedGroup = -1

// Region is one transferable run of blocks inside a KV-cache tensor: block
// b of the region starts at Base + b*Stride and is Len bytes long.
type Region struct {
	Layer  string // the first layer (in region order) whose cache it is
	Base   uint64
	Len    uint64
	Stride uint64
	Group  int    // transfer group, or SharedGroup
	Elem   int64  // element size in bytes (0 for a remote engine's region)
	Kind   string // LayerKind* of Layer ("sliding_window:N" with its window)
}

// KVLayout is the registered KV cache of one worker.
type KVLayout struct {
	NumBlocks int64
	Regions   []Region
	Mem       nixl.MemType
	DeviceID  uint64
	Storage   []nixl.Region // registration ranges, one per distinct storage
}

// BuildLayout turns vLLM's per-layer tensors into transfer regions, in the
// order and with the identity vLLM's NixlConnector gives them: layers in
// model order (RegionLess: layers.2 before layers.10), layers without a
// cache spec skipped, and one region per distinct base address (the layers
// of different KV-cache groups that share one tensor give one region, of
// SharedGroup). The block dimension is the one whose size is numBlocks;
// dimensions outside it (e.g. K/V in FlashAttention's [2, num_blocks, ...])
// give one region each, and the dimensions inside must be dense so that a
// block is one contiguous range. Every region must lie inside its tensor's
// storage.
func BuildLayout(layers []LayerTensor, numBlocks int64) (*KVLayout, error) {
	if numBlocks <= 0 || numBlocks > math.MaxInt32 {
		return nil, fmt.Errorf("kv caches: num_blocks must be positive and fit descriptor ids (int32), got %d", numBlocks)
	}
	var kept []LayerTensor
	for _, l := range layers {
		if l.Group != nil && *l.Group < 0 {
			continue
		}
		switch l.Kind {
		case "", LayerKindFull, LayerKindMLA:
		case LayerKindSlidingWindow:
			if l.SlidingWindow <= 0 {
				return nil, fmt.Errorf("kv caches: layer %s: sliding-window layer without a window size", l.Name)
			}
		default:
			return nil, fmt.Errorf("kv caches: layer %s has a KV-cache spec of kind %q, which gonixl does not transfer (full, sliding-window and MLA attention only)", l.Name, l.Kind)
		}
		kept = append(kept, l)
	}
	if len(kept) == 0 {
		return nil, fmt.Errorf("kv caches: no layers to register")
	}
	sort.SliceStable(kept, func(i, j int) bool { return RegionLess(kept[i].Name, kept[j].Name) })
	out := &KVLayout{NumBlocks: numBlocks, Mem: nixl.DRAM}
	storages := map[uint64]nixl.Region{}
	byBase := map[uint64]int{}
	for i, l := range kept {
		mem, dev, err := memOf(l)
		if err != nil {
			return nil, err
		}
		if i == 0 {
			out.Mem, out.DeviceID = mem, dev
		} else if mem != out.Mem || dev != out.DeviceID {
			return nil, fmt.Errorf("kv caches: layer %s is on %v device %d, layer %s on %v device %d: mixed placements are not supported",
				l.Name, mem, dev, kept[0].Name, out.Mem, out.DeviceID)
		}
		regs, err := layerRegions(l, numBlocks)
		if err != nil {
			return nil, err
		}
		if l.StorageBytes == 0 || l.StoragePtr == 0 {
			return nil, fmt.Errorf("kv caches: layer %s has no storage range", l.Name)
		}
		end, carry := bits.Add64(l.StoragePtr, l.StorageBytes, 0)
		if carry != 0 {
			return nil, fmt.Errorf("kv caches: layer %s storage [%#x, +%d) wraps the address space", l.Name, l.StoragePtr, l.StorageBytes)
		}
		group, kind := 0, layerKind(l)
		if l.Group != nil {
			group = *l.Group
		}
		for _, r := range regs {
			hi, span := bits.Mul64(uint64(numBlocks-1), r.Stride)
			span, c1 := bits.Add64(span, r.Len, 0)
			last, c2 := bits.Add64(r.Base, span, 0)
			if hi != 0 || c1 != 0 || c2 != 0 || r.Base < l.StoragePtr || last > end {
				return nil, fmt.Errorf("kv caches: layer %s region [%#x, %#x) lies outside its storage [%#x, %#x)", l.Name, r.Base, last, l.StoragePtr, end)
			}
			if k, ok := byBase[r.Base]; ok {
				// Another layer's cache at the same address: vLLM's hybrid
				// allocator shares one tensor between a layer of each group.
				prev := &out.Regions[k]
				if prev.Len != r.Len || prev.Stride != r.Stride {
					return nil, fmt.Errorf("kv caches: layers %s and %s share memory at %#x with different block geometry (%d/%d bytes vs %d/%d)",
						prev.Layer, l.Name, r.Base, prev.Len, prev.Stride, r.Len, r.Stride)
				}
				if prev.Group != group {
					prev.Group = SharedGroup
				}
				continue
			}
			r.Group, r.Kind = group, kind
			byBase[r.Base] = len(out.Regions)
			out.Regions = append(out.Regions, r)
		}
		if s, ok := storages[l.StoragePtr]; !ok || s.Len < l.StorageBytes {
			storages[l.StoragePtr] = nixl.Region{Addr: l.StoragePtr, Len: l.StorageBytes, DevID: dev}
		}
	}
	// Descriptor ids (region*num_blocks + block) are int32, and
	// registration prepares one descriptor per (region, block).
	if int64(len(out.Regions))*numBlocks > math.MaxInt32 {
		return nil, fmt.Errorf("kv caches: %d regions x %d blocks exceed the int32 descriptor ids", len(out.Regions), numBlocks)
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

func layerKind(l LayerTensor) string {
	switch l.Kind {
	case "", LayerKindFull:
		return LayerKindFull
	case LayerKindSlidingWindow:
		return fmt.Sprintf("%s:%d", LayerKindSlidingWindow, l.SlidingWindow)
	}
	return l.Kind
}

// RegionLess orders layer names as vLLM's NixlConnector orders its regions:
// the name split into alternating text and digit runs (text first and last,
// possibly empty), runs compared in turn, text by code point and digits by
// value, a name that is a prefix of the other first. So model.layers.2
// comes before model.layers.10, which a plain string sort reverses.
func RegionLess(a, b string) bool {
	pa, pb := splitDigitRuns(a), splitDigitRuns(b)
	for i := 0; i < len(pa) && i < len(pb); i++ {
		if c := compareRun(pa[i], pb[i], i%2 == 1); c != 0 {
			return c < 0
		}
	}
	return len(pa) < len(pb)
}

// splitDigitRuns splits s as Python's re.split(r"(\d+)", s) does (ASCII
// digits): text, digits, text, ..., text.
func splitDigitRuns(s string) []string {
	out := []string{}
	start, digits := 0, false
	for i := 0; i < len(s); i++ {
		d := s[i] >= '0' && s[i] <= '9'
		if d != digits {
			out = append(out, s[start:i])
			start, digits = i, d
		}
	}
	out = append(out, s[start:])
	if digits {
		out = append(out, "")
	}
	return out
}

func compareRun(a, b string, numeric bool) int {
	if !numeric {
		return strings.Compare(a, b)
	}
	a, b = strings.TrimLeft(a, "0"), strings.TrimLeft(b, "0")
	if len(a) != len(b) {
		if len(a) < len(b) {
			return -1
		}
		return 1
	}
	return strings.Compare(a, b)
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
	// Inner dimensions must be dense in some order: a block is one
	// contiguous range. vLLM registers its GPU caches as a permuted view
	// (logical [2, blocks, tokens, heads, dim] over HND memory, heads
	// before tokens), so the order of the strides, not of the dimensions,
	// decides; the bytes move as they lie in memory.
	tooBig := fmt.Errorf("kv caches: layer %s: shape %v stride %v element size %d: sizes overflow", l.Name, l.Shape, l.Stride, l.ElemSize)
	var dims []int
	for j := bd + 1; j < nd; j++ {
		if l.Shape[j] != 1 {
			dims = append(dims, j)
		}
	}
	sort.SliceStable(dims, func(a, b int) bool { return l.Stride[dims[a]] < l.Stride[dims[b]] })
	inner := int64(1)
	for _, j := range dims {
		if l.Stride[j] != inner {
			return nil, fmt.Errorf("kv caches: layer %s: shape %v stride %v: block contents are not contiguous (layout not supported)", l.Name, l.Shape, l.Stride)
		}
		if inner > math.MaxInt64/l.Shape[j] {
			return nil, tooBig
		}
		inner *= l.Shape[j]
	}
	if inner > math.MaxInt64/l.ElemSize || l.Stride[bd] > math.MaxInt64/l.ElemSize {
		return nil, tooBig
	}
	blockLen := uint64(inner * l.ElemSize)
	blockStride := uint64(l.Stride[bd] * l.ElemSize)
	if numBlocks > 1 && blockStride < blockLen {
		return nil, fmt.Errorf("kv caches: layer %s: blocks overlap (stride %d < length %d)", l.Name, blockStride, blockLen)
	}
	// One region per index of the outer dimensions.
	bases := []uint64{l.DataPtr}
	for j := 0; j < bd; j++ {
		// Checked before expanding: a huge outer dimension must not be
		// materialised first.
		if l.Shape[j] > (1<<16)/int64(len(bases)) {
			return nil, fmt.Errorf("kv caches: layer %s: too many regions", l.Name)
		}
		if l.Stride[j] > math.MaxInt64/l.ElemSize {
			return nil, tooBig
		}
		step := uint64(l.Stride[j] * l.ElemSize)
		var next []uint64
		for _, b := range bases {
			for k := int64(0); k < l.Shape[j]; k++ {
				hi, off := bits.Mul64(uint64(k), step)
				a, carry := bits.Add64(b, off, 0)
				if hi != 0 || carry != 0 {
					return nil, tooBig
				}
				next = append(next, a)
			}
		}
		bases = next
	}
	regs := make([]Region, len(bases))
	for i, b := range bases {
		regs[i] = Region{Layer: l.Name, Base: b, Len: blockLen, Stride: blockStride, Elem: l.ElemSize}
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

// layoutRuns returns one strided run per region, numBlocks long: the
// descriptors, one per (region, block), region-major (block b of region r
// is descriptor r*numBlocks + b), for nixl.PrepStrided (an engine that keeps
// runs never expands them).
func layoutRuns(regions []Region, numBlocks int64, dev uint64) []nixl.Strided {
	out := make([]nixl.Strided, len(regions))
	for i, r := range regions {
		out[i] = nixl.Strided{Addr: r.Base, Stride: r.Stride, Len: r.Len, Count: uint64(numBlocks), DevID: dev}
	}
	return out
}
