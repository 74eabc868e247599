package shim

import (
	"encoding/json"
	"os"
	"slices"
	"testing"
)

// TestPlanTPMatchesVLLM checks planTP against vLLM's own TP-mapping code,
// evaluated by tests/fixtures/tp/gen_tp_mapping_golden.py for every
// combination of TP 1/2/4/8 on each side, 1–16 KV heads and MLA.
func TestPlanTPMatchesVLLM(t *testing.T) {
	b, err := os.ReadFile("testdata/tp_mapping_golden.json")
	if err != nil {
		t.Fatal(err)
	}
	var raw struct {
		Version string           `json:"vllm_version"`
		Cases   []map[string]any `json:"cases"`
	}
	if err := json.Unmarshal(b, &raw); err != nil {
		t.Fatal(err)
	}
	if len(raw.Cases) < 300 {
		t.Fatalf("golden file has %d cases", len(raw.Cases))
	}
	ints := func(v any) []int {
		var out []int
		for _, x := range v.([]any) {
			out = append(out, int(x.(float64)))
		}
		return out
	}
	for _, c := range raw.Cases {
		lt, lr, rt, h := int(c["local_tp"].(float64)), int(c["local_rank"].(float64)), int(c["remote_tp"].(float64)), int(c["kv_heads"].(float64))
		mla := c["mla"].(bool)
		p, err := planTP(lr, lt, rt, h, mla)
		if err != nil {
			t.Errorf("local %d/%d remote %d heads %d mla %v: %v", lr, lt, rt, h, mla, err)
			continue
		}
		name := p.String()
		if p.ratio != int(c["tp_ratio"].(float64)) {
			t.Errorf("%s: ratio, vLLM %v", name, c["tp_ratio"])
		}
		if !slices.Equal(p.targets, ints(c["handshake_targets"])) {
			t.Errorf("%s: targets, vLLM %v", name, c["handshake_targets"])
		}
		if !slices.Equal(p.sources, ints(c["source_order"])) {
			t.Errorf("%s: sources, vLLM %v", name, c["source_order"])
		}
		if p.consumers != int(c["local_consumers"].(float64)) {
			t.Errorf("%s: consumers, vLLM %v", name, c["local_consumers"])
		}
		// vLLM's offset factor is only used for local TP > remote TP.
		if p.ratio > 1 && p.offsetFactor != int(c["rank_offset_factor"].(float64)) {
			t.Errorf("%s: offset factor, vLLM %v", name, c["rank_offset_factor"])
		}
	}
	t.Logf("%d cases from vLLM %s", len(raw.Cases), raw.Version)
}

// TestPlanTPSlices checks the byte geometry of the reads: every local byte
// of a block is written exactly once, from the remote rank that holds that
// head, at the right place — for a model whose KV heads are laid out
// [heads, tokens, dim] in a block.
func TestPlanTPSlices(t *testing.T) {
	const headBytes = 64
	for _, lt := range []int{1, 2, 4, 8} {
		for _, rt := range []int{1, 2, 4, 8} {
			for _, h := range []int{1, 2, 4, 8} {
				localHeads, remoteHeads := max(1, h/lt), max(1, h/rt)
				localLen := uint64(localHeads * headBytes)
				for r := 0; r < lt; r++ {
					p, err := planTP(r, lt, rt, h, false)
					if err != nil {
						t.Fatal(err)
					}
					rlen, err := p.remoteBlockLen(localLen)
					if err != nil {
						t.Fatalf("%s: %v", p, err)
					}
					if rlen != uint64(remoteHeads*headBytes) {
						t.Fatalf("%s: remote block length %d, want %d", p, rlen, remoteHeads*headBytes)
					}
					// Which global head each local byte must hold.
					wantHead := func(localByte uint64) int {
						if lt > h {
							return r * h / lt
						}
						return r*localHeads + int(localByte)/headBytes
					}
					off, n := p.readSlice(localLen)
					written := make([]int, localLen)
					for i, src := range p.sources {
						if !p.isTarget(src) {
							t.Fatalf("%s: reads %d, not a handshake target", p, src)
						}
						for k := uint64(0); k < n; k++ {
							rb := off + k // byte in the remote block
							if rb >= rlen {
								t.Fatalf("%s: reads beyond the remote block (%d >= %d)", p, rb, rlen)
							}
							var remoteHead int
							if rt > h {
								remoteHead = src * h / rt
							} else {
								remoteHead = src*remoteHeads + int(rb)/headBytes
							}
							lb := uint64(i)*n + k
							if lb >= localLen {
								t.Fatalf("%s: writes beyond the local block", p)
							}
							written[lb]++
							if remoteHead != wantHead(lb) {
								t.Fatalf("%s: local byte %d gets head %d, want %d", p, lb, remoteHead, wantHead(lb))
							}
						}
					}
					for b, c := range written {
						if c != 1 {
							t.Fatalf("%s: local byte %d written %d times", p, b, c)
						}
					}
				}
			}
		}
	}
}

func TestPlanTPRefusals(t *testing.T) {
	for _, c := range []struct{ lr, lt, rt, h int }{
		{0, 2, 3, 4},  // not divisible
		{0, 3, 2, 4},  // not divisible
		{2, 2, 2, 4},  // rank out of range
		{0, 1, 2, 0},  // heads unknown with heterogeneous TP
		{0, 0, 1, 1},  // bad local TP
		{0, 1, -1, 1}, // bad remote TP
	} {
		if _, err := planTP(c.lr, c.lt, c.rt, c.h, false); err == nil {
			t.Errorf("%+v: no error", c)
		}
	}
	if _, err := planTP(0, 2, 2, 0, false); err != nil {
		t.Errorf("same TP with unknown heads: %v", err)
	}
}

// samePlan is the mapping of a TP = 1 worker onto a TP = 1 engine.
func samePlan() tpPlan {
	p, err := planTP(0, 1, 1, 2, false)
	if err != nil {
		panic(err)
	}
	return p
}
