package sidechannel

import (
	"bytes"
	"encoding/hex"
	"errors"
	"os"
	"reflect"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

func i64(v int64) *int64 { return &v }

// fullMetadata mirrors the NixlAgentMetadata built in the Python script that
// produced testdata/golden/agent_metadata_full.hex with vLLM's own encoder.
func fullMetadata() *AgentMetadata {
	blob := make([]byte, 512)
	for i := range blob {
		blob[i] = byte(i)
	}
	return &AgentMetadata{
		EngineID: "prefill-0", AgentMetadata: blob,
		KVCachesBaseAddr: []uint64{0x7f0000001000, 1<<63 + 5, 0},
		DeviceID:         3, NumBlocks: 70000,
		BlockLens:     []int64{4096, 128, 70000, 1 << 33},
		BlockStrides:  []int64{-1, -200, -40000, -(1 << 40), 0},
		KVCacheLayout: "NHD", BlockSize: 16, SSMSizes: [2]int64{5, 1 << 31},
		AttnBackendName:                 "FLASH_ATTN",
		PhysicalBlocksPerLogicalKVBlock: 2,
		RegionNumBlocks:                 []int64{10, 20},
		RegionGroupIDs:                  []int64{},
		RegionNames:                     []string{"a", strings.Repeat("ü", 20)},
		RegionMemTypes:                  []string{"VRAM", "DRAM"},
		DCPSize:                         2, PCPSize: 4, PLEBlockLen: i64(512),
		RegionMembers:       [][]string{{"l0", "l1"}, {}},
		PackedMemberLayouts: []PackedMemberLayout{{"z", 0, 64}, {"a", 64, 4096}},
	}
}

func minimalMetadata() *AgentMetadata {
	m := NewAgentMetadata()
	m.EngineID, m.AgentMetadata = "e", []byte{1, 2}
	m.KVCachesBaseAddr = []uint64{1, 300, 1 << 40}
	m.NumBlocks, m.BlockLens, m.BlockStrides = 10, []int64{4096}, []int64{-1}
	m.KVCacheLayout, m.BlockSize, m.AttnBackendName = "HND", 16, "CPU_ATTN"
	m.PhysicalBlocksPerLogicalKVBlock = 1
	return m
}

// Bytes produced by msgspec.msgpack.Encoder() from vLLM 0.32's own types.
const (
	minimalHex = "de0015a9656e67696e655f6964a165ae6167656e745f6d65746164617461c4020102b36b765f6361636865735f626173655f616464729301cd012ccf0000010000000000a96465766963655f696400aa6e756d5f626c6f636b730aaa626c6f636b5f6c656e7391cd1000ad626c6f636b5f7374726964657391ffaf6b765f63616368655f6c61796f7574a3484e44aa626c6f636b5f73697a6510a973736d5f73697a6573920000b16174746e5f6261636b656e645f6e616d65a84350555f4154544ed924706879736963616c5f626c6f636b735f7065725f6c6f676963616c5f6b765f626c6f636b01b1726567696f6e5f6e756d5f626c6f636b73c0b0726567696f6e5f67726f75705f696473c0ac726567696f6e5f6e616d6573c0b0726567696f6e5f6d656d5f7479706573c0a86463705f73697a6501a87063705f73697a6501ad706c655f626c6f636b5f6c656ec0ae726567696f6e5f6d656d6265727390b57061636b65645f6d656d6265725f6c61796f75747380"
	payloadHex = "82b2636f6d7061746962696c6974795f68617368a168b46167656e745f6d657461646174615f6279746573c40178"
	requestHex = "93c40c6765745f6d6574615f6d73670001"
)

func unhex(t testing.TB, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(strings.TrimSpace(s))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestGoldenEncodings(t *testing.T) {
	full, err := os.ReadFile("testdata/golden/agent_metadata_full.hex")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		description string
		got         []byte
		want        string
	}{
		{"NixlAgentMetadata with defaults", minimalMetadata().Encode(), minimalHex},
		{"NixlAgentMetadata with every field set", fullMetadata().Encode(), string(full)},
		{"NixlHandshakePayload", (&HandshakePayload{"h", []byte("x")}).Encode(), payloadHex},
		{"request (b'get_meta_msg', 0, 1)", EncodeRequest(Rank{PP: 0, TP: 1}), requestHex},
		{"clock 1.5", EncodeClock(1.5), "cb3ff8000000000000"},
	} {
		if want := unhex(t, tc.want); !bytes.Equal(tc.got, want) {
			t.Errorf("%s:\n got %x\nwant %x", tc.description, tc.got, want)
		}
	}
}

func TestAgentMetadataRoundTrip(t *testing.T) {
	empty := NewAgentMetadata()
	empty.AgentMetadata, empty.KVCachesBaseAddr, empty.BlockLens, empty.BlockStrides = []byte{}, []uint64{}, []int64{}, []int64{}
	big := minimalMetadata()
	big.AgentMetadata = bytes.Repeat([]byte{7}, 70000) // bin32
	big.BlockLens = make([]int64, 70000)               // array32
	big.EngineID = strings.Repeat("x", 70000)          // str32
	for _, tc := range []struct {
		description string
		m           *AgentMetadata
	}{
		{"defaults", minimalMetadata()},
		{"every field", fullMetadata()},
		{"empty containers", empty},
		{"32-bit lengths", big},
	} {
		got, err := DecodeAgentMetadata(tc.m.Encode())
		if err != nil {
			t.Fatalf("%s: %v", tc.description, err)
		}
		if !reflect.DeepEqual(got, tc.m) {
			t.Errorf("%s: round trip changed the value", tc.description)
		}
	}
}

// TestEncodingsReadByMsgpackLibrary cross-checks the hand-written encoder
// against an independent MessagePack implementation.
func TestEncodingsReadByMsgpackLibrary(t *testing.T) {
	var got map[string]any
	if err := msgpack.Unmarshal(fullMetadata().Encode(), &got); err != nil {
		t.Fatal(err)
	}
	for key, want := range map[string]any{
		"engine_id":     "prefill-0",
		"block_strides": []any{int8(-1), int16(-200), int32(-40000), int64(-(1 << 40)), int8(0)},
		"ssm_sizes":     []any{int8(5), uint32(1 << 31)},
		"ple_block_len": uint16(512),
		"region_names":  []any{"a", strings.Repeat("ü", 20)},
	} {
		if !reflect.DeepEqual(got[key], want) {
			t.Errorf("%s: got %#v, want %#v", key, got[key], want)
		}
	}
	if len(got) != 21 {
		t.Errorf("map has %d keys, want 21", len(got))
	}
}

// mp builds msgpack test input with the library encoder.
func mp(t *testing.T, v any) []byte {
	t.Helper()
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	enc.SetSortMapKeys(true)
	enc.UseCompactInts(true)
	if err := enc.Encode(v); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func metaMap(t *testing.T, edit func(map[string]any)) []byte {
	var m map[string]any
	if err := msgpack.Unmarshal(minimalMetadata().Encode(), &m); err != nil {
		t.Fatal(err)
	}
	edit(m)
	return mp(t, m)
}

// TestDecodeAgentMetadataStrictness follows msgspec's typed decoding, as
// observed with msgspec 0.22 and vLLM 0.32's NixlAgentMetadata.
func TestDecodeAgentMetadataStrictness(t *testing.T) {
	for _, tc := range []struct {
		description string
		edit        func(map[string]any)
		wantErr     string // "" means it must decode
	}{
		{"unknown keys are ignored", func(m map[string]any) { m["zzz"] = []any{1, map[string]any{"a": nil}} }, ""},
		{"fields with defaults may be absent", func(m map[string]any) {
			for _, k := range []string{"dcp_size", "pcp_size", "ple_block_len", "region_members", "packed_member_layouts", "region_names"} {
				delete(m, k)
			}
		}, ""},
		{"missing required field", func(m map[string]any) { delete(m, "ssm_sizes") }, "missing required field `ssm_sizes`"},
		{"float for int", func(m map[string]any) { m["device_id"] = 1.0 }, "expected `int`, got `float` - at `$.device_id`"},
		{"bool for int", func(m map[string]any) { m["device_id"] = true }, "expected `int`, got `bool`"},
		{"str for bytes", func(m map[string]any) { m["agent_metadata"] = "x" }, "expected `bytes`, got `str`"},
		{"bytes for str", func(m map[string]any) { m["engine_id"] = []byte("x") }, "expected `str`, got `bytes`"},
		{"tuple of wrong length", func(m map[string]any) { m["ssm_sizes"] = []any{1} }, "length 2, got 1"},
		{"None for tuple", func(m map[string]any) { m["ssm_sizes"] = nil }, "expected `array`, got `None`"},
		{"None for defaulted non-optional list", func(m map[string]any) { m["region_members"] = nil }, "at `$.region_members`"},
		{"None for optional list", func(m map[string]any) { m["region_names"] = nil }, ""},
		{"float inside a list", func(m map[string]any) { m["kv_caches_base_addr"] = []any{1.0} }, "at `$.kv_caches_base_addr[0]`"},
		{"negative address", func(m map[string]any) { m["kv_caches_base_addr"] = []any{-1} }, "negative"},
		{"int key in packed layouts", func(m map[string]any) {
			m["packed_member_layouts"] = map[int]any{1: []any{1, 2}}
		}, "expected `str`, got `int`"},
		{"int beyond int64", func(m map[string]any) { m["num_blocks"] = uint64(1 << 63) }, "does not fit in int64"},
	} {
		got, err := DecodeAgentMetadata(metaMap(t, tc.edit))
		switch {
		case tc.wantErr == "" && err != nil:
			t.Errorf("%s: unexpected error %v", tc.description, err)
		case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
			t.Errorf("%s: got error %v, want one containing %q", tc.description, err, tc.wantErr)
		case (err == nil) == (got == nil):
			t.Errorf("%s: value %v and error %v", tc.description, got, err)
		}
	}
}

func TestDecodeHandshakePayloadStrictness(t *testing.T) {
	enc := func(kv ...any) []byte { // ordered map
		var w mpWriter
		w.mapHeader(len(kv) / 2)
		for i := 0; i < len(kv); i += 2 {
			w.b = append(w.b, mp(t, kv[i])...)
			w.b = append(w.b, mp(t, kv[i+1])...)
		}
		return w.b
	}
	valid := (&HandshakePayload{"h", []byte("x")}).Encode()
	for _, tc := range []struct {
		description string
		in          []byte
		wantHash    string
		wantErr     string
	}{
		{"valid", valid, "h", ""},
		{"duplicate key: last wins", enc("compatibility_hash", "a", "compatibility_hash", "b", "agent_metadata_bytes", []byte{}), "b", ""},
		{"trailing bytes", append(append([]byte{}, valid...), 0), "", "trailing characters"},
		{"int key", enc(1, 2, "compatibility_hash", "a", "agent_metadata_bytes", []byte{}), "", "got `int`"},
		{"missing field", enc("compatibility_hash", "a"), "", "missing required field `agent_metadata_bytes`"},
		{"array instead of map", mp(t, []any{"h", []byte("x")}), "", "expected `object`, got `array`"},
		{"ext value", append(enc("compatibility_hash", "a")[:0:0], append([]byte{0x82}, append(mp(t, "compatibility_hash"), append(mp(t, "a"), append(mp(t, "agent_metadata_bytes"), 0xd4, 1, 2)...)...)...)...), "", "got `ext`"},
		{"nil for str", enc("compatibility_hash", nil, "agent_metadata_bytes", []byte{}), "", "got `None`"},
		{"invalid UTF-8 value", enc("compatibility_hash", string([]byte{0xff, 0xfe}), "agent_metadata_bytes", []byte{}), "", "UTF-8"},
		{"invalid UTF-8 in an unknown key is skipped", enc(string([]byte{0xff}), 1, "compatibility_hash", "a", "agent_metadata_bytes", []byte{}), "a", ""},
		{"invalid opcode", []byte{0xc1}, "", "invalid opcode"},
		{"empty input", nil, "", "truncated"},
		{"huge declared map", []byte{0xdf, 0xff, 0xff, 0xff, 0xff}, "", "truncated"},
	} {
		got, err := DecodeHandshakePayload(tc.in)
		if tc.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) || got != nil {
				t.Errorf("%s: got %v, %v; want error containing %q", tc.description, got, err, tc.wantErr)
			}
			var de *DecodeError
			if err != nil && !errors.As(err, &de) {
				t.Errorf("%s: error %T is not a *DecodeError", tc.description, err)
			}
			continue
		}
		if err != nil || got.CompatibilityHash != tc.wantHash {
			t.Errorf("%s: got %+v, %v; want hash %q", tc.description, got, err, tc.wantHash)
		}
	}
}

