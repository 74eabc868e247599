package kvwire

import (
	"encoding/json"
	"fmt"
	"math"
	"strconv"
)

// BlockIDs holds block ids per KV-cache group, as vLLM's BlockIds tuple.
// Its JSON form is vLLM's list of lists; in step metadata each group is one
// bin blob (EncodeMsgpack).
type BlockIDs [][]int64

// Empty reports whether no group has a block.
func (b BlockIDs) Empty() bool {
	for _, g := range b {
		if len(g) > 0 {
			return false
		}
	}
	return true
}

// Count is the number of blocks in all groups.
func (b BlockIDs) Count() int {
	n := 0
	for _, g := range b {
		n += len(g)
	}
	return n
}

// TransferParams is a request's kv_transfer_params as the proxies and vLLM
// send them. Presence matters as much as value (vLLM checks "key in
// params"), so every optional field records whether it was present.
type TransferParams struct {
	DoRemotePrefill bool
	DoRemoteDecode  bool

	RemoteBlockIDs  BlockIDs
	HasRemoteBlocks bool // remote_block_ids present and non-empty
	RemoteEngineID  string
	RemoteRequestID string
	RemoteHost      string
	RemotePort      int
	TPSize          int
	DCPSize         int
	PPSize          int
	RemoteNumTokens int64
	RemoteBlockSize int
	RemoteExpiry    *float64
	// ReadbackTokens (gonixl_readback_tokens, -1 when absent): in a
	// bidirectional turn, how many leading tokens of this prompt match the
	// tokens whose KV the decode holds, as the Python connector found by
	// comparing the decode's token digest (pybridge/gonixl/vllm.py); the
	// prefill pulls no further.
	ReadbackTokens int64
	// ExpiryUnix (gonixl_expiry_unix, 0 when absent): the Unix time at
	// which a gonixl decode frees the blocks these params name.
	ExpiryUnix float64
	// PromptDigest (gonixl_prompt_digest, "" when absent): the Python
	// connector's digest of a prompt's tokens (gonixl.vllm.prompt_digest).
	// Push mode: a prefill's finished request and a decode's registration
	// carry it, and the prefill WRITEs only into a decode whose prompt has
	// the same digest.
	PromptDigest string
	// Instance (gonixl_instance, "" when absent): the id of the gonixl
	// scheduler process that made these params.
	Instance string
	// KVDigest (gonixl_kv_digest, nil when absent or malformed): the
	// digests of the KV the prefill computed for RemoteBlockIDs;
	// KVDigestErr says why one present was not taken (the blocks are then
	// read unchecked, and the reader logs it).
	KVDigest    *KVDigest
	KVDigestErr error
	// KVDigestServed (gonixl_kv_digest_served): a decode's params whose
	// blocks' digests its side channel serves (a bidirectional read-back).
	KVDigestServed  bool
	BlocksProcessed bool // _remote_blocks_processed
	hasEngine       bool
	hasRequest      bool
	hasHost         bool
	hasPort         bool
	hasTPSize       bool
}

// HasRemoteEndpoint reports whether the four keys that identify the remote
// side are all present (vLLM's `all(p in params for p in (...))`).
func (p *TransferParams) HasRemoteEndpoint() bool {
	return p.hasEngine && p.hasRequest && p.hasHost && p.hasPort
}

// UsableEndpoint reports whether the remote side can be contacted: the four
// keys present, and engine id, host and port not empty or null (vLLM checks
// presence only; a null or 0 port would be dialled as port 0).
func (p *TransferParams) UsableEndpoint() bool {
	return p.HasRemoteEndpoint() && p.RemoteEngineID != "" && p.RemoteHost != "" && p.RemotePort > 0
}

// HasTPSize reports whether tp_size was given.
func (p *TransferParams) HasTPSize() bool { return p.hasTPSize }

// HasHeartbeatTarget reports whether a decode request carries what a
// heartbeat needs (on_new_request's check).
func (p *TransferParams) HasHeartbeatTarget() bool {
	return p.HasRemoteEndpoint() && p.hasTPSize && p.RemoteEngineID != "" && p.RemoteHost != ""
}

// ParseTransferParams decodes kv_transfer_params JSON. A null or empty
// input is (nil, nil): the request has no transfer. Wrong types are errors
// naming the key. Params in the plain form are read by a scanner
// (params_scan.go); the result is encoding/json's in every case.
func ParseTransferParams(data []byte) (*TransferParams, error) {
	return parseParams(data, true)
}

