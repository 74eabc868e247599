package shim

import (
	"encoding/binary"
	"fmt"

	"go.uber.org/zap"
)

// Scheduler calls whose answer vLLM does not wait for travel in a batch
// (include/gonixl.h, "Scheduler batches"): the binding queues them and the
// step's build_meta (or any call that reads what they change) carries them
// into the library, applied in order before it runs. A request's
// on_new_request, update_state_after_alloc, a decode's request_finished
// and update_connector_output then cost no crossing of their own; the
// step pays one.
//
// Encoding, little-endian: each op is u8 kind, u32 length of its body,
// the body; in a body, str = u32 length + bytes, groups = u32 count, then
// per group u32 count + that many i64, i64s = u32 count + i64s:
//
//	1 on_new_request           str req_id, str params
//	2 update_state_after_alloc str req_id, str params, groups blocks,
//	                           i64s num_computed, i64 num_external
//	3 request_finished         str req_id, str params, u8 normal,
//	                           i64 num_computed, groups blocks
//	                           (only where the answer holds nothing: a
//	                           decode's, without bidirectional transfer)
//	4 update_connector_output  u32 count, that many str req_id
//
// Each op gets a result byte: OpMutated (update_state_after_alloc's
// answer) and OpInvalid (the op was refused: its params, or a body that
// does not decode; logged here, with the request, and the other ops still
// apply: one request's bad input never costs another's). A batch whose
// framing does not hold (an op cut short) applies nothing.
const (
	opOnNewRequest          = 1
	opUpdateStateAfterAlloc = 2
	opRequestFinished       = 3
	opUpdateConnectorOutput = 4

	// OpMutated: update_state_after_alloc took the request's remote blocks
	// (vLLM then sets do_remote_prefill to False).
	OpMutated = 1
	// OpInvalid: the op's kv_transfer_params were refused.
	OpInvalid = 2
)

type schedOp struct {
	kind        byte
	reqID       string
	params      *TransferParams
	perr        error
	blocks      BlockIDs
	computed    []int64
	numExternal int64
	normal      bool
	numComputed int64
	ids         []string
}

// opReader reads one batch; the first error sticks.
type opReader struct {
	b   []byte
	err error
}

func (r *opReader) fail(what string) {
	if r.err == nil {
		r.err = fmt.Errorf("scheduler batch: truncated or malformed at %s", what)
	}
}

func (r *opReader) u8(what string) byte {
	if r.err != nil || len(r.b) < 1 {
		r.fail(what)
		return 0
	}
	v := r.b[0]
	r.b = r.b[1:]
	return v
}

func (r *opReader) u32(what string) int {
	if r.err != nil || len(r.b) < 4 {
		r.fail(what)
		return 0
	}
	// Every count is checked against the bytes left before anything is
	// allocated for it.
	v := binary.LittleEndian.Uint32(r.b)
	r.b = r.b[4:]
	return int(v)
}

func (r *opReader) i64(what string) int64 {
	if r.err != nil || len(r.b) < 8 {
		r.fail(what)
		return 0
	}
	v := int64(binary.LittleEndian.Uint64(r.b))
	r.b = r.b[8:]
	return v
}

func (r *opReader) bytes(what string) []byte {
	n := r.u32(what)
	if r.err != nil || len(r.b) < n {
		r.fail(what)
		return nil
	}
	v := r.b[:n:n]
	r.b = r.b[n:]
	return v
}

func (r *opReader) i64s(what string) []int64 {
	n := r.u32(what)
	if r.err != nil || len(r.b) < 8*n {
		r.fail(what)
		return nil
	}
	if n == 0 {
		return nil
	}
	out := make([]int64, n)
	for i := range out {
		out[i] = int64(binary.LittleEndian.Uint64(r.b[8*i:]))
	}
	r.b = r.b[8*n:]
	return out
}

func (r *opReader) groups(what string) BlockIDs {
	ng := r.u32(what)
	if r.err != nil || len(r.b) < 4*ng {
		r.fail(what)
		return nil
	}
	out := make(BlockIDs, ng)
	for g := range out {
		out[g] = r.i64s(what)
		for _, b := range out[g] {
			if b < 0 && r.err == nil {
				r.err = fmt.Errorf("scheduler batch: negative block id %d in %s", b, what)
			}
		}
		if out[g] == nil {
			out[g] = []int64{}
		}
	}
	return out
}

// params parses an op's kv_transfer_params; a refusal belongs to the op,
// not to the batch.
func (op *schedOp) setParams(b []byte) {
	if len(b) == 0 {
		return
	}
	op.params, op.perr = ParseTransferParams(b)
}

