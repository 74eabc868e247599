package sidechannel

import (
	"bytes"
	"errors"
	"fmt"
)

// NIXLConnectorVersion is the NIXL connector compatibility version this
// package speaks (vLLM's NIXL_CONNECTOR_VERSION); it feeds the compatibility
// hash. History (from vLLM's nixl/metadata.py):
//
//	 1 compatibility checking introduced
//	 2 remote_request_id in kv_transfer_params
//	 3 physical_blocks_per_logical_kv_block in NixlAgentMetadata
//	 4 KV block lease renewal through heartbeats
//	 5 remote_blocks_expiry_time + handshake clock-sync timestamp frame
//	 6 EAGLE/MTP speculative-config check
//	 7 transfer mode (push/pull) in the compatibility hash
//	 8 dcp_size and pcp_size in NixlAgentMetadata
//	 9 block_strides
//	10 dense virtual transfer pages for compressed MLA caches
//	11 per-region transfer geometry and memory types
//	12 per-region member names for PP push (region_members)
//	13 packed-member layouts (packed_member_layouts)
//	14 PLE page length (ple_block_len)
const NIXLConnectorVersion = 14

// GetMetaMsg is the first element of a handshake request tuple.
const GetMetaMsg = "get_meta_msg"

// Rank addresses one worker of an engine.
type Rank struct {
	PP int // pipeline-parallel rank
	TP int // tensor-parallel (transfer) rank
}

func (r Rank) String() string { return fmt.Sprintf("pp_rank=%d tp_rank=%d", r.PP, r.TP) }

// Ranks returns the (pp, tp) pairs a client queries, in vLLM's order:
// itertools.product(range(ppSize), tpRanks).
func Ranks(ppSize int, tpRanks ...int) []Rank {
	out := make([]Rank, 0, ppSize*len(tpRanks))
	for pp := 0; pp < ppSize; pp++ {
		for _, tp := range tpRanks {
			out = append(out, Rank{PP: pp, TP: tp})
		}
	}
	return out
}

// HandshakePayload is vLLM's NixlHandshakePayload: the compatibility hash and
// the msgpack-encoded NixlAgentMetadata, so the hash can be checked before
// the (version-dependent) metadata is decoded.
type HandshakePayload struct {
	CompatibilityHash  string
	AgentMetadataBytes []byte
}

// Encode returns the msgspec encoding: a 2-entry map keyed by field name.
func (p *HandshakePayload) Encode() []byte {
	w := mpWriter{b: make([]byte, 0, 64+len(p.AgentMetadataBytes))}
	w.mapHeader(2)
	w.str("compatibility_hash")
	w.str(p.CompatibilityHash)
	w.str("agent_metadata_bytes")
	w.bin(p.AgentMetadataBytes)
	return w.b
}

// DecodeHandshakePayload decodes a NixlHandshakePayload. It returns a nil
// payload exactly when it returns an error.
func DecodeHandshakePayload(b []byte) (*HandshakePayload, error) {
	var p HandshakePayload
	var hash, meta bool
	err := decodeObject(b, func(r *mpReader, key string) (bool, error) {
		var err error
		switch key {
		case "compatibility_hash":
			p.CompatibilityHash, err = r.str()
			hash = true
		case "agent_metadata_bytes":
			p.AgentMetadataBytes, err = r.bin()
			meta = true
		default:
			return false, nil
		}
		return true, err
	}, func() error {
		return missing(!hash, "compatibility_hash", !meta, "agent_metadata_bytes")
	})
	if err != nil {
		return nil, toDecodeError("NixlHandshakePayload", err)
	}
	return &p, nil
}

// PackedMemberLayout is one entry of NixlAgentMetadata.packed_member_layouts
// (member name -> (byte offset in its region's block, bytes per page)). It is
// a slice entry rather than a map value so the wire order round-trips.
type PackedMemberLayout struct {
	Name       string
	Offset     int64
	PageLength int64
}

