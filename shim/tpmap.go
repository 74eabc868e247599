// Tensor-parallel mapping between a decode worker and a prefill engine:
// which prefill ranks a decode rank handshakes with, which of them it reads,
// which slice of each block it reads, and how many decode ranks notify each
// prefill rank. The rules are those of the installed vLLM 0.32's
// NixlConnector (kv_connector/utils.py TransferTopology, nixl/tp_mapping.py
// compute_tp_mapping, nixl/base_worker.py _build_fa_remote and the
// split local handles), so that either side may be vLLM's own connector:
//
//   - local TP >= remote TP (ratio = local/remote): rank r reads remote rank
//     r/ratio; each remote block holds ratio local blocks' heads and rank r
//     reads its slice at offset (r % ratio) × local block length (with
//     replicated local KV, when local TP > the model's KV heads: the slice
//     of the head it serves). ratio decode ranks read each prefill rank, so
//     each notifies "<req>:<ratio>".
//   - local TP < remote TP (ratio = remote/local): rank r handshakes with
//     remote ranks r*ratio … r*ratio+ratio-1; it reads those holding
//     distinct heads (GQA: the first of the ranks sharing a head) and
//     writes remote rank k's whole block into slot k of its own block (the
//     local block split in as many equal parts as ranks read). One decode
//     rank reads each prefill rank: "<req>:1".
//   - MLA: the latent cache is the same on every rank; a decode rank reads
//     one remote rank (r*remote/local) and notifies the other ranks it
//     handshook with without reading them.
//
// Beyond vLLM 0.32, which asserts against it: local TP < remote TP with
// remote TP above the model's KV heads (GQA replication on the prefill)
// works here — the duplicate ranks are notified, not read.
//
// Requirements are checked once per remote engine, at handshake, and a
// geometry that cannot be sliced is refused there with the reason.

package shim

import (
	"fmt"
	"strings"
)

// tpPlan is one decode worker's mapping onto one remote engine.
type tpPlan struct {
	localTP, localRank, remoteTP int
	// ratio > 0: local TP >= remote TP (local/remote); < 0: -(remote/local).
	ratio int
	// targets are the remote ranks handshaken with (and notified), in
	// ascending order; sources the subset read from. slot[i] is the local
	// slot sources[i] lands in (ratio < 0), nSlots the number of slots a
	// local block is split into (1 unless several sources).
	targets, sources []int
	nSlots           int
	// offsetFactor: the index, in local block lengths, of this rank's slice
	// within a remote block (ratio > 0, split KV).
	offsetFactor int
	// consumers is what each notification carries: how many decode ranks
	// read (or notify) each prefill rank.
	consumers int
	// mla: the cache is MLA's latent cache, the same on every rank: whole
	// blocks are read, from one rank.
	mla bool
	// localHeads and remoteHeads are the KV heads per rank on each side
	// (at least 1: GQA replication caps them).
	localHeads, remoteHeads int
}

