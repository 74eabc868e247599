package shim

import (
	"encoding/json"
	"fmt"
	"reflect"
	"testing"

	"github.com/gonixl/gonixl/shim/kvwire"
)

// benchParams is a pull decode's kv_transfer_params for n blocks, with the
// prefill's KV digests (one rank, 28 layer regions).
func benchParams(tb testing.TB, n int, seed uint64) []byte {
	tb.Helper()
	ids := make([]int64, n)
	blocks := make([]uint64, n)
	for i := range ids {
		ids[i] = int64(3 * i)
		blocks[i] = seed*1_000_003 + uint64(i)*0x9e3779b97f4a7c15
	}
	regions := make([]uint64, 28)
	for i := range regions {
		regions[i] = seed + uint64(i)
	}
	b, err := json.Marshal(map[string]any{
		"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "engine-p",
		"remote_request_id": fmt.Sprintf("cmpl-%d-0", seed), "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1,
		"remote_block_ids": [][]int64{ids}, "remote_num_tokens": 32 * n, "gonixl_prompt_digest": "0123456789abcdef",
		kvwire.KeyKVDigest: kvwire.KVDigest{Alg: kvwire.KVDigestAlg, Tokens: int64(32 * n), First: []int64{0},
			Ranks: []kvwire.RankDigest{{Blocks: [][]uint64{blocks}, Regions: [][]uint64{regions}}}},
	})
	if err != nil {
		tb.Fatal(err)
	}
	return b
}

// A parse served from the cache is the parse of the same bytes; other
// bytes get their own; errors are not kept; the cache stays bounded.
func TestParseTransferParamsCache(t *testing.T) {
	a, b := benchParams(t, 32, 1), benchParams(t, 32, 2)
	pa, err := ParseTransferParams(a)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := kvwire.ParseTransferParams(a)
	if !reflect.DeepEqual(pa, want) {
		t.Fatalf("parse %+v, want %+v", pa, want)
	}
	if again, _ := ParseTransferParams(append([]byte(nil), a...)); again != pa {
		t.Fatal("the same bytes were parsed again")
	}
	pb, _ := ParseTransferParams(b)
	if pb == pa || pb.RemoteRequestID != "cmpl-2-0" {
		t.Fatalf("other bytes got %+v", pb)
	}
	bad := []byte(`{"remote_port": "x"}`)
	for range 2 {
		if _, err := ParseTransferParams(bad); err == nil {
			t.Fatal("malformed params parsed")
		}
	}
	for i := range maxCachedParams + 10 {
		if _, err := ParseTransferParams(benchParams(t, 4, uint64(100+i))); err != nil {
			t.Fatal(err)
		}
	}
	parsedParams.mu.Lock()
	n, order, size := len(parsedParams.m), len(parsedParams.order), parsedParams.bytes
	parsedParams.mu.Unlock()
	if n > maxCachedParams || n != order || size > maxCachedParamsBytes {
		t.Fatalf("cache of %d entries (%d in order, %d bytes)", n, order, size)
	}
}

// BenchmarkParseTransferParams: a pull decode's params of 32 blocks with
// KV digests (1.4 KB), parsed (uncached) and served again (cached).
func BenchmarkParseTransferParams(b *testing.B) {
	data := benchParams(b, 32, 7)
	b.Run("uncached", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := kvwire.ParseTransferParams(data); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("cached", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := ParseTransferParams(data); err != nil {
				b.Fatal(err)
			}
		}
	})
}
