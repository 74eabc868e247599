package sidechannel

import (
	"fmt"
	"strings"
	"testing"
)

// metadata80L is the NixlAgentMetadata a gonixl worker of a large model
// serves (80 layers, K and V: 160 regions of 10,000 blocks of 16 tokens ×
// 8 heads × 128 bfloat16), with the per-region fields vLLM's pull worker
// fills, gonixl's geometry, and a 32 KiB transfer-engine blob (NIXL's UCX
// metadata for 160 registrations is of that order).
func metadata80L() *AgentMetadata {
	const regions, blocks, blockLen = 160, 10000, 16 * 8 * 128 * 2
	m := NewAgentMetadata()
	m.EngineID = "3f6c2a58-6d0e-4d8e-9b1a-7a1f0c2e9d41"
	m.AgentMetadata = make([]byte, 32<<10)
	for i := range m.AgentMetadata {
		m.AgentMetadata[i] = byte(i * 131)
	}
	m.DeviceID, m.NumBlocks = 0, blocks
	m.KVCacheLayout, m.BlockSize, m.AttnBackendName = "HND", 16, "FLASH_ATTN"
	m.PhysicalBlocksPerLogicalKVBlock = 1
	kinds := make([]string, regions)
	for r := 0; r < regions; r++ {
		m.KVCachesBaseAddr = append(m.KVCachesBaseAddr, 0x7f3a00000000+uint64(r)*(blocks*blockLen+4096))
		m.BlockLens = append(m.BlockLens, blockLen)
		m.BlockStrides = append(m.BlockStrides, blockLen)
		m.RegionNumBlocks = append(m.RegionNumBlocks, blocks)
		m.RegionGroupIDs = append(m.RegionGroupIDs, 0)
		m.RegionNames = append(m.RegionNames, fmt.Sprintf("model.layers.%d.self_attn.attn", r/2))
		m.RegionMemTypes = append(m.RegionMemTypes, "VRAM")
		kinds[r] = `"full"`
	}
	m.Geometry = `{"model":"meta-llama/Llama-3.1-70B-Instruct","dtype":"torch.bfloat16","num_kv_heads":8,"tp_size":1,"pp_size":1,"region_kinds":[` +
		strings.Join(kinds, ",") + `]}`
	return m
}

// BenchmarkHandshake80L: a decode's work on one rank's handshake answer for
// the large model (DecodeHandshakePayload, then DecodeAgentMetadata, as
// Client.Handshake does), and the prefill's encoding of it.
//
//	go test -run '^$' -bench Handshake80L -benchmem ./sidechannel/
func BenchmarkHandshake80L(b *testing.B) {
	m := metadata80L()
	payload := (&HandshakePayload{CompatibilityHash: strings.Repeat("ab", 32), AgentMetadataBytes: m.Encode()}).Encode()
	b.Run("decode", func(b *testing.B) {
		b.ReportAllocs()
		b.SetBytes(int64(len(payload)))
		for b.Loop() {
			p, err := DecodeHandshakePayload(payload)
			if err != nil {
				b.Fatal(err)
			}
			if _, err := DecodeAgentMetadata(p.AgentMetadataBytes); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("encode", func(b *testing.B) {
		b.ReportAllocs()
		b.SetBytes(int64(len(payload)))
		for b.Loop() {
			_ = (&HandshakePayload{CompatibilityHash: strings.Repeat("ab", 32), AgentMetadataBytes: m.Encode()}).Encode()
		}
	})
}