// AgentMetadata is vLLM's NixlAgentMetadata (connector version 14), one per
// worker rank. Fields whose Python type is "X | None" are nil for None (a
// non-nil empty slice encodes as []); RegionMembers and PackedMemberLayouts
// encode nil as an empty array/map and decode empty as nil. AgentMetadata (NIXL's own blob) is opaque
// here.
type AgentMetadata struct {
	EngineID                        string
	AgentMetadata                   []byte
	KVCachesBaseAddr                []uint64
	DeviceID                        int64
	NumBlocks                       int64
	BlockLens                       []int64
	BlockStrides                    []int64
	KVCacheLayout                   string
	BlockSize                       int64
	SSMSizes                        [2]int64
	AttnBackendName                 string
	PhysicalBlocksPerLogicalKVBlock int64
	RegionNumBlocks                 []int64  // None when nil
	RegionGroupIDs                  []int64  // None when nil
	RegionNames                     []string // None when nil
	RegionMemTypes                  []string // None when nil
	DCPSize                         int64    // default 1
	PCPSize                         int64    // default 1
	PLEBlockLen                     *int64   // None when nil
	RegionMembers                   [][]string
	PackedMemberLayouts             []PackedMemberLayout
	// Geometry is gonixl's own addition (key "gonixl_geometry", a str):
	// what the stock fields leave out about the KV cache's shape (dtype,
	// heads, layer kinds, parallel ranks), so that two gonixl peers can
	// refuse a mismatch at handshake. Empty when absent; vLLM's typed
	// decoder skips the unknown key, and the field is only encoded when
	// set, so a stock peer sees exactly vLLM's fields.
	Geometry string
	// Instance is gonixl's too (key "gonixl_instance", a str): the serving
	// scheduler process's random id, also in the kv_transfer_params it
	// makes, so that a peer reading those params from an engine that
	// restarted under the same engine id and address (other KV in the
	// same blocks) refuses. Encoded only when set.
	Instance string
}

// NewAgentMetadata returns metadata with vLLM's defaults for the optional
// fields (dcp_size=1, pcp_size=1).
func NewAgentMetadata() *AgentMetadata { return &AgentMetadata{DCPSize: 1, PCPSize: 1} }

// Encode returns msgspec's encoding of the dataclass: a map of all 21 fields
// in declaration order, then gonixl_geometry and gonixl_instance when set.
func (m *AgentMetadata) Encode() []byte {
	w := mpWriter{b: make([]byte, 0, 1024+len(m.AgentMetadata)+len(m.Geometry))}
	n := 21
	if m.Geometry != "" {
		n++
	}
	if m.Instance != "" {
		n++
	}
	w.mapHeader(n)
	w.str("engine_id")
	w.str(m.EngineID)
	w.str("agent_metadata")
	w.bin(m.AgentMetadata)
	w.str("kv_caches_base_addr")
	w.arrayHeader(len(m.KVCachesBaseAddr))
	for _, a := range m.KVCachesBaseAddr {
		w.uint_(a)
	}
	w.str("device_id")
	w.int_(m.DeviceID)
	w.str("num_blocks")
	w.int_(m.NumBlocks)
	w.str("block_lens")
	w.ints(m.BlockLens)
	w.str("block_strides")
	w.ints(m.BlockStrides)
	w.str("kv_cache_layout")
	w.str(m.KVCacheLayout)
	w.str("block_size")
	w.int_(m.BlockSize)
	w.str("ssm_sizes")
	w.ints(m.SSMSizes[:])
	w.str("attn_backend_name")
	w.str(m.AttnBackendName)
	w.str("physical_blocks_per_logical_kv_block")
	w.int_(m.PhysicalBlocksPerLogicalKVBlock)
	w.str("region_num_blocks")
	optInts(&w, m.RegionNumBlocks)
	w.str("region_group_ids")
	optInts(&w, m.RegionGroupIDs)
	w.str("region_names")
	optStrs(&w, m.RegionNames)
	w.str("region_mem_types")
	optStrs(&w, m.RegionMemTypes)
	w.str("dcp_size")
	w.int_(m.DCPSize)
	w.str("pcp_size")
	w.int_(m.PCPSize)
	w.str("ple_block_len")
	if m.PLEBlockLen == nil {
		w.nil_()
	} else {
		w.int_(*m.PLEBlockLen)
	}
	w.str("region_members")
	w.arrayHeader(len(m.RegionMembers))
	for _, names := range m.RegionMembers {
		w.strs(names)
	}
	w.str("packed_member_layouts")
	w.mapHeader(len(m.PackedMemberLayouts))
	for _, l := range m.PackedMemberLayouts {
		w.str(l.Name)
		w.arrayHeader(2)
		w.int_(l.Offset)
		w.int_(l.PageLength)
	}
	if m.Geometry != "" {
		w.str("gonixl_geometry")
		w.str(m.Geometry)
	}
	if m.Instance != "" {
		w.str(InstanceKey)
		w.str(m.Instance)
	}
	return w.b
}

