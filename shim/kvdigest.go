package shim

// KV digests: the bytes that landed are the bytes the prefill computed.
//
// The producer (a pull prefill's worker) hashes every block of a request
// in the step whose forward made its prompt's KV final (KVDigests, called
// by the Python worker after that forward; the digests reach the request's
// kv_transfer_params through vLLM's worker metadata in the same step). The
// reader (a decode's worker) hashes the blocks it read once every READ of
// the request completed, before it reports the request received, and
// compares (checkDoneLocked, on a goroutine). A block covers the prompt's token slots
// only: the last, partly filled block of a prompt is hashed over its first
// tokens (a step still in flight may write the next slot).
//
// Who digests what: block j of group g is hashed region by region (every
// region that holds the group, in region order), each region's bytes of
// the block's prompt tokens as one stream (memhash.Sum64); the block's
// digest is the hash of those region hashes. A reader that read every block
// of a group also compares, per region, the wrapping sum of the region's
// hashes over the blocks, which names the layer of a mismatch.

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"

	"go.uber.org/zap"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/nixl/memhash"
	"github.com/gonixl/gonixl/shim/kvwire"
)

// kv_digest settings (kv_connector_extra_config).
const (
	KVDigestOff    = "off"    // no digests taken or checked
	KVDigestVerify = "verify" // a mismatch is logged and counted, the KV served
	KVDigestFail   = "fail"   // a mismatch is a load failure (kv_load_failure_policy)
)

// DigestReq is one request whose prompt KV the step just made final: its
// prompt's token count and its blocks per transfer group, the whole
// prompt's list in prompt order.
type DigestReq struct {
	ID     string   `json:"id"`
	Tokens int64    `json:"tokens"`
	Blocks BlockIDs `json:"blocks"`
}

// DigestOut is a request's digests: Blocks[g][j] of DigestReq.Blocks[g][j]
// (0 for a block not digested), Regions[g] the per-region sums.
type DigestOut struct {
	Blocks  [][]uint64 `json:"blocks"`
	Regions [][]uint64 `json:"regions"`
}

// byteRun is a run of bytes inside one block of a region.
type byteRun struct{ off, n uint64 }

// tokenRuns returns where token slots [0, m) of a block of r lie, as runs
// inside the block; ok is false when this layout's token order is not
// known (BlockReshape ""), which only matters for a partly filled block.
func (w *Worker) tokenRuns(r Region, m int64) (runs []byteRun, ok bool) {
	bs := w.blockSize
	if m >= bs || bs <= 0 {
		return []byteRun{{0, r.Len}}, true
	}
	if m <= 0 {
		return nil, true
	}
	bl := int64(r.Len)
	switch w.blockReshape {
	case "token_major":
		if bl%bs != 0 {
			return nil, false
		}
		return []byteRun{{0, uint64(m * (bl / bs))}}, true
	case "head_major":
		// Per head a run of block_size tokens of head_size elements.
		hd, e := w.headSize, r.Elem
		if hd <= 0 || e <= 0 || bl%(bs*hd*e) != 0 {
			return nil, false
		}
		per := bs * hd * e
		for h := int64(0); h < bl/per; h++ {
			runs = append(runs, byteRun{uint64(h * per), uint64(m * hd * e)})
		}
		return runs, true
	case "cpu_vec":
		// Per head: K as [head_size][tokens] (a run of one element per
		// token for each dimension), then V as [tokens][head_size].
		hd, e := w.headSize, r.Elem
		if hd <= 0 || e <= 0 || bl%(2*bs*hd*e) != 0 {
			return nil, false
		}
		per := 2 * bs * hd * e
		for h := int64(0); h < bl/per; h++ {
			base := h * per
			for d := int64(0); d < hd; d++ {
				runs = append(runs, byteRun{uint64(base + d*bs*e), uint64(m * e)})
			}
			runs = append(runs, byteRun{uint64(base + bs*hd*e), uint64(m * hd * e)})
		}
		return runs, true
	}
	return nil, false
}