// planTP computes the mapping. kvHeads is the model's total number of KV
// heads (vLLM's get_total_num_kv_heads); mla whether its cache is MLA's.
func planTP(localRank, localTP, remoteTP, kvHeads int, mla bool) (tpPlan, error) {
	p := tpPlan{localTP: localTP, localRank: localRank, remoteTP: remoteTP}
	switch {
	case localTP <= 0 || remoteTP <= 0 || localRank < 0 || localRank >= localTP:
		return p, fmt.Errorf("bad tensor-parallel layout: local rank %d of %d, remote tp_size %d", localRank, localTP, remoteTP)
	case remoteTP > 1<<12 || localTP > 1<<12:
		return p, fmt.Errorf("tp_size %d/%d out of range", localTP, remoteTP)
	case localTP >= remoteTP && localTP%remoteTP != 0, localTP < remoteTP && remoteTP%localTP != 0:
		return p, fmt.Errorf("remote tp_size %d and this engine's %d do not divide one another (vLLM requires that too)", remoteTP, localTP)
	case kvHeads <= 0 && !mla && localTP != remoteTP:
		return p, fmt.Errorf("the model's number of KV heads is unknown, so heterogeneous TP (remote %d, this engine %d) cannot be mapped", remoteTP, localTP)
	}
	p.localHeads, p.remoteHeads = max(1, kvHeads/localTP), max(1, kvHeads/remoteTP)
	if localTP >= remoteTP {
		p.ratio = localTP / remoteTP
	} else {
		p.ratio = -(remoteTP / localTP)
	}
	p.mla = mla
	if p.ratio > 0 {
		src := localRank / p.ratio
		p.targets, p.sources, p.nSlots = []int{src}, []int{src}, 1
		p.consumers = p.ratio
		switch {
		case mla:
			p.offsetFactor = 0
		case localTP > kvHeads:
			// This rank serves one head (replicated across local ranks):
			// its index among the heads its remote rank holds.
			p.offsetFactor = localRank*kvHeads/localTP - src*kvHeads/remoteTP
		default:
			p.offsetFactor = localRank % p.ratio
		}
		return p, nil
	}
	n := -p.ratio
	start := localRank * n
	for i := 0; i < n; i++ {
		p.targets = append(p.targets, start+i)
	}
	p.consumers = 1
	if mla {
		// One reader of the replicated latent cache; vLLM's rank choice.
		p.sources, p.nSlots = []int{localRank * remoteTP / localTP}, 1
		return p, nil
	}
	// The first rank of each distinct head (remote ranks sharing a head
	// under GQA replication hold identical KV).
	seen := map[int]bool{}
	for _, r := range p.targets {
		h := r * kvHeads / remoteTP
		if !seen[h] {
			seen[h] = true
			p.sources = append(p.sources, r)
		}
	}
	p.nSlots = len(p.sources)
	return p, nil
}

// isTarget reports whether remote rank r is one this worker handshakes with.
func (p tpPlan) isTarget(r int) bool {
	for _, t := range p.targets {
		if t == r {
			return true
		}
	}
	return false
}

// remoteBlockLen is the block length a remote rank must have for a local
// region of block length localLen, or an error when the local length cannot
// be sliced as the plan needs.
func (p tpPlan) remoteBlockLen(localLen uint64) (uint64, error) {
	if p.mla || p.ratio == 1 {
		return localLen, nil
	}
	num := localLen * uint64(p.remoteHeads)
	if num%uint64(p.localHeads) != 0 {
		return 0, fmt.Errorf("local block length %d does not split into %d heads", localLen, p.localHeads)
	}
	if p.ratio < 0 && localLen%uint64(p.nSlots) != 0 {
		return 0, fmt.Errorf("local block length %d does not split into %d slots", localLen, p.nSlots)
	}
	return num / uint64(p.localHeads), nil
}

// readSlice is, for one region of local block length localLen, where in a
// remote block this worker reads (offset, length); the slot of source i
// lands at local offset i*length.
func (p tpPlan) readSlice(localLen uint64) (remoteOff, length uint64) {
	if p.ratio > 0 {
		return uint64(p.offsetFactor) * localLen, localLen
	}
	return 0, localLen / uint64(p.nSlots)
}

// headSliced reports whether reads cut blocks along the head dimension:
// then the KV-cache layout must keep a block's heads contiguous.
func (p tpPlan) headSliced() bool {
	if p.mla || p.ratio == 1 {
		return false
	}
	if p.ratio > 0 {
		return p.remoteHeads != p.localHeads
	}
	return p.nSlots > 1
}

// blockContiguous reports whether a vLLM KV-cache layout name (KVCacheLayout:
// LBHNC, BLHNC, …) keeps [heads, tokens, channels] contiguous in a block.
func blockContiguous(layout string) bool {
	return strings.HasSuffix(layout, "HNC")
}

func (p tpPlan) String() string {
	return fmt.Sprintf("local tp %d rank %d, remote tp %d: ratio %d, handshake %v, read %v, offset factor %d, consumers %d, mla %v",
		p.localTP, p.localRank, p.remoteTP, p.ratio, p.targets, p.sources, p.offsetFactor, p.consumers, p.mla)
}
