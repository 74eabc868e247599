package kvwire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"slices"
)

// Finished is what a worker's get_finished reports for one step.
type Finished struct {
	Sending []string `json:"finished_sending"`
	Recving []string `json:"finished_recving"`
	Failed  []string `json:"failed_recving"`
	// Reshape lists, by request, the blocks of a finished READ from a
	// prefill of a smaller block size: the Python connector puts their
	// tokens in this engine's order before vLLM computes from them.
	Reshape map[string][]BlockReshape `json:"reshape,omitempty"`
	// LoadErrorsPending and StatsPending say whether LoadErrors and Stats
	// have something to return: the Python connector calls them only
	// then, instead of twice more every step.
	LoadErrorsPending bool `json:"load_errors_pending,omitempty"`
	StatsPending      bool `json:"stats_pending,omitempty"`
	// PushArrivalsPending says whether PushArrivals has something to
	// return (push mode, a prefill: decode registrations that arrived).
	PushArrivalsPending bool `json:"push_arrivals_pending,omitempty"`
	// DigestsPending says whether the digests of held blocks taken off
	// vLLM's thread are ready (a bidirectional decode's read-back holds).
	DigestsPending bool `json:"digests_pending,omitempty"`
}

// BlockReshape is one request's blocks of one KV-cache group read at a
// smaller remote block size: each local block received Ratio remote blocks
// one after another (its sub-blocks); Covered is how many sub-blocks of
// Blocks, in order, were written (the tail of the last block past it holds
// no prompt token and is zeroed, as vLLM does).
type BlockReshape struct {
	Ratio   int     `json:"ratio"`
	Blocks  []int64 `json:"blocks"`
	Covered int     `json:"covered"`
}

// FinishedVersion is the version of the binary form (AppendFinished).
const FinishedVersion = 1

// The flags word of the binary form.
const (
	FinishedLoadErrorsPending   = 1 << 0
	FinishedStatsPending        = 1 << 1
	FinishedPushArrivalsPending = 1 << 2
	FinishedDigestsPending      = 1 << 3
)

// Empty reports whether f carries no request.
func (f *Finished) Empty() bool {
	return len(f.Sending) == 0 && len(f.Recving) == 0 && len(f.Failed) == 0 && len(f.Reshape) == 0
}

// AppendFinished appends f's binary form to dst: what crosses the C ABI
// every engine step (gonixl_worker_get_finished), read by the Python
// connector with struct.unpack_from and no JSON. Little-endian:
//
//	u32 version (FinishedVersion), u32 flags,
//	u32 #sending, u32 #recving, u32 #failed, u32 #reshape,
//	the request ids of sending, recving, failed: u32 length, bytes,
//	per reshaped request: u32 id length, id bytes, u32 #groups,
//	  per group: u32 ratio, u32 covered, u32 #blocks, #blocks x i64.
//
// A step with nothing to report is 24 bytes.
func AppendFinished(dst []byte, f *Finished) []byte {
	le := binary.LittleEndian
	var flags uint32
	if f.LoadErrorsPending {
		flags |= FinishedLoadErrorsPending
	}
	if f.StatsPending {
		flags |= FinishedStatsPending
	}
	if f.PushArrivalsPending {
		flags |= FinishedPushArrivalsPending
	}
	if f.DigestsPending {
		flags |= FinishedDigestsPending
	}
	dst = le.AppendUint32(dst, FinishedVersion)
	dst = le.AppendUint32(dst, flags)
	for _, n := range []int{len(f.Sending), len(f.Recving), len(f.Failed), len(f.Reshape)} {
		dst = le.AppendUint32(dst, uint32(n))
	}
	str := func(s string) {
		dst = le.AppendUint32(dst, uint32(len(s)))
		dst = append(dst, s...)
	}
	for _, ids := range [][]string{f.Sending, f.Recving, f.Failed} {
		for _, id := range ids {
			str(id)
		}
	}
	for _, id := range slices.Sorted(maps.Keys(f.Reshape)) {
		groups := f.Reshape[id]
		str(id)
		dst = le.AppendUint32(dst, uint32(len(groups)))
		for _, g := range groups {
			dst = le.AppendUint32(dst, uint32(g.Ratio))
			dst = le.AppendUint32(dst, uint32(g.Covered))
			dst = le.AppendUint32(dst, uint32(len(g.Blocks)))
			for _, b := range g.Blocks {
				dst = le.AppendUint64(dst, uint64(b))
			}
		}
	}
	return dst
}