// parseParams is ParseTransferParams; with scan false every byte goes
// through encoding/json (the reference the scanner is held to).
func parseParams(data []byte, scan bool) (_ *TransferParams, err error) {
	if len(data) == 0 || string(data) == "null" {
		return nil, nil
	}
	var raw rawParams
	if scan {
		raw.fields, raw.scanned = scanObject(data)
	}
	if !raw.scanned {
		if err := json.Unmarshal(data, &raw.m); err != nil {
			return nil, fmt.Errorf("kv_transfer_params: not a JSON object: %w", err)
		}
	}
	if raw.len() == 0 {
		return nil, nil
	}
	p := &TransferParams{TPSize: 1, DCPSize: 1, PPSize: 1}
	if p.DoRemotePrefill, _, err = getBool(&raw, "do_remote_prefill"); err != nil {
		return nil, err
	}
	if p.DoRemoteDecode, _, err = getBool(&raw, "do_remote_decode"); err != nil {
		return nil, err
	}
	if p.BlocksProcessed, _, err = getBool(&raw, "_remote_blocks_processed"); err != nil {
		return nil, err
	}
	if p.RemoteEngineID, p.hasEngine, err = getString(&raw, "remote_engine_id"); err != nil {
		return nil, err
	}
	if p.RemoteRequestID, p.hasRequest, err = getString(&raw, "remote_request_id"); err != nil {
		return nil, err
	}
	if p.RemoteHost, p.hasHost, err = getString(&raw, "remote_host"); err != nil {
		return nil, err
	}
	var port int64
	if port, p.hasPort, err = getInt(&raw, "remote_port"); err != nil {
		return nil, err
	}
	if p.hasPort && (port < 0 || port > 65535) {
		return nil, fmt.Errorf("kv_transfer_params: remote_port %d out of range", port)
	}
	p.RemotePort = int(port)
	if v, ok, err := getInt(&raw, "tp_size"); err != nil {
		return nil, err
	} else if ok {
		if v < 1 || v > 1<<16 {
			return nil, fmt.Errorf("kv_transfer_params: tp_size %d out of range", v)
		}
		p.TPSize, p.hasTPSize = int(v), true
	}
	for _, k := range []struct {
		key string
		dst *int
	}{{"dcp_size", &p.DCPSize}, {"pp_size", &p.PPSize}, {"remote_block_size", &p.RemoteBlockSize}} {
		if v, ok, err := getInt(&raw, k.key); err != nil {
			return nil, err
		} else if ok {
			if v < 0 || v > 1<<20 {
				return nil, fmt.Errorf("kv_transfer_params: %s %d out of range", k.key, v)
			}
			*k.dst = int(v)
		}
	}
	if p.DCPSize == 0 {
		p.DCPSize = 1
	}
	if p.PPSize == 0 {
		p.PPSize = 1
	}
	if v, ok, err := getInt(&raw, "remote_num_tokens"); err != nil {
		return nil, err
	} else if ok {
		if v < 0 {
			return nil, fmt.Errorf("kv_transfer_params: remote_num_tokens %d is negative", v)
		}
		p.RemoteNumTokens = v
	}
	p.ReadbackTokens = -1
	if v, ok, err := getInt(&raw, KeyReadbackTokens); err != nil {
		return nil, err
	} else if ok {
		if v < 0 {
			return nil, fmt.Errorf("kv_transfer_params: gonixl_readback_tokens %d is negative", v)
		}
		p.ReadbackTokens = v
	}
	if v, ok, err := getFloat(&raw, KeyExpiryUnix); err != nil {
		return nil, err
	} else if ok {
		if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
			return nil, fmt.Errorf("kv_transfer_params: gonixl_expiry_unix %v is not a time", v)
		}
		p.ExpiryUnix = v
	}
	if v, ok, err := getString(&raw, KeyPromptDigest); err != nil {
		return nil, err
	} else if ok {
		if len(v) > 256 {
			return nil, fmt.Errorf("kv_transfer_params: gonixl_prompt_digest of %d bytes", len(v))
		}
		p.PromptDigest = v
	}
	if v, ok, err := getString(&raw, KeyInstance); err != nil {
		return nil, err
	} else if ok {
		if len(v) > 64 {
			return nil, fmt.Errorf("kv_transfer_params: %s of %d bytes", KeyInstance, len(v))
		}
		p.Instance = v
	}
	if v, ok, err := getFloat(&raw, "remote_blocks_expiry_time"); err != nil {
		return nil, err
	} else if ok {
		p.RemoteExpiry = &v
	}
	if ids, ok := raw.get("remote_block_ids"); ok && string(ids) != "null" {
		b, err := parseBlockIDs(ids, raw.scanned)
		if err != nil {
			return nil, err
		}
		p.RemoteBlockIDs = b
		p.HasRemoteBlocks = !b.Empty()
	}
	if v, ok, err := getBool(&raw, KeyKVDigestServed); err != nil {
		return nil, err
	} else if ok {
		p.KVDigestServed = v
	}
	if d, ok := raw.get(KeyKVDigest); ok && string(d) != "null" {
		p.KVDigest, p.KVDigestErr = parseKVDigest(d, p.RemoteBlockIDs, raw.scanned)
	}
	return p, nil
}

// rawParams is a params object split into keys and raw values: by the
// scanner (fields) or, for input it leaves, by encoding/json (m). Scanned
// values are read by the plain readers first, encoding/json after.
type rawParams struct {
	fields  []rawField
	m       map[string]json.RawMessage
	scanned bool
}