// groupRegions are the indices of the regions that hold group g's blocks.
func (w *Worker) groupRegions(g int) []int {
	var out []int
	for i, r := range w.layout.Regions {
		if r.Group == g || r.Group == SharedGroup {
			out = append(out, i)
		}
	}
	return out
}

// errDigestLayout: a partly filled block of a layout whose token order is
// not known cannot be hashed over its prompt tokens only.
var errDigestLayout = errors.New("the token order inside a block of this KV-cache layout is not known")

// digestBlocks hashes blocks ids of group g, block j holding tokens(j)
// prompt tokens: per block the digest, and per region of the group the
// wrapping sum of its hashes. A block it cannot hash gets digest 0 (not
// checked); the caller has checked ids against the layout. ok is false
// when a hashing goroutine panicked: nothing of the result may be used.
func (w *Worker) digestBlocks(g int, ids []int64, tokens func(j int) int64) (blocks, regions []uint64, ok bool) {
	return w.digestBlocksPar(g, ids, tokens, maxDigestThreads)
}

// digestBlocksPar is digestBlocks on at most maxPar goroutines.
func (w *Worker) digestBlocksPar(g int, ids []int64, tokens func(j int) int64, maxPar int) (blocks, regions []uint64, ok bool) {
	regs := w.groupRegions(g)
	blocks = make([]uint64, len(ids))
	regions = make([]uint64, len(regs))
	// Blocks split in contiguous shares, one goroutine each beyond the
	// first (the caller's): a prefill hashes on vLLM's thread, whose other
	// cores are idle after the forward.
	var bytes uint64
	for _, ri := range regs {
		bytes += w.layout.Regions[ri].Len
	}
	par := min(runtime.GOMAXPROCS(0), maxPar, len(ids))
	if bytes*uint64(len(ids)) < digestParallelBytes {
		par = 1
	}
	sums := make([][]uint64, par)
	var wg sync.WaitGroup
	var panicked atomic.Bool
	for p := range par {
		lo, hi := p*len(ids)/par, (p+1)*len(ids)/par
		sums[p] = make([]uint64, len(regs))
		if p == 0 {
			continue
		}
		wg.Add(1)
		var once sync.Once
		done := func() { once.Do(wg.Done) }
		w.goSafe("kv digest", func(error) { panicked.Store(true); done() }, func() {
			defer done()
			w.digestRange(regs, ids[lo:hi], lo, tokens, blocks[lo:hi], sums[p])
		})
	}
	// A panic in the caller's share must not leave before the other
	// shares stop reading the blocks (the caller's recovery may give them
	// back).
	defer wg.Wait()
	w.digestRange(regs, ids[:len(ids)/par], 0, tokens, blocks[:len(ids)/par], sums[0])
	wg.Wait()
	for _, s := range sums {
		for k, v := range s {
			regions[k] += v
		}
	}
	return blocks, regions, !panicked.Load()
}

// Hashing in parallel: at most maxDigestThreads goroutines, and only for
// more than digestParallelBytes (a goroutine's start costs microseconds).
const (
	maxDigestThreads    = 4
	digestParallelBytes = 4 << 20
)

// digestRange hashes blocks ids (block j of the group's list is ids[j-lo]),
// writing their digests to out and adding each region's hashes to sums.
func (w *Worker) digestRange(regs []int, ids []int64, lo int, tokens func(j int) int64, out, sums []uint64) {
	hashes := make([]byte, 8*len(regs))
	var spans []memhash.Span
	for i, id := range ids {
		m := tokens(lo + i)
		if m <= 0 || id < 0 {
			continue
		}
		ok := true
		for k, ri := range regs {
			r := w.layout.Regions[ri]
			runs, known := w.tokenRuns(r, m)
			if !known {
				ok = false
				break
			}
			spans = spans[:0]
			base := r.Base + uint64(id)*r.Stride
			for _, ru := range runs {
				spans = append(spans, memhash.Span{Addr: base + ru.off, Len: ru.n})
			}
			binary.LittleEndian.PutUint64(hashes[8*k:], memhash.Sum64(spans))
		}
		if !ok {
			continue
		}
		for k := range regs {
			sums[k] += binary.LittleEndian.Uint64(hashes[8*k:])
		}
		out[i] = digestOf(hashes)
	}
}

