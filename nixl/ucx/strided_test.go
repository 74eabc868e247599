//go:build cgo && !gonixl_noucx

package ucx

import (
	"bytes"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/gonixl/gonixl/nixl"
)

// stridedPair registers nreg regions of nblk blocks of blk bytes on each of
// A and B (B's hold a pattern) and returns the runs covering half of each
// block (a head slice at offset off), region-major.
func stridedPair(t *testing.T, nreg, nblk, blk int, off uint64) (p *pairT, local, remote []nixl.Strided) {
	t.Helper()
	p = newPair(t, nreg*nblk*blk, nil, false)
	for i := range p.bufB {
		p.bufB[i] = byte(i*31 + i>>9)
	}
	for r := 0; r < nreg; r++ {
		base := uint64(r * nblk * blk)
		local = append(local, nixl.Strided{Addr: addrOf(p.bufA) + base + off, Stride: uint64(blk), Len: uint64(blk / 2), Count: uint64(nblk)})
		remote = append(remote, nixl.Strided{Addr: addrOf(p.bufB) + base + off, Stride: uint64(blk), Len: uint64(blk / 2), Count: uint64(nblk)})
	}
	return p, local, remote
}

// A strided list addresses exactly the descriptors of its expansion: the
// same operations for random index arrays, and a READ through it moves the
// right bytes.
func TestStridedListMatchesExpanded(t *testing.T) {
	const nreg, nblk, blk = 5, 64, 256
	p, lruns, rruns := stridedPair(t, nreg, nblk, blk, blk/2)
	ls, err := nixl.PrepStrided(p.a, "", nixl.DRAM, lruns)
	if err != nil {
		t.Fatal(err)
	}
	rs, err := nixl.PrepStrided(p.a, "B", nixl.DRAM, rruns)
	if err != nil {
		t.Fatal(err)
	}
	if ls.(*descList).runs == nil || rs.(*descList).runs == nil {
		t.Fatal("the ucx engine expanded strided runs")
	}
	le, err := p.a.PrepDescList("", nixl.DRAM, nixl.ExpandStrided(lruns))
	if err != nil {
		t.Fatal(err)
	}
	re, err := p.a.PrepDescList("B", nixl.DRAM, nixl.ExpandStrided(rruns))
	if err != nil {
		t.Fatal(err)
	}
	if ls.Len() != nreg*nblk || ls.Len() != le.Len() {
		t.Fatalf("Len %d, expanded %d", ls.Len(), le.Len())
	}
	rng := rand.New(rand.NewPCG(7, 11))
	for trial := 0; trial < 50; trial++ {
		n := 1 + rng.IntN(200)
		li, ri := make([]int32, n), make([]int32, n)
		for i := range li {
			li[i], ri[i] = int32(rng.IntN(nreg*nblk)), int32(rng.IntN(nreg*nblk))
		}
		if trial%2 == 0 { // in order, as a request's blocks are
			slices.Sort(li)
			slices.Sort(ri)
		}
		xs, err := p.a.MakeXfer(nixl.Read, ls, li, rs, ri, nil)
		if err != nil {
			t.Fatal(err)
		}
		xe, err := p.a.MakeXfer(nixl.Read, le, li, re, ri, nil)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(xs.(*xfer).ops, xe.(*xfer).ops) {
			t.Fatalf("trial %d: strided ops differ from expanded ops", trial)
		}
		_, _ = xs.Release(), xe.Release()
	}
	if _, err := p.a.MakeXfer(nixl.Read, ls, []int32{int32(nreg * nblk)}, rs, []int32{0}, nil); nixl.StatusOf(err) != nixl.ErrInvalidParam {
		t.Fatalf("index past the strided list: %v", err)
	}
	// Every block's slice, READ through the strided lists.
	all := make([]int32, nreg*nblk)
	for i := range all {
		all[i] = int32(i)
	}
	x, err := p.a.MakeXfer(nixl.Read, ls, all, rs, all, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := x.Post(); err != nil {
		t.Fatal(err)
	}
	if st, err := wait(t, x, p.b, 10*time.Second); st != nixl.Success {
		t.Fatalf("READ: %v %v", st, err)
	}
	_ = x.Release()
	for b := 0; b < nreg*nblk; b++ {
		o := b*blk + blk/2
		if !bytes.Equal(p.bufA[o:o+blk/2], p.bufB[o:o+blk/2]) {
			t.Fatalf("block %d: slice not read", b)
		}
		if p.bufA[b*blk] != 0 {
			t.Fatalf("block %d: bytes outside the slice written", b)
		}
	}
}

// Runs are checked against the registrations: one outside every region
// fails as a descriptor would; one that several regions hold between them
// (not one alone) falls back to per-descriptor checks and works.
func TestStridedListChecks(t *testing.T) {
	const blk = 4096
	p := newPair(t, 8*blk, nil, false)
	base := addrOf(p.bufB)
	if _, err := nixl.PrepStrided(p.a, "B", nixl.DRAM, []nixl.Strided{{Addr: base, Stride: blk, Len: blk, Count: 9}}); nixl.StatusOf(err) != nixl.ErrNotFound {
		t.Fatalf("run one block past the region: %v, want NOT_FOUND", err)
	}
	if _, err := nixl.PrepStrided(p.a, "B", nixl.DRAM, []nixl.Strided{{Addr: base, Stride: 1 << 62, Len: blk, Count: 8}}); nixl.StatusOf(err) != nixl.ErrInvalidParam {
		t.Fatalf("overflowing run: %v, want INVALID_PARAM", err)
	}
	if _, err := nixl.PrepStrided(p.a, "B", nixl.DRAM, []nixl.Strided{{Addr: base, Stride: blk, Len: blk, Count: 0}}); nixl.StatusOf(err) != nixl.ErrInvalidParam {
		t.Fatalf("empty run: %v, want INVALID_PARAM", err)
	}

	// A peer that registered each block alone.
	q := newPair(t, blk, nil, false)
	c := newAgent(t, "C", nil, false)
	buf := mmapBuf(t, 4*blk)
	for i := 0; i < 4; i++ {
		if err := c.RegisterMem(nixl.DRAM, []nixl.Region{{Addr: addrOf(buf) + uint64(i*blk), Len: blk}}); err != nil {
			t.Fatal(err)
		}
	}
	md, err := c.LocalMetadata()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := q.a.LoadRemoteMetadata(md); err != nil {
		t.Fatal(err)
	}
	l, err := nixl.PrepStrided(q.a, "C", nixl.DRAM, []nixl.Strided{{Addr: addrOf(buf), Stride: blk, Len: blk, Count: 4}})
	if err != nil {
		t.Fatalf("blocks registered one by one: %v", err)
	}
	if l.Len() != 4 || l.(*descList).runs != nil {
		t.Fatalf("fallback list: len %d, runs %v", l.Len(), l.(*descList).runs)
	}
}

// benchPair registers nreg regions of nblk blocks of blk bytes on agent A
// and on a peer B loaded into A, and returns A with the strided runs of
// both sides (one run per region).
func benchPair(b *testing.B, nreg, nblk, blk int) (a nixl.Agent, lr, rr []nixl.Strided) {
	a, peer := newAgent(b, "A", nil, false), newAgent(b, "B", nil, false)
	lbuf, rbuf := mmapBuf(b, nreg*nblk*blk), mmapBuf(b, nreg*nblk*blk)
	if err := a.RegisterMem(nixl.DRAM, []nixl.Region{{Addr: addrOf(lbuf), Len: uint64(len(lbuf))}}); err != nil {
		b.Fatal(err)
	}
	if err := peer.RegisterMem(nixl.DRAM, []nixl.Region{{Addr: addrOf(rbuf), Len: uint64(len(rbuf))}}); err != nil {
		b.Fatal(err)
	}
	md, err := peer.LocalMetadata()
	if err != nil {
		b.Fatal(err)
	}
	if _, err := a.LoadRemoteMetadata(md); err != nil {
		b.Fatal(err)
	}
	for r := 0; r < nreg; r++ {
		lr = append(lr, nixl.Strided{Addr: addrOf(lbuf) + uint64(r*nblk*blk), Stride: uint64(blk), Len: uint64(blk), Count: uint64(nblk)})
		rr = append(rr, nixl.Strided{Addr: addrOf(rbuf) + uint64(r*nblk*blk), Stride: uint64(blk), Len: uint64(blk), Count: uint64(nblk)})
	}
	return a, lr, rr
}

// BenchmarkMakeXferStrided: MakeXfer of one request's blocks (80 regions ×
// 16 blocks in order, as a 256-token request of an 80-layer model) from
// expanded and from strided lists.
func BenchmarkMakeXferStrided(b *testing.B) {
	const nreg, nblk, blk, per = 80, 512, 64, 16
	a, lr, rr := benchPair(b, nreg, nblk, blk)
	var li, ri []int32
	for r := 0; r < nreg; r++ {
		for k := 0; k < per; k++ {
			li = append(li, int32(r*nblk+2*k))
			ri = append(ri, int32(r*nblk+3*k))
		}
	}
	for _, strided := range []bool{false, true} {
		name := map[bool]string{false: "expanded", true: "strided"}[strided]
		b.Run(name, func(b *testing.B) {
			var ll, rl nixl.DescList
			if strided {
				ll, _ = a.(nixl.StridedPreparer).PrepStridedDescList("", nixl.DRAM, lr)
				rl, _ = a.(nixl.StridedPreparer).PrepStridedDescList("B", nixl.DRAM, rr)
			} else {
				ll, _ = a.PrepDescList("", nixl.DRAM, nixl.ExpandStrided(lr))
				rl, _ = a.PrepDescList("B", nixl.DRAM, nixl.ExpandStrided(rr))
			}
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				x, err := a.MakeXfer(nixl.Read, ll, li, rl, ri, nil)
				if err != nil {
					b.Fatal(err)
				}
				_ = x.Release()
			}
		})
	}
}

