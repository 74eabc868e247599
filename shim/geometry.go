package shim

import (
	"encoding/json"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"

	"github.com/gonixl/gonixl/sidechannel"
)

// TransferGroup is one of vLLM's kv_cache_config.transfer_groups as the
// Python connector flattens it: the group's spec kind, its sliding window
// (tokens, 0 for none) and its block size.
type TransferGroup struct {
	Kind          string `json:"kind"`
	SlidingWindow int64  `json:"sliding_window"`
	BlockSize     int64  `json:"block_size"`
}

// blocksInWindow is how many trailing blocks of a sliding-window group hold
// KV that a later token can attend to: vLLM's cdiv(window, block_size) + 1
// (the window need not start on a block boundary); 0 for other groups.
func (g TransferGroup) blocksInWindow() int {
	if g.SlidingWindow <= 0 || g.BlockSize <= 0 {
		return 0
	}
	return int((g.SlidingWindow+g.BlockSize-1)/g.BlockSize) + 1
}

// clipToWindow keeps only the in-window tail of each sliding-window group's
// block list, as vLLM's NixlConnector does wherever block ids are exchanged:
// the KV-cache manager allocates a block for every position and replaces
// out-of-window ones by the null block only later. Only with hma (vLLM's
// hybrid manager in use); groups beyond the configured ones are left alone.
func clipToWindow(ids BlockIDs, groups []TransferGroup, hma bool) BlockIDs {
	if !hma || len(ids) == 0 {
		return ids
	}
	out := make(BlockIDs, len(ids))
	for i, g := range ids {
		if i < len(groups) {
			if n := groups[i].blocksInWindow(); n > 0 && len(g) > n {
				g = g[len(g)-n:]
			}
		}
		out[i] = g
	}
	return out
}

// trimToTokens cuts each group's block list to the blocks that hold
// tokens [0, n). With async scheduling a step still in flight when a
// request finished has a block allocated for its token n when n is a
// multiple of the block size: a list that ran past the tokens it advertises
// would put a sliding-window group's window (clipToWindow keeps the tail)
// one block late, and a reader pairing tails would read every block from
// the next position.
func trimToTokens(ids BlockIDs, groups []TransferGroup, blockSize, n int64) BlockIDs {
	if n <= 0 {
		return ids
	}
	var out BlockIDs
	for i, g := range ids {
		bs := blockSize
		if i < len(groups) && groups[i].BlockSize > 0 {
			bs = groups[i].BlockSize
		}
		if bs <= 0 {
			continue
		}
		if need := (n + bs - 1) / bs; int64(len(g)) > need {
			if out == nil {
				out = append(BlockIDs(nil), ids...)
			}
			out[i] = g[:need]
		}
	}
	if out == nil {
		return ids
	}
	return out
}

// kvGeometry is what gonixl adds to the agent metadata (gonixl_geometry) so
// that two gonixl peers refuse a mismatch that vLLM's own fields cannot
// show: same byte sizes with another dtype, another head split, another
// pipeline stage, other layer kinds. Compared field by field at handshake.
type kvGeometry struct {
	Model       string   `json:"model,omitempty"`
	Dtype       string   `json:"dtype,omitempty"`
	CacheDtype  string   `json:"cache_dtype,omitempty"`
	NumKVHeads  int64    `json:"num_kv_heads,omitempty"` // whole model
	HeadSize    int64    `json:"head_size,omitempty"`
	NumLayers   int64    `json:"num_hidden_layers,omitempty"`
	TPSize      int      `json:"tp_size"`
	PPSize      int      `json:"pp_size"`
	PPRank      int      `json:"pp_rank"`
	RegionKinds []string `json:"region_kinds"`
	// Direction is "bidirectional" when bidirectional_kv_xfer is on, else
	// "oneway": both ends of a bidirectional deployment must have it
	// (the decode keeps its blocks for the prefill's readback only then).
	Direction string `json:"transfer_direction,omitempty"`
	// KernelLayout: WorkerInit.KernelLayout (the CPU backend's ISA layout).
	KernelLayout string `json:"kernel_layout,omitempty"`
}

func (w *Worker) geometryOf(layout *KVLayout) kvGeometry {
	f := w.cfg.CompatFactors
	str := func(k string) string { s, _ := f[k].(string); return s }
	num := func(k string) int64 {
		switch v := plainJSON(f[k]).(type) {
		case int64:
			return v
		case float64:
			return int64(v)
		case int:
			return int64(v)
		}
		return 0
	}
	g := kvGeometry{Model: str("model"), Dtype: str("dtype"), CacheDtype: str("cache_dtype"),
		NumKVHeads: num("num_kv_heads"), HeadSize: num("head_size"), NumLayers: num("num_hidden_layers"),
		TPSize: w.cfg.TPSize, PPSize: w.cfg.PPSize, PPRank: w.cfg.PPRank, Direction: "oneway"}
	if w.cfg.BidirectionalKVXfer {
		g.Direction = "bidirectional"
	}
	for _, r := range layout.Regions {
		g.RegionKinds = append(g.RegionKinds, r.Kind)
	}
	g.KernelLayout = w.kernelLayout
	return g
}