func optInts(w *mpWriter, v []int64) {
	if v == nil {
		w.nil_()
	} else {
		w.ints(v)
	}
}

func optStrs(w *mpWriter, v []string) {
	if v == nil {
		w.nil_()
	} else {
		w.strs(v)
	}
}

// DecodeAgentMetadata decodes a NixlAgentMetadata the way msgspec's typed
// decoder does: unknown keys are skipped, fields with defaults may be absent,
// a missing required field or a wrongly typed value is an error. It returns
// nil exactly when it returns an error.
func DecodeAgentMetadata(b []byte) (*AgentMetadata, error) {
	m := NewAgentMetadata()
	const nRequired = 12
	var seen [nRequired]bool
	required := [nRequired]string{"engine_id", "agent_metadata", "kv_caches_base_addr", "device_id",
		"num_blocks", "block_lens", "block_strides", "kv_cache_layout", "block_size", "ssm_sizes",
		"attn_backend_name", "physical_blocks_per_logical_kv_block"}
	err := decodeObject(b, func(r *mpReader, key string) (bool, error) {
		var err error
		idx := -1
		for i, name := range required {
			if name == key {
				idx = i
			}
		}
		switch key {
		case "engine_id":
			m.EngineID, err = r.str()
		case "agent_metadata":
			m.AgentMetadata, err = r.bin()
		case "kv_caches_base_addr":
			m.KVCachesBaseAddr, err = r.uints()
		case "device_id":
			m.DeviceID, err = r.int_()
		case "num_blocks":
			m.NumBlocks, err = r.int_()
		case "block_lens":
			m.BlockLens, err = r.ints()
		case "block_strides":
			m.BlockStrides, err = r.ints()
		case "kv_cache_layout":
			m.KVCacheLayout, err = r.str()
		case "block_size":
			m.BlockSize, err = r.int_()
		case "ssm_sizes":
			m.SSMSizes, err = pair(r)
		case "attn_backend_name":
			m.AttnBackendName, err = r.str()
		case "physical_blocks_per_logical_kv_block":
			m.PhysicalBlocksPerLogicalKVBlock, err = r.int_()
		case "region_num_blocks":
			m.RegionNumBlocks, err = readOpt(r, (*mpReader).ints)
		case "region_group_ids":
			m.RegionGroupIDs, err = readOpt(r, (*mpReader).ints)
		case "region_names":
			m.RegionNames, err = readOpt(r, (*mpReader).strs)
		case "region_mem_types":
			m.RegionMemTypes, err = readOpt(r, (*mpReader).strs)
		case "dcp_size":
			m.DCPSize, err = r.int_()
		case "pcp_size":
			m.PCPSize, err = r.int_()
		case "ple_block_len":
			m.PLEBlockLen, err = optInt(r)
		case "region_members":
			if m.RegionMembers, err = regionMembers(r); len(m.RegionMembers) == 0 {
				m.RegionMembers = nil // [] and nil mean the same here
			}
		case "packed_member_layouts":
			if m.PackedMemberLayouts, err = packedLayouts(r); len(m.PackedMemberLayouts) == 0 {
				m.PackedMemberLayouts = nil
			}
		case "gonixl_geometry":
			m.Geometry, err = r.str()
		case InstanceKey:
			m.Instance, err = r.str()
		default:
			return false, nil
		}
		if idx >= 0 {
			seen[idx] = true
		}
		return true, err
	}, func() error {
		for i, ok := range seen {
			if !ok {
				return fmt.Errorf("object missing required field `%s`", required[i])
			}
		}
		return nil
	})
	if err != nil {
		return nil, toDecodeError("NixlAgentMetadata", err)
	}
	return m, nil
}

