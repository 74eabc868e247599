package libnixl

import (
	"reflect"
	"slices"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/gonixl/gonixl/nixl"
)

// benchPair is two in-process agents, a registered region each, and the
// local and remote block lists (block bytes × n).
type benchPair struct {
	a, b          nixl.Agent
	local, remote nixl.DescList
	mems          [][]byte
}

func newBenchPair(tb testing.TB, block, n int, progress bool) *benchPair {
	tb.Helper()
	if err := (Engine{}).Available(); err != nil {
		tb.Skipf("NIXL not available: %v", err)
	}
	p := &benchPair{}
	mk := func(name string) (nixl.Agent, []byte) {
		ag, err := Engine{}.NewAgent(nixl.AgentConfig{Name: name, ProgressThread: progress, Telemetry: true})
		if err != nil {
			tb.Fatal(err)
		}
		m, err := syscall.Mmap(-1, 0, block*n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
		if err != nil {
			tb.Fatal(err)
		}
		p.mems = append(p.mems, m)
		if err := ag.RegisterMem(nixl.DRAM, []nixl.Region{{Addr: addrOf(m), Len: uint64(len(m))}}); err != nil {
			tb.Fatal(err)
		}
		return ag, m
	}
	var ma, mb []byte
	p.a, ma = mk(tbName(tb) + "-a")
	p.b, mb = mk(tbName(tb) + "-b")
	md, err := p.b.LocalMetadata()
	if err != nil {
		tb.Fatal(err)
	}
	name, err := p.a.LoadRemoteMetadata(md)
	if err != nil {
		tb.Fatal(err)
	}
	if p.local, err = p.a.PrepDescList("", nixl.DRAM, table(addrOf(ma), block, n)); err != nil {
		tb.Fatal(err)
	}
	if p.remote, err = p.a.PrepDescList(name, nixl.DRAM, table(addrOf(mb), block, n)); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		p.local.Release()
		p.remote.Release()
		p.a.Close()
		p.b.Close()
		for _, m := range p.mems {
			syscall.Munmap(m)
		}
	})
	return p
}

func tbName(tb testing.TB) string {
	return "bench-" + reflect.TypeOf(tb).Elem().Name() + "-" + tb.Name()
}

func addrOf(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(&b[0]))) }

func table(base uint64, block, n int) []nixl.Desc {
	d := make([]nixl.Desc, n)
	for i := range d {
		d[i] = nixl.Desc{Addr: base + uint64(i*block), Len: uint64(block)}
	}
	return d
}

// scattered returns n block ids that are never adjacent (no merging).
func scattered(n int) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = int32((i * 7919) % n)
	}
	return out
}

const descs16k = 16384

// BenchmarkGoSideMakeXfer16k is our per-transfer CPU cost at 16k
// descriptors, without NIXL's own work: building the index arrays from
// block ids, the pair checks MakeXfer does, and one cgo crossing carrying
// both arrays. Reported as ns/desc (target < 50).
func BenchmarkGoSideMakeXfer16k(b *testing.B) {
	blocks := scattered(descs16k)
	lens := make([]uint64, descs16k)
	for i := range lens {
		lens[i] = 4096
	}
	li, ri := make([]int32, descs16k), make([]int32, descs16k)
	const region, numBlocks = 3, descs16k
	b.ResetTimer()
	for b.Loop() {
		for i, blk := range blocks {
			// vLLM's desc id: region*num_blocks + block (regions of one list)
			li[i] = int32(region*numBlocks+int(blk)) - region*numBlocks
			ri[i] = blk
		}
		if err := checkPairs(lens, lens, li, ri); err != nil {
			b.Fatal(err)
		}
		if touchArrays(li, ri) == 0 {
			b.Fatal("touch")
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/descs16k, "ns/desc")
}

// BenchmarkMakeXfer16k is MakeXfer + Release through real NIXL at 16k
// scattered descriptors (NIXL's makeXferReq included).
func BenchmarkMakeXfer16k(b *testing.B) {
	p := newBenchPair(b, 4096, descs16k, false)
	idx := scattered(descs16k)
	b.ResetTimer()
	for b.Loop() {
		x, err := p.a.MakeXfer(nixl.Read, p.local, idx, p.remote, idx, []byte("n"))
		if err != nil {
			b.Fatal(err)
		}
		if err := x.Release(); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/descs16k, "ns/desc")
}

// benchXfer posts one prepared transfer repeatedly and polls to completion.
func benchXfer(b *testing.B, op nixl.XferOp, block, n int) {
	p := newBenchPair(b, block, n, true) // the target agent needs progress
	idx := scattered(n)
	x, err := p.a.MakeXfer(op, p.local, idx, p.remote, idx, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer x.Release()
	b.SetBytes(int64(block * n))
	b.ResetTimer()
	for b.Loop() {
		st, err := x.Post()
		for err == nil && st == nixl.InProgress {
			st, err = x.Check()
		}
		if err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkRead4KiBx1(b *testing.B)     { benchXfer(b, nixl.Read, 4096, 1) }
func BenchmarkRead4KiBx1024(b *testing.B)  { benchXfer(b, nixl.Read, 4096, 1024) }
func BenchmarkRead1MiBx64(b *testing.B)    { benchXfer(b, nixl.Read, 1<<20, 64) }
func BenchmarkWrite4KiBx1024(b *testing.B) { benchXfer(b, nixl.Write, 4096, 1024) }

// BenchmarkPostShare14MiB is a 14 MiB READ (224 scattered blocks of 64
// KiB, with a notification) between two agents of this process, progress
// threads on as the shim runs them, and reports how much of the transfer
// the posting thread spends in Post: post-µs against xfer-µs (post start
// to completion), medians. With NIXL's UCX backend on one host the copy
// (CMA lane) runs inside Post, on the caller's thread — vLLM's model
// thread in the shim — which is why the shim posts for this engine from a
// goroutine (nixl.PostCopies). go test -run XXX -bench PostShare ./nixl/libnixl
func BenchmarkPostShare14MiB(b *testing.B) {
	const block, n = 64 << 10, 224
	p := newBenchPair(b, block, n, true)
	idx := scattered(n)
	x, err := p.a.MakeXfer(nixl.Read, p.local, idx, p.remote, idx, []byte("n"))
	if err != nil {
		b.Fatal(err)
	}
	defer x.Release()
	b.SetBytes(int64(block * n))
	var posts, xfers []time.Duration
	b.ResetTimer()
	for b.Loop() {
		t0 := time.Now()
		st, err := x.Post()
		t1 := time.Now()
		for err == nil && st == nixl.InProgress {
			st, err = x.Check()
		}
		if err != nil {
			b.Fatal(err)
		}
		posts, xfers = append(posts, t1.Sub(t0)), append(xfers, time.Since(t0))
	}
	b.ReportMetric(medianMicros(posts), "post-µs")
	b.ReportMetric(medianMicros(xfers), "xfer-µs")
}

func medianMicros(d []time.Duration) float64 {
	s := slices.Clone(d)
	slices.Sort(s)
	return float64(s[len(s)/2].Nanoseconds()) / 1e3
}
