package kvwire

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"sync"

	"github.com/vmihailenco/msgpack/v5"
)

// RemoteMeta says where a request's KV lives on the remote engine.
type RemoteMeta struct {
	BlockIDs  BlockIDs `msgpack:"block_ids"`
	Host      string   `msgpack:"host"`
	Port      int      `msgpack:"port"`
	EngineID  string   `msgpack:"engine_id"`
	RequestID string   `msgpack:"request_id"`
	Expiry    *float64 `msgpack:"expiry,omitempty"` // remote_blocks_expiry_time, remote clock
	NumTokens int64    `msgpack:"num_tokens"`
	Instance  string   `msgpack:"instance,omitempty"` // gonixl_instance of the params
	// Digest: gonixl_kv_digest of the params, when the decode checks it.
	Digest *KVDigest `msgpack:"digest,omitempty"`
	// DigestServed (a read-back): the decode serves the digests of these
	// blocks on its side channel (gonixl_kv_digest_served), and the reader
	// checks against them.
	DigestServed bool `msgpack:"digest_served,omitempty"`
}

// RecvReq is one request the worker must load (vLLM's ReqMeta).
type RecvReq struct {
	LocalBlockIDs    BlockIDs   `msgpack:"local_block_ids"`
	LocalNumComputed []int64    `msgpack:"local_num_computed"`
	TPSize           int        `msgpack:"tp_size"`
	DCPSize          int        `msgpack:"dcp_size"`
	PPSize           int        `msgpack:"pp_size"`
	RemoteBlockSize  int        `msgpack:"remote_block_size"`
	AwaitingKVs      bool       `msgpack:"awaiting_kvs"`
	Remote           RemoteMeta `msgpack:"remote"`
	// Readback: a bidirectional turn, this (prefill) engine reading the
	// earlier turns' KV back from the decode that holds it. The remote list
	// then covers the decode's tokens (prompt and output, which may run
	// past this prompt or past what this engine pulls) and is trimmed at
	// its end to the blocks this engine allocated.
	Readback bool `msgpack:"readback,omitempty"`
	// Push: push mode, this (decode) engine registers LocalBlockIDs with
	// the prefill named in Remote and waits for its WRITE (push.go);
	// Remote.BlockIDs is empty.
	Push bool `msgpack:"push,omitempty"`
	// PromptDigest (push mode): the digest of this request's prompt, sent
	// with the registration (gonixl_prompt_digest).
	PromptDigest string `msgpack:"prompt_digest,omitempty"`
}

// PushFinished is a prefill request whose blocks wait for its decode's
// registration (push mode).
type PushFinished struct {
	Blocks       BlockIDs `msgpack:"blocks"`
	PromptDigest string   `msgpack:"prompt_digest,omitempty"`
	// Tokens: the prompt tokens whose KV the blocks hold (0: not known),
	// for the KV digests sent before the WRITE.
	Tokens int64 `msgpack:"tokens,omitempty"`
}

// HeartbeatInfo is what a decode worker needs to keep one prefill engine's
// leases alive.
type HeartbeatInfo struct {
	ReqIDs []string `msgpack:"req_ids"` // remote (prefill) request ids
	// Expiry holds, for the ids whose prefill sent one, the lease expiry
	// from kv_transfer_params (remote clock).
	Expiry  map[string]float64 `msgpack:"expiry,omitempty"`
	Host    string             `msgpack:"host"`
	Port    int                `msgpack:"port"`
	TPSize  int                `msgpack:"tp_size"`
	DCPSize int                `msgpack:"dcp_size"`
	PPSize  int                `msgpack:"pp_size"`
}

