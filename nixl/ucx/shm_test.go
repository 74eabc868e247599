//go:build cgo && !gonixl_noucx

package ucx

import (
	"bytes"
	"math/rand"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gonixl/gonixl/nixl"
)

var shmParams = map[string]string{ParamErrMode: "none", ParamDataPath: "shm"}

// requireShmPeer fails unless agent a mapped at least one region of peer.
func requireShmPeer(t *testing.T, a nixl.Agent, peer string) {
	t.Helper()
	ag := a.(*agent)
	ag.mu.Lock()
	defer ag.mu.Unlock()
	p := ag.peers[peer]
	if p == nil {
		t.Fatalf("peer %q not loaded", peer)
	}
	for _, s := range p.shm {
		if s != nil {
			return
		}
	}
	t.Fatalf("no region of %q is mapped (shm: %q)", peer, p.shmWhy)
}

// mapsAt returns the /proc/self/maps entries overlapping [lo, hi).
func mapsAt(t *testing.T, lo, hi uint64) []vma {
	t.Helper()
	all, err := readMaps()
	if err != nil {
		t.Fatal(err)
	}
	var out []vma
	for _, v := range all {
		if v.end > lo && v.start < hi {
			out = append(out, v)
		}
	}
	return out
}

func isMemfd(v vma) bool { return strings.HasPrefix(v.path, "/memfd:gonixl-kv") }

// TestShmRegisterKeepsAddressAndBytes registers a region that starts and
// ends mid-page: its whole pages become a memfd mapping at the same
// addresses with the same bytes, the partial pages stay private, writes
// through the caller's pointer land in the file, and deregistration gives
// back private memory holding everything written meanwhile.
func TestShmRegisterKeepsAddressAndBytes(t *testing.T) {
	pg := int(pageSize)
	buf := mmapBuf(t, 8*pg)
	rng := rand.New(rand.NewSource(1))
	rng.Read(buf)
	for i := 3 * pg; i < 5*pg; i++ {
		buf[i] = 0 // zero pages are not copied, and must still read as zero
	}
	want := bytes.Clone(buf)
	base := addrOf(buf)
	r := nixl.Region{Addr: base + 100, Len: uint64(7*pg - 50)} // pages 1..6 whole
	a := newAgent(t, "shm-owner", shmParams, false)
	if err := a.RegisterMem(nixl.DRAM, []nixl.Region{r}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(buf, want) {
		t.Fatal("registration changed the region's bytes")
	}
	if addrOf(buf) != base {
		t.Fatal("address moved")
	}
	// Pages 1..6 from the memfd, pages 0 and 7 untouched.
	for _, v := range mapsAt(t, base, base+uint64(8*pg)) {
		inner := v.start >= base+uint64(pg) && v.end <= base+uint64(7*pg)
		if inner != isMemfd(v) {
			t.Errorf("mapping %#x-%#x %q: inner=%v memfd=%v", v.start, v.end, v.path, inner, isMemfd(v))
		}
	}
	md, err := a.LocalMetadata()
	if err != nil {
		t.Fatal(err)
	}
	m, err := decodeMetadata(md)
	if err != nil {
		t.Fatal(err)
	}
	sh := m.Regions[0].Shm
	if sh == nil || sh.Base != base+uint64(pg) || sh.Len != uint64(6*pg) {
		t.Fatalf("advertised shared range %+v, want %#x+%d", sh, base+uint64(pg), 6*pg)
	}
	if info := a.(*agent).Info(); !strings.Contains(info, "shm: 1 of 1 regions shared") {
		t.Errorf("Info does not report the shared region: %s", info)
	}
	// A write through the caller's pointer is in the file.
	buf[2*pg+7] = 0xA5
	want[2*pg+7] = 0xA5
	f, err := os.Open("/proc/self/fd/" + strconv.Itoa(int(sh.Fd)))
	if err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 1)
	if _, err := f.ReadAt(got, int64(pageSize)+int64(pg+7)); err != nil || got[0] != 0xA5 {
		t.Fatalf("memfd byte %x (%v), want a5", got, err)
	}
	f.Close()

	if err := a.DeregisterMem(nixl.DRAM, []nixl.Region{r}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(buf, want) {
		t.Fatal("deregistration lost bytes")
	}
	for _, v := range mapsAt(t, base, base+uint64(8*pg)) {
		if isMemfd(v) || v.perms != "rw-p" {
			t.Errorf("after deregistration %#x-%#x is %s %q, want private anonymous", v.start, v.end, v.perms, v.path)
		}
	}
	if _, err := os.Stat("/proc/self/fd/" + strconv.Itoa(int(sh.Fd))); err == nil {
		if l, _ := os.Readlink("/proc/self/fd/" + strconv.Itoa(int(sh.Fd))); strings.HasPrefix(l, "/memfd:gonixl-kv") {
			t.Errorf("memfd still open after deregistration: %s", l)
		}
	}
}

// TestShmLeavesOtherMemoryAlone: a MAP_SHARED region is registered as it
// is (moved by CMA) and Info says why.
func TestShmLeavesOtherMemoryAlone(t *testing.T) {
	n := 4 * int(pageSize)
	b, err := syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Munmap(b) }) // after the agent closes
	a := newAgent(t, "shm-shared", shmParams, false)
	if err := a.RegisterMem(nixl.DRAM, []nixl.Region{{Addr: addrOf(b), Len: uint64(n)}}); err != nil {
		t.Fatal(err)
	}
	info := a.(*agent).Info()
	if !strings.Contains(info, "shm: 0 of 1 regions shared") || !strings.Contains(info, "not private anonymous") {
		t.Errorf("Info: %s", info)
	}
	for _, v := range mapsAt(t, addrOf(b), addrOf(b)+uint64(n)) {
		if isMemfd(v) {
			t.Errorf("shared mapping was re-backed: %+v", v)
		}
	}
}

