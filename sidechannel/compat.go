package sidechannel

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"unicode/utf8"
)

// StockTransferEngine is the transfer engine kind that stock vLLM uses (NIXL).
// A gonixl engine of this kind hashes exactly as vLLM does, so it can
// handshake with a stock vLLM NixlConnector.
const StockTransferEngine = "nixl"

// TransferEngineFactor is the extra hash factor gonixl adds when its transfer
// engine is not NIXL (for example "ucx": its agent metadata is not a NIXL
// blob, so a peer that expects NIXL must fail the handshake at the hash
// check instead of at metadata load).
const TransferEngineFactor = "gonixl_transfer_engine"

// InstanceKey is gonixl's agent-metadata key for its serving scheduler's
// instance id (AgentMetadata.Instance; the same id is kv_transfer_params'
// gonixl_instance).
const InstanceKey = "gonixl_instance"

// CompatFactors are the inputs of vLLM's compute_nixl_compatibility_hash.
// Strings are the Python str() forms (DType "torch.bfloat16", CacheDType
// "auto").
type CompatFactors struct {
	VLLMVersion      string // vllm.__version__
	ConnectorVersion int    // 0 means NIXLConnectorVersion
	Model            string
	DType            string
	NumKVHeads       int // total
	HeadSize         int
	NumHiddenLayers  int // total
	AttnBackendName  string
	CacheDType       string
	IsHMAEnabled     bool // not disable_hybrid_kv_cache_manager
	Speculative      *SpeculativeFactors
	TransferMode     string // "pull" (default when empty) or "push"

	// TransferEngine is gonixl's engine kind. It joins the factors (as
	// TransferEngineFactor) only when it is neither "" nor
	// StockTransferEngine, so that a gonixl engine using NIXL produces the
	// same hash as stock vLLM.
	TransferEngine string
}

// SpeculativeFactors mirror vLLM's factors for EAGLE-type speculators;
// nil pointers and a nil AuxiliaryLayerIDs are JSON null.
type SpeculativeFactors struct {
	Method            string
	Model             string
	Revision          *string
	CodeRevision      *string
	ParallelDrafting  bool
	KVCacheDType      string
	AuxiliaryLayerIDs []int
}

// Map returns the factor dictionary exactly as vLLM builds it (plus the
// transfer-engine factor under the rule above).
func (f *CompatFactors) Map() map[string]any {
	ver := f.ConnectorVersion
	if ver == 0 {
		ver = NIXLConnectorVersion
	}
	mode := f.TransferMode
	if mode == "" {
		mode = "pull"
	}
	m := map[string]any{
		"vllm_version":           f.VLLMVersion,
		"nixl_connector_version": ver,
		"model":                  f.Model,
		"dtype":                  f.DType,
		"num_kv_heads":           f.NumKVHeads,
		"head_size":              f.HeadSize,
		"num_hidden_layers":      f.NumHiddenLayers,
		"attn_backend_name":      f.AttnBackendName,
		"cache_dtype":            f.CacheDType,
		"is_hma_enabled":         f.IsHMAEnabled,
		"speculative_config":     nil,
		"transfer_mode":          mode,
	}
	if s := f.Speculative; s != nil {
		var aux any
		if s.AuxiliaryLayerIDs != nil {
			ids := make([]any, len(s.AuxiliaryLayerIDs))
			for i, v := range s.AuxiliaryLayerIDs {
				ids[i] = v
			}
			aux = ids
		}
		m["speculative_config"] = map[string]any{
			"method":              s.Method,
			"model":               s.Model,
			"revision":            optStr(s.Revision),
			"code_revision":       optStr(s.CodeRevision),
			"parallel_drafting":   s.ParallelDrafting,
			"kv_cache_dtype":      s.KVCacheDType,
			"auxiliary_layer_ids": aux,
		}
	}
	return EngineFactors(m, f.TransferEngine)
}

// EngineFactors is the one place gonixl's own rule for the compatibility
// hash lives: vLLM's factor dictionary m plus TransferEngineFactor when
// engineKind is neither "" nor StockTransferEngine (a gonixl engine on NIXL
// hashes exactly as stock vLLM does; one on its own transport cannot pair
// with NIXL peers, and the hash says so). m is not modified. (vLLM's own
// factors come from the Python side's vLLM config and, for those only the
// library knows -- attn_backend_name, nixl_connector_version -- from the
// worker.)
func EngineFactors(m map[string]any, engineKind string) map[string]any {
	out := make(map[string]any, len(m)+1)
	for k, v := range m {
		out[k] = v
	}
	if engineKind != "" && engineKind != StockTransferEngine {
		out[TransferEngineFactor] = engineKind
	}
	return out
}

func optStr(p *string) any {
	if p == nil {
		return nil
	}
	return *p
}

// CompatibilityHash returns vLLM's compatibility hash of the factors:
// hex SHA-256 of json.dumps(factors, sort_keys=True).
func CompatibilityHash(f *CompatFactors) (string, error) { return HashFactors(f.Map()) }

// HashFactors is vLLM's hash_factors: hex SHA-256 of the UTF-8 bytes of
// json.dumps(items, sort_keys=True) with Python's default separators (", ",
// ": ") and ensure_ascii. Values may be nil, bool, int, int64, string,
// []any, []int, []string and map[string]any.
func HashFactors(items map[string]any) (string, error) {
	s, err := PythonJSON(items)
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:]), nil
}