// StepMeta is the per-step scheduler → worker metadata (vLLM's
// NixlConnectorMetadata), carried through vLLM as one opaque bytes field.
type StepMeta struct {
	ReqsToRecv       map[string]*RecvReq       `msgpack:"reqs_to_recv"`
	ReqsToSend       map[string]float64        `msgpack:"reqs_to_send"` // expiry, scheduler clock
	SchedulerClock   float64                   `msgpack:"scheduler_clock"`
	ReqsInBatch      []string                  `msgpack:"reqs_in_batch"`
	ReqsNotProcessed []string                  `msgpack:"reqs_not_processed"`
	Heartbeats       map[string]*HeartbeatInfo `msgpack:"heartbeats"` // by remote engine id
	// PushFinished (push mode, a prefill): the blocks of each request that
	// finished this step, to WRITE once its decode registered (push.go).
	PushFinished map[string]*PushFinished `msgpack:"push_finished,omitempty"`
	// PushAborted (push mode, a decode): requests vLLM finished while they
	// waited for the prefill's WRITE.
	PushAborted []string `msgpack:"push_aborted,omitempty"`
	// PushEarly (push mode, a prefill): requests whose prompt this step's
	// forward completes, with their blocks, WRITTEN once the forward is done
	// (Scheduler.PushPromptDone); their request_finished follows as
	// PushFinished in a later step.
	PushEarly map[string]*PushFinished `msgpack:"push_early,omitempty"`
	// PushPreempted (push mode, a prefill): announced requests vLLM
	// preempted before their request_finished; their WRITE is dropped if
	// not posted, waited for if posted, before this step's forward.
	PushPreempted []string `msgpack:"push_preempted,omitempty"`
}

// StepMetaVersion guards against a scheduler and worker from different
// builds exchanging metadata.
const StepMetaVersion = 2 // 2: block ids as bin blobs (BlockIDs.EncodeMsgpack)

// StepEnvelope is the encoded form: the version and the metadata.
type StepEnvelope struct {
	Version int       `msgpack:"v"`
	Meta    *StepMeta `msgpack:"m"`
}