func readOpt[T any](r *mpReader, f func(*mpReader) ([]T, error)) ([]T, error) {
	isNil, err := r.isNil()
	if err != nil || isNil {
		return nil, err
	}
	v, err := f(r)
	if err == nil && v == nil {
		v = []T{}
	}
	return v, err
}

func optInt(r *mpReader) (*int64, error) {
	isNil, err := r.isNil()
	if err != nil || isNil {
		return nil, err
	}
	v, err := r.int_()
	if err != nil {
		return nil, err
	}
	return &v, nil
}

func pair(r *mpReader) ([2]int64, error) {
	var out [2]int64
	n, err := r.arrayLen()
	if err != nil {
		return out, err
	}
	if n != 2 {
		return out, fmt.Errorf("expected `array` of length 2, got %d", n)
	}
	for i := range out {
		if out[i], err = r.int_(); err != nil {
			return out, indexErr(i, err)
		}
	}
	return out, nil
}

func regionMembers(r *mpReader) ([][]string, error) {
	n, err := r.arrayLen()
	if err != nil {
		return nil, err
	}
	out := make([][]string, n)
	for i := range out {
		if out[i], err = r.strs(); err != nil {
			return nil, indexErr(i, err)
		}
	}
	return out, nil
}

func packedLayouts(r *mpReader) ([]PackedMemberLayout, error) {
	n, err := r.mapLen()
	if err != nil {
		return nil, err
	}
	out := make([]PackedMemberLayout, 0, n)
	pos := make(map[string]int, n)
	for i := 0; i < n; i++ {
		name, err := r.str()
		if err != nil {
			return nil, prefixErr("[key]", err)
		}
		v, err := pair(r)
		if err != nil {
			return nil, prefixErr(fmt.Sprintf("[%q]", name), err)
		}
		l := PackedMemberLayout{Name: name, Offset: v[0], PageLength: v[1]}
		// A repeated key keeps its first position and its last value, as a
		// Python dict built from the pairs would.
		if j, dup := pos[name]; dup {
			out[j] = l
			continue
		}
		pos[name] = len(out)
		out = append(out, l)
	}
	return out, nil
}

// decodeObject walks a top-level msgpack map keyed by str, handing each
// value to field (which reports whether it consumed the value), skipping
// unknown keys, then calls done to check for required fields; trailing bytes
// are an error.
func decodeObject(b []byte, field func(r *mpReader, key string) (bool, error), done func() error) error {
	r := &mpReader{b: b}
	n, err := r.mapLen()
	if err != nil {
		return err
	}
	for i := 0; i < n; i++ {
		kb, err := r.strBytes()
		if err != nil {
			return &pathErr{path: "", err: fmt.Errorf("%v - at `key`", err)}
		}
		key := string(kb)
		ok, err := field(r, key)
		if err != nil {
			return prefixErr("."+key, err)
		}
		if !ok {
			if err := r.skip(1); err != nil {
				return err
			}
		}
	}
	if err := done(); err != nil {
		return err
	}
	if r.remaining() != 0 {
		return fmt.Errorf("malformed data: trailing characters (byte %d)", r.off)
	}
	return nil
}

func missing(args ...any) error {
	for i := 0; i+1 < len(args); i += 2 {
		if args[i].(bool) {
			return fmt.Errorf("object missing required field `%s`", args[i+1].(string))
		}
	}
	return nil
}

// ---- request and clock frames ----

// EncodeRequest returns msgpack of the tuple (b"get_meta_msg", pp, tp),
// byte-identical to vLLM's msgspec encoding.
func EncodeRequest(rank Rank) []byte { return encodeRequest([]byte(GetMetaMsg), rank) }

func encodeRequest(tag []byte, rank Rank) []byte {
	w := mpWriter{b: make([]byte, 0, 24+len(tag))}
	w.arrayHeader(3)
	w.bin(tag)
	w.int_(int64(rank.PP))
	w.int_(int64(rank.TP))
	return w.b
}

// Request is a decoded handshake request.
type Request struct {
	Tag  []byte // b"get_meta_msg", possibly followed by authentication
	Rank Rank
}