// PythonJSON renders v as Python's json.dumps(v, sort_keys=True) does.
func PythonJSON(v any) (string, error) {
	var b strings.Builder
	if err := pyJSON(&b, v, 0); err != nil {
		return "", err
	}
	return b.String(), nil
}

func pyJSON(b *strings.Builder, v any, depth int) error {
	if depth > maxDepth {
		return fmt.Errorf("sidechannel: hash factors nested too deeply")
	}
	switch x := v.(type) {
	case nil:
		b.WriteString("null")
	case bool:
		if x {
			b.WriteString("true")
		} else {
			b.WriteString("false")
		}
	case int:
		b.WriteString(strconv.Itoa(x))
	case int64:
		b.WriteString(strconv.FormatInt(x, 10))
	case string:
		return pyJSONString(b, x)
	case []int:
		b.WriteByte('[')
		for i, e := range x {
			if i > 0 {
				b.WriteString(", ")
			}
			b.WriteString(strconv.Itoa(e))
		}
		b.WriteByte(']')
	case []string:
		b.WriteByte('[')
		for i, e := range x {
			if i > 0 {
				b.WriteString(", ")
			}
			if err := pyJSONString(b, e); err != nil {
				return err
			}
		}
		b.WriteByte(']')
	case []any:
		b.WriteByte('[')
		for i, e := range x {
			if i > 0 {
				b.WriteString(", ")
			}
			if err := pyJSON(b, e, depth+1); err != nil {
				return err
			}
		}
		b.WriteByte(']')
	case map[string]any:
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		// Byte order of UTF-8 equals code-point order, which is Python's str order.
		sort.Strings(keys)
		b.WriteByte('{')
		for i, k := range keys {
			if i > 0 {
				b.WriteString(", ")
			}
			if err := pyJSONString(b, k); err != nil {
				return err
			}
			b.WriteString(": ")
			if err := pyJSON(b, x[k], depth+1); err != nil {
				return err
			}
		}
		b.WriteByte('}')
	default:
		return fmt.Errorf("sidechannel: hash factor of unsupported type %T", v)
	}
	return nil
}

// pyJSONString writes s with ensure_ascii escaping: everything outside
// 0x20..0x7e is escaped, \" \\ \n \r \t \b \f by name, the rest as \uxxxx
// (lower-case hex, UTF-16 surrogate pairs above U+FFFF).
func pyJSONString(b *strings.Builder, s string) error {
	if !utf8.ValidString(s) {
		return fmt.Errorf("sidechannel: hash factor %q is not valid UTF-8", s)
	}
	const hexd = "0123456789abcdef"
	u := func(r rune) {
		b.WriteString(`\u`)
		b.WriteByte(hexd[r>>12&0xf])
		b.WriteByte(hexd[r>>8&0xf])
		b.WriteByte(hexd[r>>4&0xf])
		b.WriteByte(hexd[r&0xf])
	}
	b.WriteByte('"')
	for _, r := range s {
		switch {
		case r == '"':
			b.WriteString(`\"`)
		case r == '\\':
			b.WriteString(`\\`)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r == '\t':
			b.WriteString(`\t`)
		case r == '\b':
			b.WriteString(`\b`)
		case r == '\f':
			b.WriteString(`\f`)
		case r >= 0x20 && r <= 0x7e:
			b.WriteRune(r)
		case r > 0xffff:
			r -= 0x10000
			u(0xd800 | (r>>10)&0x3ff)
			u(0xdc00 | r&0x3ff)
		default:
			u(r)
		}
	}
	b.WriteByte('"')
	return nil
}

// HashFactorsJSON hashes a factor dictionary that arrives as JSON (for
// example json.dumps of the dict vLLM builds, passed down from Python),
// completed by EngineFactors. Numbers must be integers.
func HashFactorsJSON(factorsJSON []byte, engineKind string) (string, error) {
	d := json.NewDecoder(bytes.NewReader(factorsJSON))
	d.UseNumber()
	var v any
	if err := d.Decode(&v); err != nil {
		return "", fmt.Errorf("sidechannel: hash factors: %w", err)
	}
	if d.More() {
		return "", errors.New("sidechannel: hash factors: trailing data after the JSON object")
	}
	m, ok := v.(map[string]any)
	if !ok {
		return "", errors.New("sidechannel: hash factors must be a JSON object")
	}
	nv, err := intNumbers(m, 0)
	if err != nil {
		return "", err
	}
	return HashFactors(EngineFactors(nv.(map[string]any), engineKind))
}

func intNumbers(v any, depth int) (any, error) {
	if depth > maxDepth {
		return nil, errors.New("sidechannel: hash factors nested too deeply")
	}
	switch x := v.(type) {
	case json.Number:
		n, err := x.Int64()
		if err != nil {
			return nil, fmt.Errorf("sidechannel: hash factor %s is not an int64 (floats are not hashed the Python way)", x)
		}
		return n, nil
	case []any:
		for i := range x {
			e, err := intNumbers(x[i], depth+1)
			if err != nil {
				return nil, err
			}
			x[i] = e
		}
	case map[string]any:
		for k := range x {
			e, err := intNumbers(x[k], depth+1)
			if err != nil {
				return nil, err
			}
			x[k] = e
		}
	}
	return v, nil
}