// digestOf is a block's digest from its region hashes, never 0 (0 means
// "not digested" on the wire).
func digestOf(regionHashes []byte) uint64 {
	d := memhash.Bytes(regionHashes)
	if d == 0 {
		d = 1
	}
	return d
}

// canDigestLocked says why this worker's KV cannot be digested, or "".
func (w *Worker) canDigestLocked() string {
	switch {
	case w.layout == nil:
		return "no KV cache registered"
	case w.layout.Mem != nixl.DRAM:
		return fmt.Sprintf("the KV cache is in %v: digests of device memory are not built (docs/FAULTS.md)", w.layout.Mem)
	}
	return ""
}

// checkIDs checks block ids against this worker's cache (-1: a place
// holder, not hashed).
func (w *Worker) checkIDs(ids BlockIDs) error {
	for g, l := range ids {
		for _, b := range l {
			if b < -1 || b >= w.layout.NumBlocks {
				return fmt.Errorf("group %d: block id %d out of range [0, %d)", g, b, w.layout.NumBlocks)
			}
		}
	}
	return nil
}

// KVDigests hashes the blocks of requests whose prompt KV the step made
// final (a JSON list of DigestReq) and returns a JSON object of DigestOut
// by request id. Called after the step's forward, on vLLM's thread: the
// digests must reach the request's kv_transfer_params in the same step.
func (w *Worker) KVDigests(in []byte) ([]byte, error) {
	defer w.lockTimed("kv_digests")()
	reqs, err := w.digestReqsLocked(in)
	if err != nil {
		return nil, err
	}
	out := make(map[string]DigestOut, len(reqs))
	for _, r := range reqs {
		if d, ok := w.digestReq(r, maxDigestThreads); ok {
			out[r.ID] = d
		} // else no digests: read unchecked (the panic is logged and counted)
	}
	return json.Marshal(out)
}

// digestReqsLocked parses and checks a JSON list of DigestReq; nil and no
// error when this engine's KV cannot be digested (said once).
func (w *Worker) digestReqsLocked(in []byte) ([]DigestReq, error) {
	var reqs []DigestReq
	if err := json.Unmarshal(in, &reqs); err != nil {
		return nil, withClass(ErrInvalidInput, fmt.Errorf("kv digests: %w", err))
	}
	if w.closed {
		return nil, withClass(ErrState, errors.New("worker is closed"))
	}
	if why := w.canDigestLocked(); why != "" {
		if w.noteOnce("digest:" + why) {
			w.log.Warn("KV digests are not taken: "+why+"; decodes read this engine's KV unchecked", zap.String("kv_digest", w.cfg.KVDigest))
		}
		return nil, nil
	}
	ng := max(len(w.cfg.TransferGroups), 1)
	for _, r := range reqs {
		if len(r.Blocks) != ng {
			return nil, withClass(ErrInvalidInput, fmt.Errorf("kv digests: request %s has %d groups of blocks, this engine %d", r.ID, len(r.Blocks), ng))
		}
		if err := w.checkIDs(r.Blocks); err != nil {
			return nil, withClass(ErrInvalidInput, fmt.Errorf("kv digests: request %s: %w", r.ID, err))
		}
	}
	if reqs == nil {
		reqs = []DigestReq{}
	}
	return reqs, nil
}