// Encode serialises the metadata: msgpack.Marshal's encoding, into a
// buffer sized from the metadata up front (Marshal's buffer, grown by
// doubling, allocated about twice the output, most of a step's garbage).
func (m *StepMeta) Encode() ([]byte, error) {
	buf := bytes.NewBuffer(make([]byte, 0, m.sizeHint()))
	enc := msgpack.GetEncoder()
	enc.Reset(buf)
	err := enc.Encode(&StepEnvelope{Version: StepMetaVersion, Meta: m})
	msgpack.PutEncoder(enc)
	if err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// sizeHint estimates Encode's output: the block ids' bytes and the strings,
// plus a generous allowance for keys and numbers per entry. A short
// estimate only costs a regrowth.
func (m *StepMeta) sizeHint() int {
	n := 512
	for id, rr := range m.ReqsToRecv {
		if rr == nil {
			// The scheduler's order can name a request no longer in its
			// map; msgpack writes nil and the worker drops it (dropNil).
			n += 16 + len(id)
			continue
		}
		rm := &rr.Remote
		n += 320 + len(id) + 8*(rr.LocalBlockIDs.Count()+rm.BlockIDs.Count()+len(rr.LocalBlockIDs)+len(rm.BlockIDs)) +
			9*len(rr.LocalNumComputed) + len(rr.PromptDigest) + len(rm.Host) + len(rm.EngineID) + len(rm.RequestID)
	}
	for id := range m.ReqsToSend {
		n += 10 + len(id)
	}
	for _, ids := range [][]string{m.ReqsInBatch, m.ReqsNotProcessed, m.PushAborted, m.PushPreempted} {
		for _, id := range ids {
			n += 2 + len(id)
		}
	}
	for eng, hb := range m.Heartbeats {
		if hb == nil {
			n += 16 + len(eng)
			continue
		}
		n += 128 + len(eng) + len(hb.Host)
		for _, id := range hb.ReqIDs {
			n += 2 + len(id)
		}
		for id := range hb.Expiry {
			n += 11 + len(id)
		}
	}
	for _, pm := range []map[string]*PushFinished{m.PushFinished, m.PushEarly} {
		for id, pf := range pm {
			if pf == nil {
				n += 16 + len(id)
				continue
			}
			n += 64 + len(id) + len(pf.PromptDigest) + 8*(pf.Blocks.Count()+len(pf.Blocks))
		}
	}
	return n
}

// DecodeStepMeta parses metadata made by Encode. Garbage is an error.
func DecodeStepMeta(b []byte) (*StepMeta, error) {
	if err := CheckMsgpack(b, maxStepMetaDepth); err != nil {
		return nil, fmt.Errorf("step metadata: %w", err)
	}
	var env StepEnvelope
	if err := msgpack.Unmarshal(b, &env); err != nil {
		return nil, fmt.Errorf("step metadata: %w", err)
	}
	if env.Version != StepMetaVersion {
		return nil, fmt.Errorf("step metadata: version %d, this library speaks %d (scheduler and worker run different gonixl builds)", env.Version, StepMetaVersion)
	}
	if env.Meta == nil {
		return nil, fmt.Errorf("step metadata: empty")
	}
	env.Meta.dropNil()
	return env.Meta, nil
}

// dropNil removes nil entries (msgpack nil map values, which a correct
// scheduler never writes): an entry without data names no work, and the
// worker would dereference it (a panic: the library poisoned). Negative or out-of-range block ids are left
// to the worker, which fails only that request (pairBlocks).
func (m *StepMeta) dropNil() {
	for id, rr := range m.ReqsToRecv {
		if rr == nil {
			delete(m.ReqsToRecv, id)
		}
	}
	for _, pm := range []map[string]*PushFinished{m.PushFinished, m.PushEarly} {
		for id, pf := range pm {
			if pf == nil {
				delete(pm, id)
			}
		}
	}
	for eng, hb := range m.Heartbeats {
		if hb == nil {
			delete(m.Heartbeats, eng)
		}
	}
}

// EncodeMsgpack writes block ids in the step metadata as one bin blob per
// group (little-endian int64s): a 65,536-block request decodes in tens of
// microseconds instead of the ~12 ms msgpack's generic arrays of integers
// take, and the decode runs on vLLM's model thread (start_load_kv). The
// blobs are converted through a pooled scratch buffer, blockChunk ids at a
// time, rather than a buffer made per group.
func (b BlockIDs) EncodeMsgpack(enc *msgpack.Encoder) error {
	if b == nil {
		return enc.EncodeNil()
	}
	if err := enc.EncodeArrayLen(len(b)); err != nil {
		return err
	}
	sp := blockScratch.Get().(*[]byte)
	defer blockScratch.Put(sp)
	buf := *sp
	for _, g := range b {
		if err := enc.EncodeBytesLen(8 * len(g)); err != nil {
			return err
		}
		for len(g) > 0 {
			c := g[:min(len(g), blockChunk)]
			for i, v := range c {
				binary.LittleEndian.PutUint64(buf[8*i:], uint64(v))
			}
			if _, err := enc.Writer().Write(buf[:8*len(c)]); err != nil {
				return err
			}
			g = g[len(c):]
		}
	}
	return nil
}

// DecodeMsgpack reads EncodeMsgpack's form.
func (b *BlockIDs) DecodeMsgpack(dec *msgpack.Decoder) error {
	n, err := dec.DecodeArrayLen()
	if err != nil {
		return err
	}
	if n < 0 {
		*b = nil
		return nil
	}
	sp := blockScratch.Get().(*[]byte)
	defer blockScratch.Put(sp)
	buf := *sp
	out := make(BlockIDs, 0, n)
	for i := 0; i < n; i++ {
		size, err := dec.DecodeBytesLen()
		if err != nil {
			return err
		}
		size = max(size, 0) // nil: an empty group
		if size%8 != 0 {
			return fmt.Errorf("block ids: group %d has %d bytes, not a multiple of 8", i, size)
		}
		g := make([]int64, size/8)
		for k := 0; k < len(g); {
			c := min(len(g)-k, blockChunk)
			if err := dec.ReadFull(buf[:8*c]); err != nil {
				return err
			}
			for j := range c {
				g[k+j] = int64(binary.LittleEndian.Uint64(buf[8*j:]))
			}
			k += c
		}
		out = append(out, g)
	}
	*b = out
	return nil
}

// blockChunk is how many block ids the codec above converts at a time, in
// a scratch buffer from blockScratch.
const blockChunk = 512

var blockScratch = sync.Pool{New: func() any {
	b := make([]byte, 8*blockChunk)
	return &b
}}