// fillRegionIdentity sets the per-region fields of the agent metadata as
// vLLM's NixlConnector fills them for a pull worker.
func fillRegionIdentity(am *sidechannel.AgentMetadata, layout *KVLayout) {
	for _, r := range layout.Regions {
		am.KVCachesBaseAddr = append(am.KVCachesBaseAddr, r.Base)
		am.BlockLens = append(am.BlockLens, int64(r.Len))
		am.BlockStrides = append(am.BlockStrides, int64(r.Stride))
		am.RegionNumBlocks = append(am.RegionNumBlocks, layout.NumBlocks)
		am.RegionGroupIDs = append(am.RegionGroupIDs, int64(r.Group))
		am.RegionNames = append(am.RegionNames, r.Layer)
		am.RegionMemTypes = append(am.RegionMemTypes, layout.Mem.String())
	}
	// Pull workers advertise no member lists (vLLM fills them for push
	// under pipeline parallelism only).
	am.RegionMembers = nil
}

// blockRatio checks a remote block size against this engine's and returns
// local/remote (1 when equal).
func blockRatio(local *KVLayout, blockSize int64, blockReshape string, plan tpPlan, md *sidechannel.AgentMetadata) (int, error) {
	switch {
	case md.BlockSize == blockSize:
		return 1, nil
	case md.BlockSize <= 0:
		return 0, fmt.Errorf("advertises block_size %d", md.BlockSize)
	case md.BlockSize > blockSize:
		return 0, fmt.Errorf("has block_size %d, larger than this engine's %d: an engine reads only from engines of an equal or smaller block size (as vLLM's NixlConnector)", md.BlockSize, blockSize)
	case blockSize%md.BlockSize != 0:
		return 0, fmt.Errorf("has block_size %d, which does not divide this engine's %d", md.BlockSize, blockSize)
	case blockReshape == "":
		return 0, fmt.Errorf("has block_size %d, this engine %d, and this engine's KV-cache layout has no known token order to rearrange blocks of another size in", md.BlockSize, blockSize)
	case plan.ratio != 1:
		return 0, fmt.Errorf("has block_size %d and tp_size %d, this engine %d and %d: a different block size together with a different tp_size is not supported", md.BlockSize, plan.remoteTP, blockSize, plan.localTP)
	case regionsMapped(local.Regions):
		return 0, fmt.Errorf("has block_size %d, this engine %d: a different block size with KV-cache groups in separate regions is not supported", md.BlockSize, blockSize)
	}
	for _, r := range local.Regions {
		if strings.HasPrefix(r.Kind, LayerKindSlidingWindow) {
			return 0, fmt.Errorf("has block_size %d, this engine %d: a different block size with sliding-window layers (%s) is not supported", md.BlockSize, blockSize, r.Layer)
		}
	}
	ratio := blockSize / md.BlockSize
	for _, r := range local.Regions {
		if r.Len%uint64(ratio) != 0 {
			return 0, fmt.Errorf("has block_size %d, this engine %d, but this engine's block of %d bytes (%s) does not split in %d", md.BlockSize, blockSize, r.Len, r.Layer, ratio)
		}
	}
	return int(ratio), nil
}

