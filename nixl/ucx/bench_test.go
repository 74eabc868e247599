//go:build cgo && !gonixl_noucx

package ucx

import (
	"slices"
	"testing"
	"time"

	"github.com/gonixl/gonixl/nixl"
)

// BenchmarkRead64 measures a 64-descriptor scattered READ between two
// agents in this process (go test -bench Read64 ./nixl/ucx).
func BenchmarkRead64(b *testing.B) {
	for _, blk := range []int{32 << 10, 1 << 20} {
		b.Run(sizeName(blk), func(b *testing.B) {
			const n = 64
			p := newPair(b, 2*n*blk, map[string]string{ParamErrMode: "none"}, false)
			ld, rd := make([]nixl.Desc, 2*n), make([]nixl.Desc, 2*n)
			for i := range ld {
				ld[i] = nixl.Desc{Addr: addrOf(p.bufA) + uint64(i*blk), Len: uint64(blk)}
				rd[i] = nixl.Desc{Addr: addrOf(p.bufB) + uint64(i*blk), Len: uint64(blk)}
			}
			l, _ := p.a.PrepDescList("", nixl.DRAM, ld)
			r, _ := p.a.PrepDescList("B", nixl.DRAM, rd)
			li, ri := make([]int32, n), make([]int32, n)
			for i := range li {
				li[i], ri[i] = int32(2*i), int32(2*i+1)
			}
			x, err := p.a.MakeXfer(nixl.Read, l, li, r, ri, nil)
			if err != nil {
				b.Fatal(err)
			}
			b.SetBytes(int64(n * blk))
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				x.Post()
				if st, err := wait(b, x, p.b, time.Minute); st != nixl.Success {
					b.Fatal(st, err)
				}
			}
		})
	}
}

func sizeName(n int) string {
	if n >= 1<<20 {
		return itoa(n>>20) + "MiB"
	}
	return itoa(n>>10) + "KiB"
}

func itoa(n int) string {
	s := ""
	for {
		s = string(rune('0'+n%10)) + s
		n /= 10
		if n == 0 {
			return s
		}
	}
}

// BenchmarkPrepDescList prepares a remote descriptor list of a large
// model's shape — 160 regions (80 layers, K and V) x 10,000 blocks = 1.6M
// descriptors, and 160 x 512 = 82k — against a peer that registered 160
// regions (blocks of 64 bytes here: the cost is per descriptor, not per
// byte). go test -run XXX -bench PrepDescList ./nixl/ucx
func BenchmarkPrepDescList(b *testing.B) {
	for _, blocks := range []int{512, 10000} {
		b.Run(itoa(160*blocks)+"descs", func(b *testing.B) {
			const regions, blk = 160, 64
			a, peer := newAgent(b, "A", nil, false), newAgent(b, "B", nil, false)
			var descs []nixl.Desc
			for r := 0; r < regions; r++ {
				buf := mmapBuf(b, blocks*blk)
				if err := peer.RegisterMem(nixl.DRAM, []nixl.Region{{Addr: addrOf(buf), Len: uint64(blocks * blk)}}); err != nil {
					b.Fatal(err)
				}
				for i := 0; i < blocks; i++ {
					descs = append(descs, nixl.Desc{Addr: addrOf(buf) + uint64(i*blk), Len: blk / 2})
				}
			}
			md, err := peer.LocalMetadata()
			if err != nil {
				b.Fatal(err)
			}
			if _, err := a.LoadRemoteMetadata(md); err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				l, err := a.PrepDescList("B", nixl.DRAM, descs)
				if err != nil {
					b.Fatal(err)
				}
				_ = l.Release()
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(len(descs)), "ns/desc")
		})
		// The same list as strided runs (one per region), not expanded.
		b.Run(itoa(160*blocks)+"descs-strided", func(b *testing.B) {
			const regions, blk = 160, 64
			a, peer := newAgent(b, "A", nil, false), newAgent(b, "B", nil, false)
			var runs []nixl.Strided
			for r := 0; r < regions; r++ {
				buf := mmapBuf(b, blocks*blk)
				if err := peer.RegisterMem(nixl.DRAM, []nixl.Region{{Addr: addrOf(buf), Len: uint64(blocks * blk)}}); err != nil {
					b.Fatal(err)
				}
				runs = append(runs, nixl.Strided{Addr: addrOf(buf), Stride: blk, Len: blk / 2, Count: uint64(blocks)})
			}
			md, err := peer.LocalMetadata()
			if err != nil {
				b.Fatal(err)
			}
			if _, err := a.LoadRemoteMetadata(md); err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				l, err := nixl.PrepStrided(a, "B", nixl.DRAM, runs)
				if err != nil {
					b.Fatal(err)
				}
				_ = l.Release()
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(regions*blocks), "ns/desc")
		})
	}
}

// BenchmarkPostShare14MiB is libnixl's benchmark of the same name for this
// engine, per data path: a 14 MiB READ (224 scattered blocks of 64 KiB,
// with a notification) between two agents of this process, progress
// threads on; post-µs against xfer-µs (post start to completion), medians.
// cma and shm copy on their own goroutine (startHostCopy): Post returns at
// once. go test -run XXX -bench PostShare ./nixl/ucx
func BenchmarkPostShare14MiB(b *testing.B) {
	for _, path := range []string{"cma", "ucp", "shm"} {
		b.Run(path, func(b *testing.B) {
			const blk, n = 64 << 10, 224
			p := newPair(b, 2*n*blk, map[string]string{ParamDataPath: path}, true)
			ld, rd := make([]nixl.Desc, 2*n), make([]nixl.Desc, 2*n)
			for i := range ld {
				ld[i] = nixl.Desc{Addr: addrOf(p.bufA) + uint64(i*blk), Len: uint64(blk)}
				rd[i] = nixl.Desc{Addr: addrOf(p.bufB) + uint64(i*blk), Len: uint64(blk)}
			}
			l, err := p.a.PrepDescList("", nixl.DRAM, ld)
			if err != nil {
				b.Fatal(err)
			}
			r, err := p.a.PrepDescList("B", nixl.DRAM, rd)
			if err != nil {
				b.Fatal(err)
			}
			li, ri := make([]int32, n), make([]int32, n)
			for i := range li {
				li[i], ri[i] = int32(2*i), int32(2*i+1)
			}
			x, err := p.a.MakeXfer(nixl.Read, l, li, r, ri, []byte("n"))
			if err != nil {
				b.Fatal(err)
			}
			b.SetBytes(int64(n * blk))
			var posts, xfers []time.Duration
			b.ResetTimer()
			for b.Loop() {
				t0 := time.Now()
				if _, err := x.Post(); err != nil {
					b.Fatal(err)
				}
				t1 := time.Now()
				if st, err := wait(b, x, p.b, time.Minute); st != nixl.Success {
					b.Fatal(st, err)
				}
				posts, xfers = append(posts, t1.Sub(t0)), append(xfers, time.Since(t0))
			}
			b.ReportMetric(medianMicros(posts), "post-µs")
			b.ReportMetric(medianMicros(xfers), "xfer-µs")
		})
	}
}

func medianMicros(d []time.Duration) float64 {
	s := slices.Clone(d)
	slices.Sort(s)
	return float64(s[len(s)/2].Nanoseconds()) / 1e3
}