// decodeSchedOps splits a batch into its ops; an op whose body does not
// decode comes back with its error (perr) for applyOp to refuse. Only a
// framing that does not hold fails the batch.
func decodeSchedOps(b []byte) ([]schedOp, error) {
	var ops []schedOp
	for len(b) > 0 {
		if len(b) < 5 {
			return nil, withClass(ErrInvalidInput, fmt.Errorf("scheduler batch: an op cut short (%d bytes)", len(b)))
		}
		kind, n := b[0], binary.LittleEndian.Uint32(b[1:5])
		if uint64(n) > uint64(len(b)-5) {
			return nil, withClass(ErrInvalidInput, fmt.Errorf("scheduler batch: an op of %d bytes with %d left", n, len(b)-5))
		}
		ops = append(ops, decodeSchedOp(kind, b[5:5+n]))
		b = b[5+n:]
	}
	return ops, nil
}

func decodeSchedOp(kind byte, body []byte) schedOp {
	r := &opReader{b: body}
	op := schedOp{kind: kind}
	switch kind {
	case opOnNewRequest:
		op.reqID = string(r.bytes("req_id"))
		op.setParams(r.bytes("params"))
	case opUpdateStateAfterAlloc:
		op.reqID = string(r.bytes("req_id"))
		op.setParams(r.bytes("params"))
		op.blocks = r.groups("block_ids")
		op.computed = r.i64s("num_computed")
		op.numExternal = r.i64("num_external")
	case opRequestFinished:
		op.reqID = string(r.bytes("req_id"))
		op.setParams(r.bytes("params"))
		op.normal = r.u8("normal") != 0
		op.numComputed = r.i64("num_computed")
		op.blocks = r.groups("block_ids")
	case opUpdateConnectorOutput:
		n := r.u32("req_id count")
		if r.err == nil && len(r.b) < 4*n {
			r.fail("req_ids")
		}
		if r.err == nil {
			op.ids = make([]string, n)
			for i := range op.ids {
				op.ids[i] = string(r.bytes("req_id"))
			}
		}
	default:
		r.err = fmt.Errorf("scheduler batch: unknown op kind %d", kind)
	}
	if r.err == nil && len(r.b) != 0 {
		r.err = fmt.Errorf("scheduler batch: %d bytes left after a %d op", len(r.b), kind)
	}
	if r.err == nil && (op.numExternal < 0 || op.numComputed < 0) {
		r.err = fmt.Errorf("scheduler batch: negative token count in a %d op", kind)
	}
	if r.err != nil {
		op.perr = r.err
	}
	return op
}

// ApplyOps applies a batch in order and writes each op's result byte into
// results, which must have one byte per op. A batch whose framing does not
// hold, or that holds another number of ops, applies nothing.
func (s *Scheduler) ApplyOps(batch []byte, results []byte) error {
	ops, err := decodeSchedOps(batch)
	if err != nil {
		return err
	}
	if len(ops) != len(results) {
		return withClass(ErrInvalidInput, fmt.Errorf("scheduler batch: %d ops for %d results", len(ops), len(results)))
	}
	for i := range ops {
		results[i] = s.applyOp(&ops[i])
	}
	return nil
}

func (s *Scheduler) applyOp(op *schedOp) byte {
	if op.perr != nil {
		s.log.Error("scheduler call refused: this request will not use KV transfer",
			zap.String("req_id", op.reqID), zap.Uint8("op", op.kind), zap.Error(op.perr))
		return OpInvalid
	}
	var err error
	var res byte
	switch op.kind {
	case opOnNewRequest:
		s.OnNewRequest(op.reqID, op.params)
	case opUpdateStateAfterAlloc:
		var mutated bool
		mutated, err = s.UpdateStateAfterAlloc(op.reqID, op.params, op.blocks, op.computed, op.numExternal)
		if mutated {
			res = OpMutated
		}
	case opRequestFinished:
		if op.params != nil && (op.params.DoRemoteDecode || s.cfg.BidirectionalKVXfer) {
			// Its answer may hold the blocks (a prefill's, a read-back's):
			// vLLM must have it, so it is never deferred. Refused rather than
			// hold blocks that vLLM, told nothing, frees.
			err = fmt.Errorf("request_finished of a request whose blocks may be held cannot be batched")
			break
		}
		_, _, err = s.RequestFinished(op.reqID, op.params, op.normal, op.numComputed, op.blocks)
	case opUpdateConnectorOutput:
		s.UpdateConnectorOutput(op.ids)
	}
	if err != nil {
		s.log.Error("invalid kv_transfer_params: this request will not use KV transfer",
			zap.String("req_id", op.reqID), zap.Error(err))
		return OpInvalid
	}
	return res
}