// FinishedSize is the length of f's binary form: a buffer of that
// capacity takes AppendFinished without growing.
func FinishedSize(f *Finished) int {
	n := 24
	for _, ids := range [][]string{f.Sending, f.Recving, f.Failed} {
		for _, id := range ids {
			n += 4 + len(id)
		}
	}
	for id, groups := range f.Reshape {
		n += 8 + len(id)
		for _, g := range groups {
			n += 12 + 8*len(g.Blocks)
		}
	}
	return n
}

var errFinishedShort = errors.New("finished: truncated")

// DecodeFinished reads AppendFinished's form (tests and tools; the Python
// connector has its own reader). Every count is checked against the bytes
// left before anything is allocated.
func DecodeFinished(b []byte) (*Finished, error) {
	le := binary.LittleEndian
	off := 0
	u32 := func() (uint32, error) {
		if len(b)-off < 4 {
			return 0, errFinishedShort
		}
		v := le.Uint32(b[off:])
		off += 4
		return v, nil
	}
	str := func() (string, error) {
		n, err := u32()
		if err != nil {
			return "", err
		}
		if uint64(len(b)-off) < uint64(n) {
			return "", errFinishedShort
		}
		s := string(b[off : off+int(n)])
		off += int(n)
		return s, nil
	}
	var head [6]uint32
	for i := range head {
		v, err := u32()
		if err != nil {
			return nil, err
		}
		head[i] = v
	}
	if head[0] != FinishedVersion {
		return nil, fmt.Errorf("finished: version %d, want %d", head[0], FinishedVersion)
	}
	if head[1]&^(FinishedLoadErrorsPending|FinishedStatsPending|FinishedPushArrivalsPending|FinishedDigestsPending) != 0 {
		return nil, fmt.Errorf("finished: unknown flags %#x", head[1])
	}
	if uint64(head[2])+uint64(head[3])+uint64(head[4])+uint64(head[5]) > uint64(len(b)-off)/4 {
		return nil, errFinishedShort
	}
	f := &Finished{LoadErrorsPending: head[1]&FinishedLoadErrorsPending != 0, StatsPending: head[1]&FinishedStatsPending != 0,
		PushArrivalsPending: head[1]&FinishedPushArrivalsPending != 0, DigestsPending: head[1]&FinishedDigestsPending != 0}
	for i, dst := range []*[]string{&f.Sending, &f.Recving, &f.Failed} {
		*dst = make([]string, 0, head[2+i])
		for range head[2+i] {
			s, err := str()
			if err != nil {
				return nil, err
			}
			*dst = append(*dst, s)
		}
	}
	if head[5] > 0 {
		f.Reshape = make(map[string][]BlockReshape, head[5])
	}
	for range head[5] {
		id, err := str()
		if err != nil {
			return nil, err
		}
		ng, err := u32()
		if err != nil {
			return nil, err
		}
		if uint64(ng) > uint64(len(b)-off)/12 {
			return nil, errFinishedShort
		}
		groups := make([]BlockReshape, 0, ng)
		for range ng {
			var g [3]uint32
			for i := range g {
				if g[i], err = u32(); err != nil {
					return nil, err
				}
			}
			if uint64(g[2]) > uint64(len(b)-off)/8 {
				return nil, errFinishedShort
			}
			blocks := make([]int64, g[2])
			for i := range blocks {
				blocks[i] = int64(le.Uint64(b[off:]))
				off += 8
			}
			groups = append(groups, BlockReshape{Ratio: int(g[0]), Covered: int(g[1]), Blocks: blocks})
		}
		f.Reshape[id] = groups
	}
	if off != len(b) {
		return nil, fmt.Errorf("finished: %d bytes after the value", len(b)-off)
	}
	return f, nil
}