// checkRemoteLayout is the handshake's identity check: the remote regions
// must be this worker's regions — same layers in the same order, same
// per-block geometry, same groups, same cache layout and block size (or a
// block size that divides this engine's, below) — and
// anything gonixl cannot transfer is refused. The error names the first
// difference. mine is this worker's geometry.
//
// plan is this worker's TP mapping onto the remote engine: block lengths
// are compared through it (a remote rank of another TP size holds more or
// fewer heads per block), and a head-sliced read needs a layout whose
// blocks keep their heads contiguous.
//
// A remote block size that divides this engine's is accepted where gonixl
// can rearrange the blocks (blockReshape, from the Python connector): the
// returned ratio (local block size / remote) is then above 1, and each
// remote region's block length must be this engine's divided by it. A
// larger remote block size is refused, as vLLM's NixlConnector refuses it.
func checkRemoteLayout(local *KVLayout, blockSize int64, kvLayout, attnBackend, blockReshape string, mine kvGeometry, plan tpPlan, md *sidechannel.AgentMetadata) (int, error) {
	n := len(local.Regions)
	if md.RegionNames == nil {
		return 0, fmt.Errorf("sent no region_names, so which layer each of its %d regions holds cannot be checked", len(md.BlockLens))
	}
	lens := map[string]int{"kv_caches_base_addr": len(md.KVCachesBaseAddr), "block_lens": len(md.BlockLens),
		"block_strides": len(md.BlockStrides), "region_names": len(md.RegionNames)}
	if md.RegionGroupIDs != nil {
		lens["region_group_ids"] = len(md.RegionGroupIDs)
	}
	if md.RegionNumBlocks != nil {
		lens["region_num_blocks"] = len(md.RegionNumBlocks)
	}
	if md.RegionMemTypes != nil {
		lens["region_mem_types"] = len(md.RegionMemTypes)
	}
	for _, k := range slices.Sorted(maps.Keys(lens)) {
		if lens[k] != len(md.RegionNames) {
			return 0, fmt.Errorf("advertises %d region_names but %d %s", len(md.RegionNames), lens[k], k)
		}
	}
	if len(md.RegionNames) != n {
		first := ""
		for i := 0; i < n && i < len(md.RegionNames); i++ {
			if md.RegionNames[i] != local.Regions[i].Layer {
				first = fmt.Sprintf("; first difference at region %d: remote %q, local %q", i, md.RegionNames[i], local.Regions[i].Layer)
				break
			}
		}
		return 0, fmt.Errorf("has %d KV-cache regions, this engine %d (different model, layer count or pipeline stage)%s", len(md.RegionNames), n, first)
	}
	ratio, err := blockRatio(local, blockSize, blockReshape, plan, md)
	if err != nil {
		return 0, err
	}
	if md.KVCacheLayout != kvLayout {
		return 0, fmt.Errorf("has KV-cache layout %q, this engine %q", md.KVCacheLayout, kvLayout)
	}
	if plan.headSliced() && !blockContiguous(kvLayout) {
		return 0, fmt.Errorf("runs tp_size %d against this engine's %d, which needs each block's KV heads contiguous, but the KV-cache layout is %q (use a block-contiguous layout such as LBHNC)",
			plan.remoteTP, plan.localTP, kvLayout)
	}
	if md.AttnBackendName != attnBackend {
		return 0, fmt.Errorf("uses attention backend %q, this engine %q (their KV-cache layouts differ)", md.AttnBackendName, attnBackend)
	}
	switch {
	case md.PhysicalBlocksPerLogicalKVBlock > 1:
		return 0, fmt.Errorf("splits a logical block into %d kernel blocks (not supported)", md.PhysicalBlocksPerLogicalKVBlock)
	case md.SSMSizes != [2]int64{}:
		return 0, fmt.Errorf("has Mamba/SSM state (ssm_sizes %v), which gonixl does not transfer", md.SSMSizes)
	case len(md.PackedMemberLayouts) > 0 || len(md.RegionMembers) > 0:
		return 0, fmt.Errorf("advertises packed or multi-member regions (a pipeline-parallel push layout), which gonixl does not read")
	case md.DCPSize > 1 || md.PCPSize > 1:
		return 0, fmt.Errorf("runs decode/prefill context parallelism (dcp %d, pcp %d), which gonixl does not support", md.DCPSize, md.PCPSize)
	case md.PLEBlockLen != nil:
		return 0, fmt.Errorf("has a PLE state region, which gonixl does not transfer")
	}
	for i, r := range local.Regions {
		name := md.RegionNames[i]
		if name != r.Layer {
			return 0, fmt.Errorf("region %d holds layer %q, this engine's region %d holds %q (layer order or model differs)", i, name, i, r.Layer)
		}
		want, err := plan.remoteBlockLen(r.Len)
		if err != nil {
			return 0, fmt.Errorf("region %d (%s): %w", i, name, err)
		}
		want /= uint64(ratio)
		if uint64(md.BlockLens[i]) != want || md.BlockLens[i] <= 0 {
			if plan.ratio == 1 && ratio > 1 {
				return 0, fmt.Errorf("region %d (%s) has block length %d bytes, where %d are expected for its block_size %d against this engine's %d bytes at block_size %d (dtype, heads or head size differ)",
					i, name, md.BlockLens[i], want, md.BlockSize, r.Len, blockSize)
			}
			if plan.ratio == 1 {
				return 0, fmt.Errorf("region %d (%s) has block length %d bytes, this engine %d (dtype, heads or head size differ)", i, name, md.BlockLens[i], r.Len)
			}
			return 0, fmt.Errorf("region %d (%s) has block length %d bytes, where %d are expected for its tp_size %d against this engine's %d bytes at tp_size %d (dtype, heads or head size differ)",
				i, name, md.BlockLens[i], want, plan.remoteTP, r.Len, plan.localTP)
		}
		if md.BlockStrides[i] < md.BlockLens[i] {
			return 0, fmt.Errorf("region %d (%s): block stride %d < block length %d", i, name, md.BlockStrides[i], md.BlockLens[i])
		}
		if md.RegionGroupIDs != nil && md.RegionGroupIDs[i] != int64(r.Group) {
			return 0, fmt.Errorf("region %d (%s) belongs to KV-cache group %d, this engine's to %d (hybrid-allocator groups differ)", i, name, md.RegionGroupIDs[i], r.Group)
		}
		if md.RegionNumBlocks != nil && md.RegionNumBlocks[i] != md.NumBlocks {
			return 0, fmt.Errorf("region %d (%s) has %d blocks, the engine %d (per-region block counts are not supported)", i, name, md.RegionNumBlocks[i], md.NumBlocks)
		}
	}
	if md.Geometry != "" {
		var theirs kvGeometry
		if err := json.Unmarshal([]byte(md.Geometry), &theirs); err != nil {
			return 0, fmt.Errorf("sent unreadable gonixl_geometry: %w", err)
		}
		// The TP sizes are the plan's business (block lengths, above); the
		// remote's own word must match the tp_size the plan was made for.
		if theirs.TPSize != 0 && theirs.TPSize != plan.remoteTP {
			return 0, fmt.Errorf("runs tp_size %d, but the request's kv_transfer_params say %d", theirs.TPSize, plan.remoteTP)
		}
		theirs.TPSize = mine.TPSize
		if theirs.Direction != "" && mine.Direction != "" && theirs.Direction != mine.Direction {
			return 0, fmt.Errorf("has bidirectional_kv_xfer %v, this engine %v: set kv_connector_extra_config.bidirectional_kv_xfer the same on prefill and decode",
				theirs.Direction == "bidirectional", mine.Direction == "bidirectional")
		}
		if d := firstGeometryDifference(theirs, mine); d != "" {
			return 0, fmt.Errorf("differs in %s", d)
		}
		if ratio > 1 && mine.KernelLayout != "" && theirs.KernelLayout == "" {
			return 0, fmt.Errorf("has block_size %d, this engine %d, and does not state its attention kernel's layout (this engine's: %s)", md.BlockSize, blockSize, mine.KernelLayout)
		}
	} else if ratio > 1 && mine.KernelLayout != "" {
		// A stock (or older) peer: its kernel's layout inside a block,
		// which on this backend depends on the block size and the host,
		// is unknown.
		return 0, fmt.Errorf("has block_size %d, this engine %d, and does not state its attention kernel's layout (this engine's: %s; a different block size needs gonixl on both sides here)", md.BlockSize, blockSize, mine.KernelLayout)
	}
	return ratio, nil
}