// MakeXferBlocks (regions × blocks) builds the transfer MakeXfer builds
// from the expanded index arrays, reads the right bytes, falls back to the
// expansion when a region's blocks leave its run, and keeps MakeXfer's
// range rules.
func TestMakeXferBlocksMatchesIndexArrays(t *testing.T) {
	const nreg, nblk, blk = 6, 64, 256
	p, lruns, rruns := stridedPair(t, nreg, nblk, blk, 0)
	ls, err := nixl.PrepStrided(p.a, "", nixl.DRAM, lruns)
	if err != nil {
		t.Fatal(err)
	}
	rs, err := nixl.PrepStrided(p.a, "B", nixl.DRAM, rruns)
	if err != nil {
		t.Fatal(err)
	}
	regions := make([]nixl.BlockRegion, nreg)
	for r := range regions {
		regions[r] = nixl.BlockRegion{Local: int32(r * nblk), Remote: int32(r * nblk)}
	}
	rng := rand.New(rand.NewPCG(3, 5))
	for trial := 0; trial < 30; trial++ {
		n := 1 + rng.IntN(nblk)
		lb, rb := make([]int32, n), make([]int32, n)
		for i := range lb {
			lb[i], rb[i] = int32(rng.IntN(nblk)), int32(rng.IntN(nblk))
		}
		li, ri, err := nixl.ExpandBlocks(regions, lb, rb)
		if err != nil {
			t.Fatal(err)
		}
		xb, err := nixl.MakeXferBlocks(p.a, nixl.Read, ls, rs, regions, lb, rb, nil)
		if err != nil {
			t.Fatal(err)
		}
		xi, err := p.a.MakeXfer(nixl.Read, ls, li, rs, ri, nil)
		if err != nil {
			t.Fatal(err)
		}
		if xb.(*xfer).lazy == nil {
			t.Fatal("a regions × blocks DRAM transfer built its operations at once (data path cma builds them on the copy goroutine)")
		}
		xb.(*xfer).Ops() // builds them
		if !slices.Equal(xb.(*xfer).ops, xi.(*xfer).ops) || xb.(*xfer).bytes != xi.(*xfer).bytes || xb.(*xfer).descs != xi.(*xfer).descs {
			t.Fatalf("trial %d: MakeXferBlocks differs from MakeXfer", trial)
		}
		_, _ = xb.Release(), xi.Release()
	}
	// A block id past region 0's run names a descriptor of region 1: the
	// same descriptor the index arrays would name, and a block past the
	// list is MakeXfer's range error.
	x, err := nixl.MakeXferBlocks(p.a, nixl.Read, ls, rs, regions[:1], []int32{nblk + 3}, []int32{2}, nil)
	if err != nil {
		t.Fatal(err)
	}
	x.(*xfer).Ops()
	want := op{laddr: addrOf(p.bufA) + (nblk+3)*blk, raddr: addrOf(p.bufB) + 2*blk, len: blk / 2, memh: x.(*xfer).ops[0].memh, rkey: x.(*xfer).ops[0].rkey}
	if len(x.(*xfer).ops) != 1 || x.(*xfer).ops[0] != want {
		t.Fatalf("spanning runs: ops %+v, want %+v", x.(*xfer).ops, want)
	}
	_ = x.Release()
	last := nixl.BlockRegion{Local: int32((nreg - 1) * nblk), Remote: 0}
	if _, err := nixl.MakeXferBlocks(p.a, nixl.Read, ls, rs, []nixl.BlockRegion{last}, []int32{nblk}, []int32{0}, nil); nixl.StatusOf(err) != nixl.ErrInvalidParam {
		t.Fatalf("block past the list: %v", err)
	}
	if _, err := nixl.MakeXferBlocks(p.a, nixl.Read, ls, rs, regions, []int32{-1}, []int32{0}, nil); nixl.StatusOf(err) != nixl.ErrInvalidParam {
		t.Fatalf("negative block: %v", err)
	}
	// Every block of every region, READ through the structured form.
	all := make([]int32, nblk)
	for i := range all {
		all[i] = int32(i)
	}
	x, err = nixl.MakeXferBlocks(p.a, nixl.Read, ls, rs, regions, all, all, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := x.Post(); err != nil {
		t.Fatal(err)
	}
	if st, err := wait(t, x, p.b, 10*time.Second); st != nixl.Success {
		t.Fatalf("READ: %v %v", st, err)
	}
	_ = x.Release()
	for b := 0; b < nreg*nblk; b++ {
		o := b * blk
		if !bytes.Equal(p.bufA[o:o+blk/2], p.bufB[o:o+blk/2]) || p.bufA[o+blk/2] != 0 {
			t.Fatalf("block %d: wrong bytes", b)
		}
	}
}

// BenchmarkMakeXferBlocks: one request of a 28-layer model (56 regions,
// 2,048 scattered blocks: 114,688 descriptors) made from index arrays and
// from the regions × blocks form, on DRAM lists of strided runs.
func BenchmarkMakeXferBlocks(b *testing.B) {
	const nreg, nblk, blk, per = 56, 4096, 64, 2048
	a, lr, rr := benchPair(b, nreg, nblk, blk)
	regions := make([]nixl.BlockRegion, nreg)
	for r := range regions {
		regions[r] = nixl.BlockRegion{Local: int32(r * nblk), Remote: int32(r * nblk)}
	}
	ll, _ := a.(nixl.StridedPreparer).PrepStridedDescList("", nixl.DRAM, lr)
	rl, _ := a.(nixl.StridedPreparer).PrepStridedDescList("B", nixl.DRAM, rr)
	rng := rand.New(rand.NewPCG(1, 2))
	lb, rb := make([]int32, per), make([]int32, per)
	for i := range lb {
		lb[i], rb[i] = int32(rng.IntN(nblk)), int32(rng.IntN(nblk))
	}
	b.Run("index-arrays", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			li, ri, _ := nixl.ExpandBlocks(regions, lb, rb)
			x, err := a.MakeXfer(nixl.Read, ll, li, rl, ri, nil)
			if err != nil {
				b.Fatal(err)
			}
			_ = x.Release()
		}
	})
	b.Run("blocks", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			x, err := nixl.MakeXferBlocks(a, nixl.Read, ll, rl, regions, lb, rb, nil)
			if err != nil {
				b.Fatal(err)
			}
			_ = x.Release()
		}
	})
}