func (r *rawParams) len() int {
	if r.scanned {
		return len(r.fields)
	}
	return len(r.m)
}

func (r *rawParams) get(key string) (json.RawMessage, bool) {
	if !r.scanned {
		v, ok := r.m[key]
		return v, ok
	}
	for _, f := range r.fields {
		if string(f.key) == key {
			return f.val, true
		}
	}
	return nil, false
}

// parseBlockIDs accepts vLLM's two spellings: a flat list [1,2,3] (one
// group, as older versions send) or a list of lists [[1,2],[3]].
func parseBlockIDs(data json.RawMessage, scan bool) (BlockIDs, error) {
	if scan {
		if b, ok := plainBlockIDs(data); ok {
			return b, nil
		}
	}
	var outer []json.RawMessage
	if err := json.Unmarshal(data, &outer); err != nil {
		return nil, fmt.Errorf("kv_transfer_params: remote_block_ids must be a list: %w", err)
	}
	if len(outer) == 0 {
		return BlockIDs{}, nil
	}
	if len(outer[0]) > 0 && outer[0][0] == '[' {
		out := make(BlockIDs, len(outer))
		for i, g := range outer {
			ids, err := parseIDList(g)
			if err != nil {
				return nil, fmt.Errorf("kv_transfer_params: remote_block_ids[%d]: %w", i, err)
			}
			out[i] = ids
		}
		return out, nil
	}
	ids, err := parseIDList(data)
	if err != nil {
		return nil, fmt.Errorf("kv_transfer_params: remote_block_ids: %w", err)
	}
	return BlockIDs{ids}, nil
}

func parseIDList(data json.RawMessage) ([]int64, error) {
	var nums []json.Number
	if err := json.Unmarshal(data, &nums); err != nil {
		return nil, fmt.Errorf("must be a list of integers: %w", err)
	}
	out := make([]int64, len(nums))
	for i, n := range nums {
		v, err := strconv.ParseInt(n.String(), 10, 64)
		if err != nil {
			return nil, fmt.Errorf("element %d (%s) is not an integer", i, n)
		}
		if v < 0 {
			return nil, fmt.Errorf("element %d is a negative block id (%d)", i, v)
		}
		out[i] = v
	}
	return out, nil
}

func getBool(raw *rawParams, key string) (bool, bool, error) {
	v, ok := raw.get(key)
	if !ok || string(v) == "null" {
		return false, ok, nil
	}
	if raw.scanned && (string(v) == "true" || string(v) == "false") {
		return string(v) == "true", true, nil
	}
	var b bool
	if err := json.Unmarshal(v, &b); err != nil {
		return false, true, fmt.Errorf("kv_transfer_params: %s must be a boolean, got %s", key, v)
	}
	return b, true, nil
}

func getString(raw *rawParams, key string) (string, bool, error) {
	v, ok := raw.get(key)
	if !ok {
		return "", false, nil
	}
	if string(v) == "null" {
		// vLLM's `key in params` is true for a None value; the proxy sends
		// remote_*: null to prefills. Present, but empty.
		return "", true, nil
	}
	if raw.scanned {
		if s, ok := plainStringValue(v); ok {
			return s, true, nil
		}
	}
	var s string
	if err := json.Unmarshal(v, &s); err != nil {
		return "", true, fmt.Errorf("kv_transfer_params: %s must be a string, got %s", key, v)
	}
	return s, true, nil
}

func getFloat(raw *rawParams, key string) (float64, bool, error) {
	v, ok := raw.get(key)
	if !ok || string(v) == "null" {
		return 0, false, nil
	}
	if raw.scanned {
		if f, ok := plainFloat(v); ok {
			return f, true, nil
		}
	}
	var f float64
	if err := json.Unmarshal(v, &f); err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
		return 0, true, fmt.Errorf("kv_transfer_params: %s must be a number, got %s", key, v)
	}
	return f, true, nil
}

func getInt(raw *rawParams, key string) (int64, bool, error) {
	v, ok := raw.get(key)
	if !ok || string(v) == "null" {
		return 0, ok && string(v) == "null", nil
	}
	if raw.scanned {
		if n, ok := plainInt(v); ok {
			return n, true, nil
		}
	}
	var n json.Number
	if err := json.Unmarshal(v, &n); err != nil {
		return 0, true, fmt.Errorf("kv_transfer_params: %s must be an integer, got %s", key, v)
	}
	i, err := strconv.ParseInt(n.String(), 10, 64)
	if err != nil {
		return 0, true, fmt.Errorf("kv_transfer_params: %s must be an integer, got %s", key, v)
	}
	return i, true, nil
}

// MarshalJSON writes empty groups as [] (never null), as vLLM's lists are.
func (b BlockIDs) MarshalJSON() ([]byte, error) {
	out := make([][]int64, len(b))
	for i, g := range b {
		if g == nil {
			g = []int64{}
		}
		out[i] = g
	}
	return json.Marshal(out)
}