// firstGeometryDifference names the first field in which two geometries
// differ (remote, then local value), or "". Fields one side left empty
// (an older gonixl) are not compared.
func firstGeometryDifference(remote, local kvGeometry) string {
	rv, lv := reflect.ValueOf(remote), reflect.ValueOf(local)
	t := rv.Type()
	for i := 0; i < t.NumField(); i++ {
		a, b := rv.Field(i), lv.Field(i)
		tag, opts, _ := strings.Cut(t.Field(i).Tag.Get("json"), ",")
		if opts == "omitempty" && (a.IsZero() || b.IsZero()) {
			continue
		}
		if !reflect.DeepEqual(a.Interface(), b.Interface()) {
			return fmt.Sprintf("%s: remote %v, this engine %v", tag, a.Interface(), b.Interface())
		}
	}
	return ""
}

// compatHashes returns this engine's compatibility hash and hints for the
// hashes a peer on another transfer engine would have, both by
// sidechannel.EngineFactors' rule. Two engines that differ only in the
// transfer engine cannot exchange KV, whatever enforce_handshake_compat
// says: the hint makes that one line.
func compatHashes(factors map[string]any, engine string) (string, map[string]string, error) {
	with := func(e string) (string, error) {
		return sidechannel.HashFactors(sidechannel.EngineFactors(factors, e))
	}
	hash, err := with(engine)
	if err != nil {
		return "", nil, err
	}
	hints := map[string]string{}
	for _, other := range []string{"nixl", "ucx"} {
		if other == engine {
			continue
		}
		h, err := with(other)
		if err != nil {
			return "", nil, err
		}
		who := "a gonixl engine with transfer_engine " + other
		if other == "nixl" {
			who = "vLLM's NixlConnector or a gonixl engine with transfer_engine nixl"
		}
		hints[h] = fmt.Sprintf("the remote engine is %s, this engine uses transfer_engine %s: both sides must use the same transport (set transfer_engine to %s here, or change the remote)", who, engine, other)
	}
	return hash, hints, nil
}