// digestReq hashes one request's blocks (checked by digestReqsLocked) on
// at most maxPar goroutines. It reads only the registered layout and the
// blocks: no lock needed. False when a hashing goroutine panicked.
func (w *Worker) digestReq(r DigestReq, maxPar int) (DigestOut, bool) {
	d := DigestOut{Blocks: make([][]uint64, len(r.Blocks)), Regions: make([][]uint64, len(r.Blocks))}
	ok := true
	for g, ids := range r.Blocks {
		n := r.Tokens
		var gok bool
		d.Blocks[g], d.Regions[g], gok = w.digestBlocksPar(g, ids, func(j int) int64 { return min(w.blockSize, n-int64(j)*w.blockSize) }, maxPar)
		ok = ok && gok
	}
	return d, ok
}

// noteOnce is true the first time key is seen (a log line printed once).
func (w *Worker) noteOnce(key string) bool {
	if w.noted == nil {
		w.noted = map[string]bool{}
	}
	if w.noted[key] || len(w.noted) > 1024 {
		return false
	}
	w.noted[key] = true
	return true
}

// digestCheck is what a READ's blocks must hash to: per group, the local
// blocks read, the prefill's digest of each (0: not checked) and its token
// count; whole says the READ covered every block the digests name (then
// the per-region sums locate a mismatch).
type digestCheck struct {
	rank    int
	local   BlockIDs
	remote  BlockIDs
	want    [][]uint64
	tokens  [][]int64
	pos     [][]int64
	whole   []bool
	regions [][]uint64
	// A read-back's digests come from the decode's side channel
	// (kvdigest_readback.go): fetch delivers them, and fill (with skip,
	// where each group's read starts in the decode's list) sets the fields
	// above in the check's goroutine.
	fetch     <-chan fetchedDigest
	stopFetch context.CancelFunc
	skip      []int
	adv       BlockIDs
}

// digestCheckLocked prepares the check of st's READ of local from remote
// (pairBlocks' pairs), or returns nil when the READ is read unchecked
// (kv_digest off, a peer that sent no digests, a layout the digests do not
// follow), logged once per reason and engine.
func (w *Worker) digestCheckLocked(st *recvState, re *remoteEngine, local, remote BlockIDs) *digestCheck {
	if w.cfg.KVDigest == KVDigestOff {
		return nil
	}
	d := st.meta.Remote.Digest
	why := ""
	switch {
	case st.meta.Readback && !st.meta.Remote.DigestServed:
		why = "the decode serves no KV digests of the blocks it holds (a stock engine, or gonixl with kv_digest off)"
	case st.meta.Readback && !re.gonixl:
		// Params that claim digests from an engine whose handshake says
		// it is stock: vLLM's listener would take the query for a
		// malformed handshake and stop serving.
		why = "its params say digests are served, but the engine is not gonixl"
	case !st.meta.Readback && d == nil:
		why = "the prefill sent no KV digests (a stock engine, or gonixl with kv_digest off)"
	case re.blockRatio > 1:
		why = "its block size differs from this engine's (digests follow whole blocks)"
	case len(re.plan.sources) != 1 || re.plan.nSlots > 1 || (re.plan.ratio != 1 && !re.plan.mla):
		why = "its tp_size differs from this engine's (digests follow a rank's whole blocks)"
	case w.canDigestLocked() != "":
		why = w.canDigestLocked()
	}
	if why != "" {
		w.readUncheckedLocked(st, re.id, why)
		return nil
	}
	c := &digestCheck{rank: re.plan.sources[0], local: local, remote: remote, adv: st.meta.Remote.BlockIDs, skip: w.readSkips(st.meta, local)}
	if st.meta.Readback {
		c.fetch, c.stopFetch = w.fetchDigestLocked(st)
		return c
	}
	if why := c.fill(d, w.blockSize); why != "" {
		w.readUncheckedLocked(st, re.id, why)
		return nil
	}
	return c
}