func TestRequestAndClock(t *testing.T) {
	for _, r := range []Rank{{0, 0}, {1, 7}, {3, 300}, {0, 70000}} {
		got, err := DecodeRequest(EncodeRequest(r))
		if err != nil || got.Rank != r || string(got.Tag) != GetMetaMsg {
			t.Errorf("rank %v: got %+v, %v", r, got, err)
		}
	}
	// A str tag is accepted (vLLM only warns about an unexpected tag).
	if got, err := DecodeRequest(mp(t, []any{"get_meta_msg", 1, 2})); err != nil || got.Rank != (Rank{1, 2}) {
		t.Errorf("str tag: %+v, %v", got, err)
	}
	for _, bad := range [][]byte{mp(t, []any{[]byte("get_meta_msg"), 1}), mp(t, []any{[]byte("x"), 1.0, 2}),
		mp(t, []any{[]byte("x"), 1, int64(1) << 40}), mp(t, map[string]any{}), nil} {
		if got, err := DecodeRequest(bad); err == nil || got != nil {
			t.Errorf("DecodeRequest(%x) = %+v, %v; want error", bad, got, err)
		}
	}
	for _, tc := range []struct {
		in   []byte
		want float64
	}{{EncodeClock(12345.678), 12345.678}, {mp(t, 7), 7}, {mp(t, -7), -7}, {[]byte{0xca, 0x3f, 0xc0, 0, 0}, 1.5}} {
		if got, err := DecodeClock(tc.in); err != nil || got != tc.want {
			t.Errorf("DecodeClock(%x) = %v, %v; want %v", tc.in, got, err, tc.want)
		}
	}
	if _, err := DecodeClock(mp(t, "1.5")); err == nil {
		t.Error("DecodeClock accepted a str")
	}
}

func TestRanksOrder(t *testing.T) {
	got := Ranks(2, 4, 5)
	want := []Rank{{0, 4}, {0, 5}, {1, 4}, {1, 5}}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Ranks = %v, want %v", got, want)
	}
}