// shmPair is an owner agent with a registered, patterned, unaligned
// region, and a reader agent in the same process that loaded it.
type shmPair struct {
	owner, reader nixl.Agent
	src, dst      []byte
	region        nixl.Region
	remote, local nixl.DescList
	block         int
}

func newShmPair(t *testing.T, readerParams map[string]string) *shmPair {
	t.Helper()
	const block, blocks = 3000, 40 // blocks straddle pages
	p := &shmPair{block: block}
	p.src = mmapBuf(t, block*blocks+2*int(pageSize))
	p.dst = mmapBuf(t, block*blocks)
	rand.New(rand.NewSource(2)).Read(p.src)
	p.region = nixl.Region{Addr: addrOf(p.src) + 123, Len: block * blocks}
	p.owner = newAgent(t, "shm-pair-owner", shmParams, true)
	p.reader = newAgent(t, "shm-pair-reader", readerParams, false)
	if err := p.owner.RegisterMem(nixl.DRAM, []nixl.Region{p.region}); err != nil {
		t.Fatal(err)
	}
	if err := p.reader.RegisterMem(nixl.DRAM, []nixl.Region{{Addr: addrOf(p.dst), Len: uint64(len(p.dst))}}); err != nil {
		t.Fatal(err)
	}
	md, err := p.owner.LocalMetadata()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.reader.LoadRemoteMetadata(md); err != nil {
		t.Fatal(err)
	}
	rd, ld := make([]nixl.Desc, blocks), make([]nixl.Desc, blocks)
	for i := range rd {
		rd[i] = nixl.Desc{Addr: p.region.Addr + uint64(i*block), Len: block}
		ld[i] = nixl.Desc{Addr: addrOf(p.dst) + uint64(i*block), Len: block}
	}
	if p.remote, err = p.reader.PrepDescList("shm-pair-owner", nixl.DRAM, rd); err != nil {
		t.Fatal(err)
	}
	if p.local, err = p.reader.PrepDescList("", nixl.DRAM, ld); err != nil {
		t.Fatal(err)
	}
	return p
}