// DecodeRequest decodes (tag, pp_rank, tp_rank). The tag may be bin or str
// (vLLM only warns on an unexpected tag); the ranks must be integers that fit
// in an int32. It returns nil exactly when it returns an error.
func DecodeRequest(b []byte) (*Request, error) {
	r := &mpReader{b: b}
	fail := func(err error) (*Request, error) { return nil, toDecodeError("request", err) }
	n, err := r.arrayLen()
	if err != nil {
		return fail(err)
	}
	if n != 3 {
		return fail(fmt.Errorf("expected `array` of length 3, got %d", n))
	}
	var tag []byte
	switch k, _ := r.peek(); k {
	case kStr:
		tag, err = r.strBytes()
	default:
		tag, err = r.binView()
	}
	if err != nil {
		return fail(indexErr(0, err))
	}
	var ranks [2]int64
	for i := range ranks {
		if ranks[i], err = r.int_(); err != nil {
			return fail(indexErr(i+1, err))
		}
		if ranks[i] < -1<<31 || ranks[i] >= 1<<31 {
			return fail(indexErr(i+1, errors.New("rank out of range")))
		}
	}
	if r.remaining() != 0 {
		return fail(fmt.Errorf("malformed data: trailing characters (byte %d)", r.off))
	}
	return &Request{Tag: append([]byte{}, tag...), Rank: Rank{PP: int(ranks[0]), TP: int(ranks[1])}}, nil
}

// EncodeClock returns the reply's second frame: msgpack float64, as msgspec
// encodes a Python float.
func EncodeClock(seconds float64) []byte {
	w := mpWriter{b: make([]byte, 0, 9)}
	w.float64_(seconds)
	return w.b
}

// DecodeClock decodes the reply's clock frame (any msgpack number, since vLLM
// decodes it untyped). seconds is 0 whenever err is non-nil.
func DecodeClock(b []byte) (seconds float64, err error) {
	r := &mpReader{b: b}
	v, err := r.number()
	if err == nil && r.remaining() != 0 {
		err = fmt.Errorf("malformed data: trailing characters (byte %d)", r.off)
	}
	if err != nil {
		return 0, toDecodeError("clock", err)
	}
	return v, nil
}

// ---- KV digest query (gonixl only) ----

// KVDigestMsg is the first element of a KV digest query [tag, request_id].
const KVDigestMsg = "gonixl_kv_digest"

// MaxKVRequestIDLen bounds the request id of a KV digest query, in bytes.
const MaxKVRequestIDLen = 1024

// KV digest reply statuses.
const (
	KVDigestOK      = "ok"      // Digest holds the bytes
	KVDigestPending = "pending" // held, digest not in yet: ask again
	KVDigestNone    = "none"    // nothing to serve (not an error)
	KVDigestError   = "error"   // bad request or authentication; Message says why
)

// KVDigestRequest is a decoded KV digest query.
type KVDigestRequest struct {
	Tag       []byte // KVDigestMsg, possibly followed by authentication
	RequestID string
}

// EncodeKVDigestRequest returns msgpack of [b"gonixl_kv_digest", request_id]
// (no authentication). DecodeKVDigestRequest refuses ids that are empty or
// longer than MaxKVRequestIDLen bytes.
func EncodeKVDigestRequest(requestID string) []byte {
	return encodeKVDigestRequest([]byte(KVDigestMsg), requestID)
}

func encodeKVDigestRequest(tag []byte, requestID string) []byte {
	w := mpWriter{b: make([]byte, 0, 16+len(tag)+len(requestID))}
	w.arrayHeader(2)
	w.bin(tag)
	w.str(requestID)
	return w.b
}

func checkKVRequestID(id string) error {
	if len(id) == 0 || len(id) > MaxKVRequestIDLen {
		return fmt.Errorf("request id of %d bytes, want 1..%d", len(id), MaxKVRequestIDLen)
	}
	return nil
}

