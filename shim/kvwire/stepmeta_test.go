package kvwire

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"reflect"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

// stepMetaOf is a step with n requests to read, n held for readers and
// one heartbeat target.
func stepMetaOf(n int) *StepMeta {
	m := &StepMeta{ReqsToRecv: map[string]*RecvReq{}, ReqsToSend: map[string]float64{}, SchedulerClock: 12345.678,
		Heartbeats: map[string]*HeartbeatInfo{}}
	hb := &HeartbeatInfo{Expiry: map[string]float64{}, Host: "10.0.0.7", Port: 5600, TPSize: 1, DCPSize: 1, PPSize: 1}
	for i := 0; i < n; i++ {
		exp := 12345.678 + 480
		local, remote := make([]int64, 48), make([]int64, 48)
		for k := range local {
			local[k], remote[k] = int64(i*48+k), int64(9000+i*48+k)
		}
		id := fmt.Sprintf("cmpl-%032x-0-%08x", i, i)
		rr := &RecvReq{LocalBlockIDs: BlockIDs{local}, LocalNumComputed: []int64{0}, TPSize: 1, DCPSize: 1, PPSize: 1, AwaitingKVs: true,
			Remote: RemoteMeta{BlockIDs: BlockIDs{remote}, Host: "10.0.0.7", Port: 5600, EngineID: "engine-p", RequestID: id + "-p", Expiry: &exp, NumTokens: 48 * 16}}
		m.ReqsToRecv[id] = rr
		hb.ReqIDs = append(hb.ReqIDs, rr.Remote.RequestID)
		hb.Expiry[rr.Remote.RequestID] = exp
		sid := fmt.Sprintf("send-%d", i)
		m.ReqsToSend[sid] = 12345.678 + 480
		m.ReqsInBatch = append(m.ReqsInBatch, sid)
	}
	m.Heartbeats["engine-p"] = hb
	return m
}

// refBlockIDs encodes block ids as BlockIDs.EncodeMsgpack first did (a
// buffer made per group).
type refBlockIDs BlockIDs

func (b refBlockIDs) EncodeMsgpack(enc *msgpack.Encoder) error {
	if b == nil {
		return enc.EncodeNil()
	}
	if err := enc.EncodeArrayLen(len(b)); err != nil {
		return err
	}
	for _, g := range b {
		buf := make([]byte, 8*len(g))
		for i, v := range g {
			binary.LittleEndian.PutUint64(buf[8*i:], uint64(v))
		}
		if err := enc.EncodeBytes(buf); err != nil {
			return err
		}
	}
	return nil
}

// The block ids' codec (chunked through a scratch buffer) writes the bytes
// the per-group buffer wrote, and reads them back, around chunk sizes.
func TestBlockIDsCodecMatchesReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(19, 3))
	for _, sizes := range [][]int{nil, {}, {0}, {1}, {blockChunk - 1, blockChunk, blockChunk + 1}, {3 * blockChunk, 0, 7}, {65536}} {
		var ids BlockIDs
		if sizes != nil {
			ids = BlockIDs{}
		}
		for _, n := range sizes {
			g := make([]int64, n)
			for k := range g {
				g[k] = rng.Int64() >> rng.IntN(64)
			}
			ids = append(ids, g)
		}
		got, err := msgpack.Marshal(ids)
		if err != nil {
			t.Fatal(err)
		}
		want, err := msgpack.Marshal(refBlockIDs(ids))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("groups of %v: encodings differ", sizes)
		}
		var back BlockIDs
		if err := msgpack.Unmarshal(got, &back); err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(back, ids) {
			t.Fatalf("groups of %v: decoded %v", sizes, back)
		}
	}
}

// Encode (a buffer sized up front) writes msgpack.Marshal's bytes, and its
// size hint covers a typical step.
func TestStepMetaEncodeMatchesMarshal(t *testing.T) {
	for _, n := range []int{0, 1, 32, 256} {
		m := stepMetaOf(n)
		m.ReqsNotProcessed, m.PushAborted = []string{"x"}, []string{"y"}
		m.PushFinished = map[string]*PushFinished{"z": {Blocks: BlockIDs{{1, 2}}, PromptDigest: "d"}}
		got, err := m.Encode()
		if err != nil {
			t.Fatal(err)
		}
		want, err := msgpack.Marshal(&StepEnvelope{Version: StepMetaVersion, Meta: m})
		if err != nil {
			t.Fatal(err)
		}
		// Maps are written in Go's iteration order: byte for byte with one
		// entry each, else the same length and the same decoded metadata.
		if (n <= 1 && !bytes.Equal(got, want)) || len(got) != len(want) {
			t.Fatalf("%d requests: Encode differs from msgpack.Marshal", n)
		}
		back, err := DecodeStepMeta(got)
		if err != nil {
			t.Fatal(err)
		}
		ref, err := DecodeStepMeta(want)
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(back, ref) {
			t.Fatalf("%d requests: decoded %+v, want %+v", n, back, ref)
		}
		if h := m.sizeHint(); h < len(got) {
			t.Errorf("%d requests: size hint %d < %d bytes", n, h, len(got))
		}
	}
}

// A step whose maps hold nil entries (the scheduler's order naming a
// request no longer in its map) encodes as msgpack.Marshal did: nil
// values, dropped by the worker. sizeHint once dereferenced them.
func TestStepMetaEncodeNilEntries(t *testing.T) {
	m := &StepMeta{
		ReqsToRecv:   map[string]*RecvReq{"gone": nil},
		ReqsToSend:   map[string]float64{},
		Heartbeats:   map[string]*HeartbeatInfo{"e": nil},
		PushFinished: map[string]*PushFinished{"p": nil},
	}
	b, err := m.Encode()
	if err != nil {
		t.Fatal(err)
	}
	old, err := msgpack.Marshal(&StepEnvelope{Version: StepMetaVersion, Meta: m})
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(b, old) {
		t.Fatalf("encoding differs from msgpack.Marshal's:\n%x\n%x", b, old)
	}
	got, err := DecodeStepMeta(b)
	if err != nil {
		t.Fatal(err)
	}
	if len(got.ReqsToRecv) != 0 || len(got.PushFinished) != 0 {
		t.Fatalf("nil entries survived decoding: %+v", got)
	}
}