// xfer makes a transfer of every block, block i of one side to block
// perm[i] of the other, so that nothing coalesces.
func (p *shmPair) xfer(t *testing.T, op nixl.XferOp) (nixl.Xfer, []int32, []int32) {
	t.Helper()
	n := p.local.Len()
	li, ri := make([]int32, n), make([]int32, n)
	perm := rand.New(rand.NewSource(3)).Perm(n)
	for i := range li {
		li[i], ri[i] = int32(i), int32(perm[i])
	}
	x, err := p.reader.MakeXfer(op, p.local, li, p.remote, ri, []byte("shm"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { x.Release() })
	return x, li, ri
}

// run posts x, waits for it and checks that every local block li[i] equals
// remote block ri[i] afterwards.
func (p *shmPair) run(t *testing.T, what string, x nixl.Xfer, li, ri []int32) {
	t.Helper()
	if _, err := x.Post(); err != nil {
		t.Fatal(err)
	}
	if st, err := wait(t, x, p.owner, 30*time.Second); st != nixl.Success {
		t.Fatalf("%s: %v %v", what, st, err)
	}
	for i := range li {
		if !bytes.Equal(p.dstBlock(li[i]), p.srcBlock(ri[i])) {
			t.Fatalf("%s: local block %d differs from remote block %d", what, li[i], ri[i])
		}
	}
}

func (p *shmPair) srcBlock(i int32) []byte {
	off := int(p.region.Addr-addrOf(p.src)) + int(i)*p.block
	return p.src[off : off+p.block]
}

func (p *shmPair) dstBlock(i int32) []byte { return p.dst[int(i)*p.block : int(i+1)*p.block] }

// TestShmReadWriteUnaligned moves blocks that straddle page boundaries, at
// both ends of an unaligned region, by memcpy through the mapping and CMA
// for the partial pages, and checks every byte both ways.
func TestShmReadWriteUnaligned(t *testing.T) {
	p := newShmPair(t, shmParams)
	requireShmPeer(t, p.reader, "shm-pair-owner")
	if info := p.reader.(*agent).EndpointInfo(); !strings.Contains(info, "data path shm: 1 of 1 shared regions of shm-pair-owner mapped") {
		t.Errorf("EndpointInfo does not say the region is mapped:\n%s", info)
	}
	x, li, ri := p.xfer(t, nixl.Read)
	xi := x.(*xfer)
	if len(xi.shmOps) == 0 || len(xi.cmaOps) == 0 || len(xi.ctls) != 1 {
		t.Fatalf("split into %d memcpy and %d CMA operations, %d control pages; want both kinds and 1",
			len(xi.shmOps), len(xi.cmaOps), len(xi.ctls))
	}
	var moved uint64
	for _, o := range append(append([]op(nil), xi.shmOps...), xi.cmaOps...) {
		moved += o.len
	}
	if moved != xi.bytes {
		t.Fatalf("split operations move %d bytes, the transfer has %d", moved, xi.bytes)
	}
	p.run(t, "READ", x, li, ri)
	if n := waitNotif(t, p.owner, nil, 30*time.Second); n.Agent != "shm-pair-reader" || string(n.Msg) != "shm" {
		t.Fatalf("owner got notification %q from %q", n.Msg, n.Agent)
	}

	// WRITE back a new pattern.
	rand.New(rand.NewSource(4)).Read(p.dst)
	w, li, ri := p.xfer(t, nixl.Write)
	p.run(t, "WRITE", w, li, ri)
}

// TestShmRevokedRegionFails: once the owner deregisters a region, a reader
// that still has it mapped gets an error, not the bytes.
func TestShmRevokedRegionFails(t *testing.T) {
	p := newShmPair(t, shmParams)
	x, _, _ := p.xfer(t, nixl.Read)
	if err := p.owner.DeregisterMem(nixl.DRAM, []nixl.Region{p.region}); err != nil {
		t.Fatal(err)
	}
	st, err := x.Post()
	if st == nixl.InProgress {
		st, err = wait(t, x, p.owner, 30*time.Second)
	}
	if !st.IsError() || err == nil || !strings.Contains(err.Error(), "deregistered") {
		t.Fatalf("READ of a deregistered region: %v %v", st, err)
	}
}

// TestShmForgedMetadataFallsBack: metadata naming another file (wrong
// inode) or a wrong token is not mapped; the transfer moves by CMA and
// is still correct.
func TestShmForgedMetadataFallsBack(t *testing.T) {
	for _, c := range []struct {
		name  string
		forge func(*mdShm)
		why   string
	}{
		{"inode", func(s *mdShm) { s.Ino++ }, "not the advertised memfd"},
		{"token", func(s *mdShm) { s.Token ^= 1 << 40 }, "control page does not match"},
		{"fd", func(s *mdShm) { s.Fd = 0 }, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			src := mmapBuf(t, 16*int(pageSize))
			dst := mmapBuf(t, 16*int(pageSize))
			rand.New(rand.NewSource(5)).Read(src)
			owner := newAgent(t, "forge-owner", shmParams, true)
			reader := newAgent(t, "forge-reader", shmParams, false)
			if err := owner.RegisterMem(nixl.DRAM, []nixl.Region{{Addr: addrOf(src), Len: uint64(len(src))}}); err != nil {
				t.Fatal(err)
			}
			if err := reader.RegisterMem(nixl.DRAM, []nixl.Region{{Addr: addrOf(dst), Len: uint64(len(dst))}}); err != nil {
				t.Fatal(err)
			}
			md, _ := owner.LocalMetadata()
			m, err := decodeMetadata(md)
			if err != nil || m.Regions[0].Shm == nil {
				t.Fatalf("owner metadata: %v %+v", err, m)
			}
			c.forge(m.Regions[0].Shm)
			forged, err := m.encode()
			if err != nil {
				t.Fatal(err)
			}
			if _, err := reader.LoadRemoteMetadata(forged); err != nil {
				t.Fatal(err)
			}
			ra := reader.(*agent)
			ra.mu.Lock()
			pe := ra.peers["forge-owner"]
			mapped, why := pe.shm[0] != nil, pe.shmWhy
			ra.mu.Unlock()
			if mapped || why == "" || !strings.Contains(why, c.why) {
				t.Fatalf("forged %s: mapped=%v why=%q", c.name, mapped, why)
			}
			l, _ := reader.PrepDescList("", nixl.DRAM, []nixl.Desc{{Addr: addrOf(dst), Len: uint64(len(dst))}})
			r, _ := reader.PrepDescList("forge-owner", nixl.DRAM, []nixl.Desc{{Addr: addrOf(src), Len: uint64(len(src))}})
			x, err := reader.MakeXfer(nixl.Read, l, []int32{0}, r, []int32{0}, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer x.Release()
			if x.(*xfer).ctls != nil {
				t.Fatal("transfer uses a mapping that was refused")
			}
			if _, err := x.Post(); err != nil {
				t.Fatal(err)
			}
			if st, err := wait(t, x, owner, 30*time.Second); st != nixl.Success {
				t.Fatalf("READ: %v %v", st, err)
			}
			if !bytes.Equal(dst, src) {
				t.Fatal("CMA fallback READ data wrong")
			}
		})
	}
}

// TestShmReaderWithoutShm: a reader on data path cma or ucp reads a shared
// region correctly without mapping it.
func TestShmReaderWithoutShm(t *testing.T) {
	for _, dp := range []string{"cma", "ucp"} {
		t.Run(dp, func(t *testing.T) {
			p := newShmPair(t, map[string]string{ParamErrMode: "none", ParamDataPath: dp})
			x, li, ri := p.xfer(t, nixl.Read)
			if x.(*xfer).ctls != nil {
				t.Fatal("a non-shm reader mapped the region")
			}
			p.run(t, "READ", x, li, ri)
		})
	}
}

// TestShmSplit checks the split of operations against a mapped interior.
func TestShmSplit(t *testing.T) {
	s := &shmRemote{base: 0x10000, len: 0x3000, mapping: nil}
	shm := []*shmRemote{s, nil}
	ops := []op{
		{laddr: 0x100, raddr: 0xff00, len: 0x200, rkey: 0},  // head + interior
		{laddr: 0x900, raddr: 0x11000, len: 0x100, rkey: 0}, // interior only
		{laddr: 0xa00, raddr: 0x12f80, len: 0x100, rkey: 0}, // interior + tail
		{laddr: 0xb00, raddr: 0x20000, len: 0x10, rkey: 1},  // unmapped region
		{laddr: 0xc00, raddr: 0xf000, len: 0x4100, rkey: 0}, // head + all + tail
	}
	mem, cma, ctls := splitShm(ops, shm)
	var total, want uint64
	for _, o := range ops {
		want += o.len
	}
	for _, o := range mem {
		total += o.len
		r := o.raddr - pageSize // mapping at address 0: control page, then data
		if r >= s.len || r+o.len > s.len {
			t.Errorf("memcpy part %+v outside the mapping", o)
		}
	}
	for _, o := range cma {
		total += o.len
		if o.rkey == 0 && o.raddr < s.base+s.len && o.raddr+o.len > s.base {
			t.Errorf("CMA part %+v overlaps the mapped interior", o)
		}
	}
	if total != want || len(mem) != 4 || len(cma) != 5 || len(ctls) != 1 {
		t.Errorf("split into %d memcpy + %d CMA parts (%d bytes of %d), %d control pages", len(mem), len(cma), total, want, len(ctls))
	}
	if mem[0].laddr != 0x100+0x100 || mem[0].raddr != pageSize {
		t.Errorf("first interior part %+v, want laddr 0x200 at the data start", mem[0])
	}
}

// TestShmOverlappingRegions: a second registration over pages that are
// already shared is registered as it is, and both regions keep moving the
// right bytes.
func TestShmOverlappingRegions(t *testing.T) {
	pg := int(pageSize)
	buf := mmapBuf(t, 8*pg)
	rand.New(rand.NewSource(6)).Read(buf)
	a := newAgent(t, "shm-overlap", shmParams, false)
	r1 := nixl.Region{Addr: addrOf(buf), Len: uint64(6 * pg)}
	r2 := nixl.Region{Addr: addrOf(buf) + uint64(2*pg), Len: uint64(6 * pg)}
	if err := a.RegisterMem(nixl.DRAM, []nixl.Region{r1}); err != nil {
		t.Fatal(err)
	}
	if err := a.RegisterMem(nixl.DRAM, []nixl.Region{r2}); err != nil {
		t.Fatal(err)
	}
	info := a.(*agent).Info()
	if !strings.Contains(info, "shm: 1 of 2 regions shared") || !strings.Contains(info, "overlaps a region that is already shared") {
		t.Fatalf("Info: %s", info)
	}
	// r1's pages still come from r1's memfd.
	ag := a.(*agent)
	ag.mu.Lock()
	var ino uint64
	for _, lr := range ag.regions[nixl.DRAM] {
		if lr.shm != nil {
			ino = uint64(lr.shm.c.ino)
		}
	}
	ag.mu.Unlock()
	for _, v := range mapsAt(t, addrOf(buf), addrOf(buf)+uint64(6*pg)) {
		if v.inode != ino {
			t.Errorf("mapping %#x-%#x inode %d, want r1's memfd %d", v.start, v.end, v.inode, ino)
		}
	}
}
