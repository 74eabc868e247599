package shim

import (
	"sync"

	"github.com/gonixl/gonixl/shim/kvwire"
)

// The wire types shim works with are kvwire's (one home for the formats);
// these names let the connector logic say BlockIDs rather than
// kvwire.BlockIDs at every use.
type (
	BlockIDs       = kvwire.BlockIDs
	TransferParams = kvwire.TransferParams
	StepMeta       = kvwire.StepMeta
	RecvReq        = kvwire.RecvReq
	RemoteMeta     = kvwire.RemoteMeta
	PushFinished   = kvwire.PushFinished
	HeartbeatInfo  = kvwire.HeartbeatInfo
	Finished       = kvwire.Finished
	BlockReshape   = kvwire.BlockReshape
)

// ParseTransferParams is kvwire.ParseTransferParams with its errors in
// class ErrInvalidInput (capi maps it to GONIXL_ERR_INVALID_ARG), its
// parses kept by their bytes (paramsCache): the result is shared and must
// not be changed.
func ParseTransferParams(data []byte) (_ *TransferParams, err error) {
	defer classify(&err, ErrInvalidInput)
	if p, ok := parsedParams.get(data); ok {
		return p, nil
	}
	p, err := kvwire.ParseTransferParams(data)
	if err == nil && p != nil {
		parsedParams.put(data, p)
	}
	return p, err
}

// paramsCache keeps the last parses of kv_transfer_params by their bytes.
// vLLM hands the connector one request's params in on_new_request,
// get_num_new_matched_tokens (again at every scheduling attempt while the
// request waits for blocks) and update_state_after_alloc, unchanged; with
// KV digests a parse is tens of microseconds (20 us for 32 blocks, 68 for
// 256). No code changes a TransferParams after parsing, so one parse
// serves every call with the same bytes. Bounded by entries and bytes;
// the oldest go first.
type paramsCache struct {
	mu    sync.Mutex
	m     map[string]*TransferParams
	order []string
	bytes int
}

const (
	maxCachedParams      = 256
	maxCachedParamsBytes = 8 << 20
	maxCachedParamsEntry = 256 << 10
)

var parsedParams paramsCache

// paramsCost is what an entry holds: its key and, parsed, block ids and
// digests at 8 bytes each, up to about twice the JSON that names them.
func paramsCost(key string) int { return 3 * len(key) }

func (c *paramsCache) get(data []byte) (*TransferParams, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	p, ok := c.m[string(data)]
	return p, ok
}

func (c *paramsCache) put(data []byte, p *TransferParams) {
	if len(data) > maxCachedParamsEntry {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	key := string(data)
	if _, ok := c.m[key]; ok {
		return
	}
	if c.m == nil {
		c.m = map[string]*TransferParams{}
	}
	for len(c.order) > 0 && (len(c.order) >= maxCachedParams || c.bytes+paramsCost(key) > maxCachedParamsBytes) {
		old := c.order[0]
		c.order = c.order[1:]
		delete(c.m, old)
		c.bytes -= paramsCost(old)
	}
	c.m[key] = p
	c.order = append(c.order, key)
	c.bytes += paramsCost(key)
}

// DecodeStepMeta is kvwire.DecodeStepMeta.
func DecodeStepMeta(b []byte) (*StepMeta, error) { return kvwire.DecodeStepMeta(b) }

// pushReg is a registration as a prefill keeps it: the decode's message
// and when it arrived (this worker's clock).
type pushReg struct {
	kvwire.PushReg
	received float64
	// from: the decode agent that sent it. Its blocks are that process's:
	// a process that took the decode's engine id and address after it
	// (a restart) has other agents and is never written.
	from string
}

// decodePushReg parses a registration (without its prefix).
func decodePushReg(b []byte) (*pushReg, error) {
	r, err := kvwire.DecodePushReg(b)
	if err != nil {
		return nil, err
	}
	return &pushReg{PushReg: *r}, nil
}