// readSkips is, per group, where the blocks read start in the remote list
// (pairBlocks: a pull reads the list's tail; a read-back reads from the
// blocks this engine has cached, trimmed at the end to what it allocated).
func (w *Worker) readSkips(rr *RecvReq, local BlockIDs) []int {
	out := make([]int, len(local))
	for g := range local {
		adv := rr.Remote.BlockIDs
		if g >= len(adv) {
			continue
		}
		out[g] = len(adv[g]) - len(local[g])
		window := 0
		if g < len(w.cfg.TransferGroups) && w.cfg.HMARequired {
			window = w.cfg.TransferGroups[g].blocksInWindow()
		}
		if rr.Readback && window == 0 && g < len(rr.LocalNumComputed) && len(local[g]) > 0 &&
			int64(len(adv[g])) >= rr.LocalNumComputed[g]+int64(len(local[g])) {
			out[g] = int(rr.LocalNumComputed[g])
		}
	}
	return out
}

// fill sets what c's blocks must hash to from the remote's digests d; it
// returns why they cannot be checked ("" when they can).
func (c *digestCheck) fill(d *kvwire.KVDigest, blockSize int64) string {
	if c.rank >= len(d.Ranks) || len(d.First) != len(c.local) || len(c.adv) != len(c.local) {
		return "its digests do not match its ranks or groups"
	}
	rd := d.Ranks[c.rank]
	n := len(c.local)
	c.want, c.tokens, c.pos, c.whole, c.regions = make([][]uint64, n), make([][]int64, n), make([][]int64, n), make([]bool, n), rd.Regions
	for g := range c.local {
		skip := c.skip[g]
		if skip < 0 || skip+len(c.local[g]) > len(c.adv[g]) || len(rd.Blocks[g]) != len(c.adv[g]) {
			return fmt.Sprintf("its digests of group %d do not match the blocks read", g)
		}
		c.whole[g] = skip == 0 && len(c.local[g]) == len(c.adv[g])
		for k := range c.local[g] {
			j := skip + k
			pos := d.First[g] + int64(j)
			c.want[g] = append(c.want[g], rd.Blocks[g][j])
			c.pos[g] = append(c.pos[g], pos)
			c.tokens[g] = append(c.tokens[g], min(blockSize, d.Tokens-pos*blockSize))
		}
	}
	return ""
}

// digestResult is a check's local digests, per group.
type digestResult struct {
	blocks, regions [][]uint64
	err             error  // the hashing goroutine panicked
	unchecked       string // why a read-back's blocks cannot be checked
}

// runCheck is a check's goroutine: a read-back's digests first (fetched
// while its READ ran), then the hashing.
func (w *Worker) runCheck(c *digestCheck) digestResult {
	if c.fetch != nil {
		f := <-c.fetch
		why := f.why
		if why == "" {
			why = c.fill(f.d, w.blockSize)
		}
		if why != "" {
			return digestResult{unchecked: why}
		}
	}
	return w.hashCheck(c)
}

// hashCheck hashes the local blocks of c. It reads only the registered
// layout (fixed once registered) and the blocks, which nothing writes while
// the connector holds them: it runs without the worker's lock.
func (w *Worker) hashCheck(c *digestCheck) digestResult {
	r := digestResult{blocks: make([][]uint64, len(c.local)), regions: make([][]uint64, len(c.local))}
	for g := range c.local {
		tok := c.tokens[g]
		var ok bool
		if r.blocks[g], r.regions[g], ok = w.digestBlocks(g, c.local[g], func(j int) int64 { return tok[j] }); !ok {
			r.err = errors.New("a hashing goroutine panicked")
		}
	}
	return r
}

// checkDoneLocked runs st's check off vLLM's thread: the first call starts
// the hashing on a goroutine of the worker's, later ones take its result
// once it is there. False while it runs (the request stays receiving);
// true once judged (st.failed set under fail on a mismatch).
func (w *Worker) checkDoneLocked(st *recvState) bool {
	if st.checking == nil {
		if w.closed {
			return false
		}
		c := st.check
		w.startCheckLocked(st, func() (digestResult, bool) { return w.runCheck(c), true })
		return false
	}
	var r digestResult
	select {
	case r = <-st.checking:
	default:
		return false
	}
	ok := w.takeCheckLocked(st, r)
	w.stopWatchLocked(st)
	if st.check.stopFetch != nil {
		st.check.stopFetch()
	}
	st.check, st.checking = nil, nil // judged: once
	if !ok {
		st.failed = true
	}
	return true
}