// DecodeKVDigestRequest decodes [tag, request_id]: exactly two elements, the
// tag bin (or str) and either KVDigestMsg or its authenticated form, the id a
// UTF-8 str of 1..MaxKVRequestIDLen bytes, no trailing bytes. It returns nil
// exactly when it returns an error.
func DecodeKVDigestRequest(b []byte) (*KVDigestRequest, error) {
	r := &mpReader{b: b}
	fail := func(err error) (*KVDigestRequest, error) { return nil, toDecodeError("KV digest request", err) }
	n, err := r.arrayLen()
	if err != nil {
		return fail(err)
	}
	if n != 2 {
		return fail(fmt.Errorf("expected `array` of length 2, got %d", n))
	}
	tag, err := readTag(r)
	if err != nil {
		return fail(indexErr(0, err))
	}
	if string(tag) != KVDigestMsg {
		if _, _, ok := splitKVDigestAuthTag(tag); !ok {
			return fail(indexErr(0, fmt.Errorf("unexpected tag %q, want %q", truncate(tag, 64), KVDigestMsg)))
		}
	}
	id, err := r.str()
	if err == nil {
		err = checkKVRequestID(id)
	}
	if err != nil {
		return fail(indexErr(1, err))
	}
	if r.remaining() != 0 {
		return fail(fmt.Errorf("malformed data: trailing characters (byte %d)", r.off))
	}
	return &KVDigestRequest{Tag: append([]byte{}, tag...), RequestID: id}, nil
}

// readTag reads a bin or str element as raw bytes (a view into the input).
func readTag(r *mpReader) ([]byte, error) {
	if k, _ := r.peek(); k == kStr {
		return r.strBytes()
	}
	return r.binView()
}

func truncate(b []byte, n int) []byte {
	if len(b) > n {
		return b[:n]
	}
	return b
}

// isKVDigestQuery tells the listener which of the two request kinds a
// request frame is: an array whose first element is a bin/str starting with
// KVDigestMsg, or an array of two elements whose first is not a
// "get_meta_msg" tag. Everything else (every vLLM request, well formed or
// not) takes the handshake path exactly as before.
func isKVDigestQuery(b []byte) bool {
	r := &mpReader{b: b}
	n, err := r.arrayLen()
	if err != nil || n == 0 {
		return false
	}
	if k, _ := r.peek(); k != kStr && k != kBin {
		return n == 2
	}
	tag, err := readTag(r)
	switch {
	case err != nil:
		return n == 2
	case bytes.HasPrefix(tag, []byte(KVDigestMsg)):
		return true
	default:
		return n == 2 && !bytes.HasPrefix(tag, []byte(GetMetaMsg))
	}
}

// KVDigestReply is the body frame of a KV digest reply.
type KVDigestReply struct {
	Status  string // KVDigestOK, KVDigestPending, KVDigestNone or KVDigestError
	Message string
	Digest  []byte
}

// Encode returns msgpack map {"status": str, "message": str, "digest": bin}
// (keys in that order; a nil Digest encodes as empty bin).
func (p *KVDigestReply) Encode() []byte {
	w := mpWriter{b: make([]byte, 0, 48+len(p.Message)+len(p.Digest))}
	w.mapHeader(3)
	w.str("status")
	w.str(p.Status)
	w.str("message")
	w.str(p.Message)
	w.str("digest")
	w.bin(p.Digest)
	return w.b
}

// DecodeKVDigestReply decodes a KV digest reply body. "status" is required
// and must be one of the four statuses; "message" and "digest" default to
// empty; unknown keys are skipped; trailing bytes are an error. It returns
// nil exactly when it returns an error.
func DecodeKVDigestReply(b []byte) (*KVDigestReply, error) {
	var p KVDigestReply
	var status bool
	err := decodeObject(b, func(r *mpReader, key string) (bool, error) {
		var err error
		switch key {
		case "status":
			p.Status, err = r.str()
			if err == nil {
				switch p.Status {
				case KVDigestOK, KVDigestPending, KVDigestNone, KVDigestError:
				default:
					err = fmt.Errorf("unknown status %q", p.Status)
				}
			}
			status = true
		case "message":
			p.Message, err = r.str()
		case "digest":
			p.Digest, err = r.bin()
		default:
			return false, nil
		}
		return true, err
	}, func() error {
		return missing(!status, "status")
	})
	if err != nil {
		return nil, toDecodeError("KV digest reply", err)
	}
	if p.Digest == nil {
		p.Digest = []byte{}
	}
	return &p, nil
}
