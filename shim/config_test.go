package shim

import (
	"strings"
	"testing"
)

// kv_buffer_device: vLLM's KVTransferConfig accepts any string (its
// NixlConnector worker checks it), so gonixl checks the value at config
// time and the placement at register_kv_caches (TestKVBufferDevicePlacement).
func TestConfigKVBufferDevice(t *testing.T) {
	for _, ok := range []string{``, `,"kv_buffer_device":"cpu"`, `,"kv_buffer_device":"cuda"`, `,"kv_buffer_device":"xpu"`, `,"kv_buffer_device":"hpu"`} {
		c, err := ParseConfig([]byte(`{"role":"scheduler","kv_role":"kv_producer","engine_id":"e"` + ok + `}`))
		if err != nil {
			t.Errorf("%q refused: %v", ok, err)
			continue
		}
		if ok == `` && c.KVBufferDevice != "" {
			t.Errorf("unset kv_buffer_device became %q (it must mean: where the KV cache is)", c.KVBufferDevice)
		}
	}
	for _, bad := range []string{"tpu", "gpu", "CUDA", "cuda:0"} {
		_, err := ParseConfig([]byte(`{"role":"worker","kv_role":"kv_consumer","engine_id":"e","kv_buffer_device":"` + bad + `"}`))
		if err == nil || !strings.Contains(err.Error(), "kv_buffer_device") || !strings.Contains(err.Error(), bad) {
			t.Errorf("kv_buffer_device %q: %v", bad, err)
		}
	}
}

// enable_permute_local_kv is accepted at config time (see
// TestEnablePermuteLocalKVAcceptedAndLogged for why).
func TestConfigEnablePermuteLocalKV(t *testing.T) {
	c, err := ParseConfig([]byte(`{"role":"worker","kv_role":"kv_consumer","engine_id":"e","enable_permute_local_kv":true}`))
	if err != nil || !c.EnablePermuteLocalKV {
		t.Fatalf("%v %+v", err, c)
	}
}

// engine_ttl: vLLM's default 3600 s, numbers as strings, <= 0 disables
// eviction; NaN (which would silently never evict) is refused.
func TestConfigEngineTTL(t *testing.T) {
	for in, want := range map[string]float64{``: 3600, `"engine_ttl":120`: 120, `"engine_ttl":"0.5"`: 0.5, `"engine_ttl":0`: 0, `"engine_ttl":-1`: -1} {
		c, err := ParseConfig([]byte(`{"role":"worker","kv_role":"kv_consumer","engine_id":"e","kv_connector_extra_config":{` + in + `}}`))
		if err != nil {
			t.Errorf("%s: %v", in, err)
		} else if c.EngineTTL != want {
			t.Errorf("%s: engine_ttl %v, want %v", in, c.EngineTTL, want)
		}
	}
	for _, bad := range []string{`"NaN"`, `"soon"`, `true`} {
		_, err := ParseConfig([]byte(`{"role":"worker","kv_role":"kv_consumer","engine_id":"e","kv_connector_extra_config":{"engine_ttl":` + bad + `}}`))
		if err == nil || !strings.Contains(err.Error(), "engine_ttl") {
			t.Errorf("engine_ttl %s: %v", bad, err)
		}
	}
}

// Booleans of kv_connector_extra_config are read as the Python connector
// reads them (pybridge/gonixl/vllm.py _extra_bool): the two sides must
// agree on the mode (a decode's request_finished is batched only when
// Python sees bidirectional transfer off, and the library refuses a batched
// one when it sees it on). Numbers by value: 0.0 is false.
func TestConfigExtraBool(t *testing.T) {
	for in, want := range map[string]bool{
		``: false, `true`: true, `false`: false, `"yes"`: true, `"On"`: true, `" true "`: true, `"0"`: false,
		`"off"`: false, `""`: false, `1`: true, `0`: false, `0.0`: false, `2`: true, `-0.0`: false, `null`: false,
	} {
		extra := ``
		if in != `` {
			extra = `"bidirectional_kv_xfer":` + in
		}
		c, err := ParseConfig([]byte(`{"role":"scheduler","kv_role":"kv_consumer","engine_id":"e","kv_connector_extra_config":{` + extra + `}}`))
		if err != nil {
			t.Errorf("%s: %v", in, err)
			continue
		}
		if c.BidirectionalKVXfer != want {
			t.Errorf("bidirectional_kv_xfer %s: %v, want %v", in, c.BidirectionalKVXfer, want)
		}
	}
	for _, bad := range []string{`"maybe"`, `[]`, `{}`} {
		if _, err := ParseConfig([]byte(`{"role":"scheduler","kv_role":"kv_consumer","engine_id":"e","kv_connector_extra_config":{"bidirectional_kv_xfer":` + bad + `}}`)); err == nil {
			t.Errorf("bidirectional_kv_xfer %s: accepted", bad)
		}
	}
}
