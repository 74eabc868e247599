package sidechannel

import "testing"

func baseFactors() CompatFactors {
	return CompatFactors{VLLMVersion: "0.32.0", Model: "Qwen/Qwen3-0.6B", DType: "torch.bfloat16",
		NumKVHeads: 8, HeadSize: 128, NumHiddenLayers: 28, AttnBackendName: "CPU_ATTN", CacheDType: "auto",
		IsHMAEnabled: true}
}

// The expected digests come from vllm.config.utils.hash_factors (vLLM 0.32)
// applied to the dictionary compute_nixl_compatibility_hash builds.
func TestCompatibilityHashMatchesVLLM(t *testing.T) {
	main := "main"
	for _, tc := range []struct {
		description string
		edit        func(*CompatFactors)
		want        string
	}{
		{"plain pull engine", func(*CompatFactors) {}, "95eb740ee4a431d32afa26728aa02fee7cd769db0126b3e217e7e10c14c5aaad"},
		{"explicit defaults and the stock engine kind", func(f *CompatFactors) {
			f.ConnectorVersion, f.TransferMode, f.TransferEngine = 14, "pull", StockTransferEngine
		}, "95eb740ee4a431d32afa26728aa02fee7cd769db0126b3e217e7e10c14c5aaad"},
		{"escapes and speculative config", func(f *CompatFactors) {
			f.Model = "/models/é\"\\\n\t\x01\x7f😀"
			f.Speculative = &SpeculativeFactors{Method: "eagle3", Model: "d", CodeRevision: &main,
				KVCacheDType: "auto", AuxiliaryLayerIDs: []int{1, 2, 3}}
		}, "ee96447b9cff73c22e84c54219efc8371a8bbe674b75fa70c946b21875db214f"},
		{"non-NIXL engine kind joins the factors", func(f *CompatFactors) {
			f.TransferEngine, f.TransferMode, f.IsHMAEnabled = "ucx", "push", false
		}, "2609ac88118b2e64b797eb079443757b914a04915f868189d79370649fccae69"},
	} {
		f := baseFactors()
		tc.edit(&f)
		got, err := CompatibilityHash(&f)
		if err != nil || got != tc.want {
			t.Errorf("%s: got %s, %v; want %s", tc.description, got, err, tc.want)
		}
	}
}

func TestPythonJSON(t *testing.T) {
	got, err := PythonJSON(map[string]any{"b": []any{1, nil, true}, "a": map[string]any{}, "é": []int{}, "c": "\u2028"})
	want := `{"a": {}, "b": [1, null, true], "c": "\u2028", "\u00e9": []}`
	if err != nil || got != want {
		t.Errorf("got %s, %v; want %s", got, err, want)
	}
	if _, err := PythonJSON(map[string]any{"x": string([]byte{0xff})}); err == nil {
		t.Error("invalid UTF-8 accepted")
	}
	if _, err := PythonJSON(map[string]any{"x": 1.5}); err == nil {
		t.Error("float accepted")
	}
}

func TestHashFactorsJSON(t *testing.T) {
	f := baseFactors()
	js := `{"vllm_version": "0.32.0", "nixl_connector_version": 14, "model": "Qwen/Qwen3-0.6B", "dtype": "torch.bfloat16",
		"num_kv_heads": 8, "head_size": 128, "num_hidden_layers": 28, "attn_backend_name": "CPU_ATTN", "cache_dtype": "auto",
		"is_hma_enabled": true, "speculative_config": null, "transfer_mode": "pull"}`
	want, _ := CompatibilityHash(&f)
	for _, kind := range []string{"", "nixl"} {
		if got, err := HashFactorsJSON([]byte(js), kind); err != nil || got != want {
			t.Errorf("kind %q: got %s, %v; want %s", kind, got, err, want)
		}
	}
	f.TransferEngine = "ucx"
	want, _ = CompatibilityHash(&f)
	if got, err := HashFactorsJSON([]byte(js), "ucx"); err != nil || got != want {
		t.Errorf("kind ucx: got %s, %v; want %s", got, err, want)
	}
	for _, bad := range []string{`[1]`, `{"a": 1.5}`, `{"a": 1} {}`, `{`} {
		if _, err := HashFactorsJSON([]byte(bad), ""); err == nil {
			t.Errorf("%s accepted", bad)
		}
	}
}

// EngineFactors is the rule in one place: the transfer-engine factor only
// off NIXL, and the caller's map left alone.
func TestEngineFactors(t *testing.T) {
	m := map[string]any{"model": "m"}
	got := EngineFactors(m, "ucx")
	if got[TransferEngineFactor] != "ucx" || len(got) != 2 || len(m) != 1 {
		t.Fatalf("ucx: %v (input %v)", got, m)
	}
	for _, e := range []string{"", StockTransferEngine} {
		if _, ok := EngineFactors(m, e)[TransferEngineFactor]; ok {
			t.Fatalf("engine %q got the transfer-engine factor", e)
		}
	}
	a, _ := HashFactorsJSON([]byte(`{"model": "m"}`), "ucx")
	b, _ := HashFactors(EngineFactors(m, "ucx"))
	if a != b {
		t.Fatalf("HashFactorsJSON %s, EngineFactors %s", a, b)
	}
}
