package kvwire

import (
	"bytes"
	"encoding/hex"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

// The registration's bytes are vLLM's: msgspec.msgpack.encode of the same
// dict (keys in vLLM's order), prefixed with PUSH_REG:. Produced with
// msgspec 0.19 from vLLM's requirements:
//
//	b"PUSH_REG:" + msgspec.msgpack.encode({"request_id": "cmpl-abc-0-1a2b3c4d",
//	  "decode_engine_id": "D", "decode_host": "10.0.0.2", "decode_port": 5600,
//	  "decode_tp_size": 1, "local_block_ids": ([3, 4, 70000], []),
//	  "remote_engine_id": "P", "remote_host": "10.0.0.1", "remote_port": 5601,
//	  "remote_tp_size": 1, "remote_pp_size": 1})
const vllmPushReg = "505553485f5245473a8baa726571756573745f6964b3636d706c2d6162632d302d3161326233633464b06465636f64655f656e67696e655f6964a144ab6465636f64655f686f7374a831302e302e302e32ab6465636f64655f706f7274cd15e0ae6465636f64655f74705f73697a6501af6c6f63616c5f626c6f636b5f69647392930304ce0001117090b072656d6f74655f656e67696e655f6964a150ab72656d6f74655f686f7374a831302e302e302e31ab72656d6f74655f706f7274cd15e1ae72656d6f74655f74705f73697a6501ae72656d6f74655f70705f73697a6501"

func TestPushRegistrationBytesAreVLLMs(t *testing.T) {
	reg := &PushReg{RequestID: "cmpl-abc-0-1a2b3c4d", DecodeEngineID: "D", DecodeHost: "10.0.0.2", DecodePort: 5600, DecodeTPSize: 1,
		LocalBlockIDs: BlockIDs{{3, 4, 70000}, {}}, RemoteEngineID: "P", RemoteHost: "10.0.0.1", RemotePort: 5601, RemoteTPSize: 1, RemotePPSize: 1}
	got, err := EncodePushReg(reg)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := hex.DecodeString(vllmPushReg)
	if !bytes.Equal(got, want) {
		t.Fatalf("registration bytes\n got %x\nwant %x", got, want)
	}
	back, err := DecodePushReg(want[len(PushRegPrefix):])
	if err != nil {
		t.Fatal(err)
	}
	if back.RequestID != reg.RequestID || back.DecodeEngineID != "D" || back.DecodeHost != "10.0.0.2" || back.DecodePort != 5600 ||
		back.DecodeTPSize != 1 || len(back.LocalBlockIDs) != 2 || back.LocalBlockIDs[0][2] != 70000 || len(back.LocalBlockIDs[1]) != 0 {
		t.Fatalf("decoded %+v", back)
	}
}

func TestPushRegistrationRefusesGarbage(t *testing.T) {
	good, _ := hex.DecodeString(vllmPushReg)
	body := good[len(PushRegPrefix):]
	cases := map[string][]byte{
		"empty":       nil,
		"not a map":   {0x93, 1, 2, 3},
		"truncated":   body[:len(body)-3],
		"wrong types": mustMsgpack(t, map[string]any{"request_id": 7, "decode_engine_id": "D", "decode_host": "h", "decode_port": 1, "decode_tp_size": 1, "local_block_ids": []any{}}),
		"bad port":    mustMsgpack(t, map[string]any{"request_id": "r", "decode_engine_id": "D", "decode_host": "h", "decode_port": 70000, "decode_tp_size": 1, "local_block_ids": []any{}}),
		"neg block":   mustMsgpack(t, map[string]any{"request_id": "r", "decode_engine_id": "D", "decode_host": "h", "decode_port": 1, "decode_tp_size": 1, "local_block_ids": []any{[]any{-1}}}),
		"no blocks":   mustMsgpack(t, map[string]any{"request_id": "r", "decode_engine_id": "D", "decode_host": "h", "decode_port": 1, "decode_tp_size": 1}),
	}
	for name, b := range cases {
		if _, err := DecodePushReg(b); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	// A flat list is one group, as vLLM accepts it.
	r, err := DecodePushReg(mustMsgpack(t, map[string]any{"request_id": "r", "decode_engine_id": "D", "decode_host": "h", "decode_port": 1, "decode_tp_size": 1, "local_block_ids": []any{5, 6}}))
	if err != nil || len(r.LocalBlockIDs) != 1 || r.LocalBlockIDs[0][1] != 6 {
		t.Fatalf("flat list: %+v %v", r, err)
	}
}

func TestBaseRequestID(t *testing.T) {
	for in, want := range map[string]string{
		"cmpl-x-0-1a2b3c4d":   "cmpl-x-0",
		"cmpl-x-0-1A2B3C4D":   "cmpl-x-0",
		"cmpl-x-0":            "cmpl-x-0",
		"cmpl-x-0-1a2b3c4":    "cmpl-x-0-1a2b3c4",
		"chatcmpl-y-deadbeef": "chatcmpl-y",
	} {
		if got := BaseRequestID(in); got != want {
			t.Errorf("BaseRequestID(%q) = %q, want %q", in, got, want)
		}
	}
}

func mustMsgpack(t testing.TB, v any) []byte {
	t.Helper()
	b, err := msgpack.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