// watchLandingLocked starts st's check as soon as the bytes of its READs
// have landed, on a goroutine of the worker's, where the engine says when
// that is (nixl.Lander: the ucx engine's own copies) and every READ was
// posted in place. The poll that sees the READs complete then usually
// finds the result there (checkDoneLocked takes it), instead of starting
// the hashing and reporting the request a step later. A test fault
// (kvfault.go) that damages a block read does so once the READ landed,
// before the hashing, as the poll does without a watch. The watch ends
// with the request (stopWatchLocked): failed, judged, or Close.
func (w *Worker) watchLandingLocked(st *recvState) {
	fault := w.kvFaultFor(st.id)
	if st.check == nil || st.checking != nil || st.failed || !st.report || w.closed || len(st.xfers) == 0 || fault == faultLate {
		return
	}
	landed := make([]<-chan struct{}, 0, len(st.xfers))
	for _, f := range st.xfers {
		l, ok := f.x.(nixl.Lander)
		if !ok || f.post != nil {
			return
		}
		ch := l.Landed()
		if ch == nil {
			return
		}
		landed = append(landed, ch)
	}
	ctx, cancel := context.WithCancel(w.fetches) // Close cancels it too
	st.unwatch = cancel
	c := st.check
	w.startCheckLocked(st, func() (digestResult, bool) {
		defer cancel() // its context leaves w.fetches with it
		for _, l := range landed {
			select {
			case <-l:
			case <-ctx.Done():
				return digestResult{}, false // failed or closed: nobody takes a result
			}
		}
		if fault == faultFlip && !w.flipLanded(ctx, st) {
			return digestResult{}, false
		}
		if ctx.Err() != nil {
			return digestResult{}, false
		}
		return w.runCheck(c), true
	})
}

// startCheckLocked runs a check of st on a goroutine of the worker's
// (counted in w.checks, which Close waits for): run's result, when it has
// one, goes to st.checking and wakes the next step. A panic is the
// check's result (an error), unless one was sent already.
func (w *Worker) startCheckLocked(st *recvState, run func() (digestResult, bool)) {
	ch := make(chan digestResult, 1)
	st.checking = ch
	w.checks.Add(1)
	var once sync.Once
	done := func() { once.Do(w.checks.Done) }
	w.goSafe("kv digest check", func(err error) {
		select { // a result already sent stands
		case ch <- digestResult{err: err}:
		default:
		}
		done()
	}, func() {
		defer done()
		r, ok := run()
		if !ok {
			return
		}
		ch <- r
		// The next step polls (the worker is busy while st waits); the
		// counter also wakes a step that would skip its call.
		w.mu.Lock()
		defer w.mu.Unlock()
		if !w.closed {
			w.publishLocked(true)
		}
	})
}

// flipLanded applies the kvfault-flip test fault to st's landed blocks,
// unless its watch ended; false when it did.
func (w *Worker) flipLanded(ctx context.Context, st *recvState) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if ctx.Err() != nil {
		return false
	}
	w.flipFaultLocked(st)
	return true
}

// stopWatchLocked ends st's landing watch, if any.
func (w *Worker) stopWatchLocked(st *recvState) {
	if st.unwatch != nil {
		st.unwatch()
		st.unwatch = nil
	}
}

// takeCheckLocked judges a check's result; one whose hashing failed is
// not served under fail either (it could not be checked).
func (w *Worker) takeCheckLocked(st *recvState, r digestResult) bool {
	if r.unchecked != "" {
		w.readUncheckedLocked(st, st.meta.Remote.EngineID, r.unchecked)
		return true
	}
	if r.err != nil {
		if w.cfg.KVDigest == KVDigestFail {
			w.failLocked(st, "kv_digest_mismatch", "the KV could not be checked: "+r.err.Error()+"; the load fails (kv_load_failure_policy "+w.cfg.KVLoadFailurePolicy+")", nil)
			return false
		}
		w.logFailure("kv_digest_mismatch", st, "the KV could not be checked: "+r.err.Error()+"; served anyway (kv_digest verify)", nil)
		return true
	}
	return w.judgeDigestLocked(st, r)
}

// judgeDigestLocked compares a check's local digests with the prefill's;
// true when the request may be reported received (no mismatch, or
// kv_digest verify). A mismatch is logged and counted, and under fail the
// request is failed.
func (w *Worker) judgeDigestLocked(st *recvState, r digestResult) bool {
	c := st.check
	var bad []string
	checked := 0
	for g := range c.local {
		got, regions := r.blocks[g], r.regions[g]
		var badBlocks []int
		for k, want := range c.want[g] {
			if want == 0 || got[k] == 0 {
				continue
			}
			checked++
			if got[k] != want {
				badBlocks = append(badBlocks, k)
			}
		}
		if len(badBlocks) == 0 {
			continue
		}
		layers := "not located (the read did not cover every block the digests name)"
		if c.whole[g] && g < len(c.regions) && len(c.regions[g]) == len(regions) {
			var names []string
			regs := w.groupRegions(g)
			for k := range regions {
				if regions[k] != c.regions[g][k] {
					names = append(names, fmt.Sprintf("%s (region %d)", w.layout.Regions[regs[k]].Layer, regs[k]))
				}
			}
			if len(names) > 0 {
				layers = strings.Join(names, ", ")
			}
		}
		for i, k := range badBlocks {
			if i == 8 {
				bad = append(bad, fmt.Sprintf("group %d: %d more blocks", g, len(badBlocks)-8))
				break
			}
			bad = append(bad, fmt.Sprintf("group %d block %d (local id %d, remote id %d, tokens %d)", g, c.pos[g][k], c.local[g][k], c.remote[g][k], c.tokens[g][k]))
		}
		bad = append(bad, fmt.Sprintf("group %d layers: %s", g, layers))
	}
	w.prom.digestChecked.Add(float64(checked))
	if len(bad) == 0 {
		return true
	}
	w.prom.digestMismatch.Inc()
	whose := "the prefill's"
	if st.meta.Readback {
		whose = "the decode's"
	}
	msg := fmt.Sprintf("the KV read differs from %s digests (kv_digest %s, remote tp_rank %d): %s", whose, w.cfg.KVDigest, c.rank, strings.Join(bad, "; "))
	if w.cfg.KVDigest == KVDigestVerify {
		w.logFailure("kv_digest_mismatch", st, msg+"; served anyway (kv_digest verify)", nil)
		return true
	}
	w.failLocked(st, "kv_digest_mismatch", msg+"; the load fails (kv_load_failure_policy "+w.cfg.KVLoadFailurePolicy+")", nil)
	return false
}

// pushDigestLocked is the PushDigest a prefill sends before the WRITE of
// ps's blocks local (pairPush's, the tail of ps.blocks) into the
// registration's, or nil: the decode did not ask, kv_digest is off here,
// the tp sizes differ (each rank's WRITE fills slices), the prompt's token
// count or the KV's memory is not known.
func (w *Worker) pushDigestLocked(ps *pushSend, re *remoteEngine, local BlockIDs) []byte {
	if !ps.reg.WantsKVDigest || w.cfg.KVDigest == KVDigestOff || ps.tokens <= 0 || w.canDigestLocked() != "" ||
		re.plan.ratio != 1 || re.plan.nSlots > 1 || re.blockRatio > 1 {
		return nil
	}
	d := &kvwire.PushDigest{RequestID: ps.reg.RequestID, Tokens: ps.tokens, First: make([]int64, len(local)), Blocks: make([][]uint64, len(local)), Source: local}
	for g := range local {
		first := int64(len(ps.blocks[g]) - len(local[g]))
		d.First[g] = first
		var ok bool
		if d.Blocks[g], _, ok = w.digestBlocks(g, local[g], func(j int) int64 { return min(w.blockSize, ps.tokens-(first+int64(j))*w.blockSize) }); !ok {
			return nil // the WRITE goes unchecked (the panic is logged and counted)
		}
	}
	b, err := kvwire.EncodePushDigest(d)
	if err != nil {
		return nil
	}
	return b
}

// pushDigestMsgLocked takes the PushDigest a prefill's WRITE completion
// carried for st.
func (w *Worker) pushDigestMsgLocked(st *recvState, payload []byte) {
	d, err := kvwire.DecodePushDigest(payload)
	if err != nil || d.RequestID != st.id {
		w.log.Warn("push: malformed KV digests from a prefill; its WRITE is read unchecked", zap.String("request_id", st.id), zap.Error(err))
		return
	}
	st.push.digest = d
}

// startPushCheckLocked starts the check of the blocks a push WRITE filled
// against the prefill's PushDigest, off vLLM's thread (checkDoneLocked);
// false when there is nothing to check: a prefill that sent none (a stock
// one, gonixl with kv_digest off) is read unchecked, said once.
func (w *Worker) startPushCheckLocked(st *recvState) bool {
	if w.cfg.KVDigest == KVDigestOff {
		return false
	}
	d, local := st.push.digest, st.meta.LocalBlockIDs
	why := ""
	switch {
	case d == nil:
		why = "the prefill sent no KV digests before its WRITE (a stock engine, gonixl with kv_digest off, or another tp_size)"
	case len(d.Blocks) != len(local):
		why = "its digests do not match the registered groups"
	case w.canDigestLocked() != "":
		why = w.canDigestLocked()
	}
	for g := range local {
		if why == "" && len(d.Blocks[g]) != len(local[g]) {
			why = "its digests do not match the registered blocks"
		}
	}
	if why != "" {
		w.readUncheckedLocked(st, st.meta.Remote.EngineID, why)
		return false
	}
	c := &digestCheck{local: local, remote: d.Source, want: d.Blocks, tokens: make([][]int64, len(local)), pos: make([][]int64, len(local)), whole: make([]bool, len(local))}
	for g := range local {
		for j := range local[g] {
			pos := d.First[g] + int64(j)
			c.pos[g] = append(c.pos[g], pos)
			c.tokens[g] = append(c.tokens[g], min(w.blockSize, d.Tokens-pos*w.blockSize))
		}
	}
	st.check = c
	return !w.checkDoneLocked(st) // starts it: false until its result is taken
}

// waitChecksForClose waits, without the lock, for the checks still hashing:
// they read KV-cache memory the caller may free after Close, so there is
// no giving up (a check is milliseconds of hashing; none starts once
// closed).
func (w *Worker) waitChecksForClose() {
	w.mu.Unlock()
	defer w.mu.Lock()
	w.checks.Wait()
}

// readUncheckedLocked counts a transfer read without a digest check and
// says why, once per remote engine and reason (the reason's text up to its
// first colon: details such as an address or a request id do not make it
// another reason).
func (w *Worker) readUncheckedLocked(st *recvState, engineID, why string) {
	w.prom.digestUnchecked.Inc()
	class, _, _ := strings.Cut(why, ":")
	if w.noteOnce("unchecked:" + engineID + class) {
		w.log.Warn("reading KV unchecked: "+why+" (logged once per engine and reason)", zap.String("remote_engine_id", engineID), zap.String("request_id", st.id))
		return
	}
	w.log.Debug("reading KV unchecked: "+why, zap.String("remote_engine_id", engineID), zap.String("request_id", st.id))
}
