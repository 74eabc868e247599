//go:build cgo && !gonixl_noucx

package ucx

/*
#include <stdlib.h>
#include <unistd.h>
#include "gxucx.h"
*/
import "C"

import (
	"bufio"
	"bytes"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"unsafe"

	"github.com/gonixl/gonixl/nixl"
)

// The "shm" data path.
//
// UCX reads memory it did not allocate at kernel-copy speed at best (CMA
// pins and copies page by page), while ucx_perftest on its own memory gets
// a plain memcpy out of a shared mapping. With data_path "shm" the engine
// gives the caller's memory that property without moving it:
//
//   - RegisterMem re-backs the page-aligned interior of each region with a
//     sealed memfd: chunk by chunk (64 MiB), non-zero pages are copied into
//     the file and the file is mapped MAP_FIXED|MAP_SHARED over the same
//     addresses. The tensor keeps its address and bytes; only its pages
//     become shared. The region must lie in private anonymous read-write
//     memory (what malloc, torch's CPU allocator and mmap(MAP_ANONYMOUS)
//     return); anything else is left alone and moves by CMA. The partial
//     pages at either end are not touched (they may hold a neighbour's
//     bytes) and move by CMA.
//   - The metadata carries, per shared region, the memfd's descriptor
//     number, inode, device, a random token and the shared range. A
//     same-host peer opens /proc/<pid>/fd/<fd>, checks inode, device, size,
//     seals (no shrinking: no SIGBUS) and the control page, and maps it.
//   - A READ or WRITE is then memcpy for the shared part and
//     process_vm_readv/writev for the ends, in one cgo call outside the
//     agent mutex; the notification follows through UCX as on every path.
//     Before and after the copy the engine checks the owner's control page
//     (revoked when the owner deregisters) and the owner's pidfd (exited),
//     so a transfer that overlaps either fails instead of succeeding.
//   - DeregisterMem and Close revoke the control page, map private
//     anonymous memory back over the range with the same contents (holes
//     stay unpopulated) and free the file, so the caller gets the memory as
//     it gave it. When the range is no longer mapped from the memfd (the
//     caller freed the memory before deregistering it), nothing is remapped.
//
// Differences a caller can observe while a region is registered this way:
// its pages are shared memory (Shmem in /proc/meminfo), so a fork() child
// shares them instead of copying on write; transparent huge pages follow
// the shmem policy (/sys/kernel/mm/transparent_hugepage/shmem_enabled), not
// the anonymous one; and a peer process that mapped it can write into it
// (as CMA lets it). Re-backing costs one read pass over the region and a
// copy of its non-zero pages at registration, and the copy back at
// deregistration.

// shmChunk bounds the memory a region occupies twice while it is re-backed.
const shmChunk = 64 << 20

var pageSize = uint64(C.gx_page_size())

// shmLocal is a registered region's shared interior.
type shmLocal struct {
	c         C.gx_shm_local
	base, len uint64
	token     uint64
}

func (s *shmLocal) md() *mdShm {
	return &mdShm{Fd: uint32(s.c.fd), Ino: uint64(s.c.ino), Dev: uint64(s.c.dev), Token: s.token, Base: s.base, Len: s.len}
}

// shmRemote is a peer region's shared interior mapped here: the control
// page, then the data.
type shmRemote struct {
	base, len uint64
	mapping   unsafe.Pointer
}

func (s *shmRemote) ctl() unsafe.Pointer { return s.mapping }

// addr translates a peer address inside [base, base+len) into the mapping.
func (s *shmRemote) addr(raddr uint64) uint64 {
	return uint64(uintptr(s.mapping)) + pageSize + (raddr - s.base)
}

// vma is one line of /proc/self/maps.
type vma struct {
	start, end uint64
	perms      string
	inode      uint64
	path       string
}

func readMaps() ([]vma, error) {
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []vma
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		// start-end perms offset dev inode [path]
		fs := strings.Fields(sc.Text())
		if len(fs) < 5 {
			continue
		}
		lo, hi, ok := strings.Cut(fs[0], "-")
		if !ok {
			continue
		}
		s, err1 := strconv.ParseUint(lo, 16, 64)
		e, err2 := strconv.ParseUint(hi, 16, 64)
		ino, err3 := strconv.ParseUint(fs[4], 10, 64)
		if err1 != nil || err2 != nil || err3 != nil {
			continue
		}
		v := vma{start: s, end: e, perms: fs[1], inode: ino}
		if len(fs) > 5 {
			v.path = strings.Join(fs[5:], " ")
		}
		out = append(out, v)
	}
	return out, sc.Err()
}

// cover calls ok for every mapping that overlaps [base, end) and reports
// whether those mappings cover it without a gap and ok held for each.
func cover(maps []vma, base, end uint64, ok func(vma) bool) bool {
	next := base
	for _, v := range maps {
		if v.end <= next || v.start >= end {
			continue
		}
		if v.start > next || !ok(v) {
			return false
		}
		next = v.end
		if next >= end {
			return true
		}
	}
	return false
}

func privateAnon(v vma) bool {
	if v.perms != "rw-p" || v.inode != 0 {
		return false
	}
	return v.path == "" || v.path == "[heap]" || strings.HasPrefix(v.path, "[anon:")
}

// interior returns the whole pages inside r.
func interior(r nixl.Region) (base, n uint64) {
	base = (r.Addr + pageSize - 1) &^ (pageSize - 1)
	end := (r.Addr + r.Len) &^ (pageSize - 1)
	if end <= base {
		return 0, 0
	}
	return base, end - base
}

// share re-backs r's interior. It returns nil and the reason when the
// region stays as it is (nothing was changed then).
func share(r nixl.Region, maps []vma) (*shmLocal, string) {
	base, n := interior(r)
	if n == 0 {
		return nil, "no whole page inside"
	}
	if !cover(maps, base, base+n, privateAnon) {
		return nil, "not private anonymous read-write memory"
	}
	s := &shmLocal{base: base, len: n, token: rand.Uint64() | 1}
	errBuf := (*C.char)(C.malloc(512))
	defer C.free(unsafe.Pointer(errBuf))
	if C.gx_shm_share(C.uint64_t(base), C.uint64_t(n), C.uint64_t(s.token), shmChunk, &s.c, errBuf, 512) != 0 {
		return nil, C.GoString(errBuf)
	}
	return s, ""
}

// unshare gives the caller's range back as private memory with its
// contents, unless it is no longer mapped from the memfd.
func unshare(s *shmLocal) error {
	if s == nil || s.c.fd < 0 {
		return nil
	}
	ino := uint64(s.c.ino)
	restore := 1
	var err error
	maps, merr := readMaps()
	if merr != nil || !cover(maps, s.base, s.base+s.len, func(v vma) bool {
		return v.inode == ino && strings.HasPrefix(v.path, "/memfd:gonixl-kv")
	}) {
		restore = 0
		err = fmt.Errorf("range %#x+%d is no longer mapped from its memfd (memory freed before deregistration?); left as is", s.base, s.len)
	}
	C.gx_shm_unshare(&s.c, C.uint64_t(s.base), C.uint64_t(s.len), shmChunk, C.int(restore))
	return err
}

// attachShm maps the shared interiors a same-host peer advertised. Regions
// that cannot be mapped are left to CMA; the first reason is kept in
// p.shmWhy. Called with a.mu held, on a peer whose earlier mappings are
// gone.
func attachShm(p *peer, regions []mdRegion) {
	p.shm = make([]*shmRemote, len(regions))
	if p.pidfd < 0 {
		p.pidfd = C.gx_pidfd_open(C.int(p.proc.Pid))
	}
	if dead, why := procDead(p.proc); dead {
		p.shmWhy = why
		return
	}
	errBuf := (*C.char)(C.malloc(512))
	defer C.free(unsafe.Pointer(errBuf))
	for i, r := range regions {
		sh := r.Shm
		if sh == nil || sh.Base%pageSize != 0 || sh.Len%pageSize != 0 {
			continue
		}
		var m unsafe.Pointer
		if C.gx_shm_attach(C.int(p.proc.Pid), C.int(sh.Fd), C.uint64_t(sh.Ino), C.uint64_t(sh.Dev),
			C.uint64_t(sh.Len), C.uint64_t(sh.Token), &m, errBuf, 512) != 0 {
			if p.shmWhy == "" {
				p.shmWhy = fmt.Sprintf("region %d: %s", i, C.GoString(errBuf))
			}
			continue
		}
		p.shm[i] = &shmRemote{base: sh.Base, len: sh.Len, mapping: m}
	}
	// Still the same process: the descriptors opened above were its own
	// (inode, device and token were checked as well).
	if dead, why := procDead(p.proc); dead {
		detachShm(p)
		p.shmWhy = why
	}
}

// detachShm unmaps a peer's regions. The caller holds a.copyMu for writing
// (no copy runs) and a.mu.
func detachShm(p *peer) {
	for _, s := range p.shm {
		if s != nil {
			C.gx_shm_detach(s.mapping, C.uint64_t(s.len))
		}
	}
	p.shm = nil
}

func (p *peer) closePidfd() {
	if p.pidfd >= 0 {
		C.close(p.pidfd)
		p.pidfd = -1
	}
}

// splitShm divides coalesced operations into the parts that lie in a peer
// region's mapped interior (remote address translated into the mapping)
// and the rest (CMA), and lists the control pages the transfer depends on.
func splitShm(ops []op, shm []*shmRemote) (mem, cma []op, ctls []unsafe.Pointer) {
	seen := map[*shmRemote]bool{}
	for _, o := range ops {
		var s *shmRemote
		if int(o.rkey) < len(shm) {
			s = shm[o.rkey]
		}
		lo, hi := o.raddr, o.raddr+o.len
		if s == nil || hi <= s.base || lo >= s.base+s.len {
			cma = append(cma, o)
			continue
		}
		if lo < s.base {
			cma = append(cma, op{laddr: o.laddr, raddr: lo, len: s.base - lo, rkey: o.rkey, memh: o.memh})
		}
		mlo, mhi := max(lo, s.base), min(hi, s.base+s.len)
		mem = append(mem, op{laddr: o.laddr + (mlo - lo), raddr: s.addr(mlo), len: mhi - mlo, rkey: o.rkey, memh: o.memh})
		if hi > s.base+s.len {
			cma = append(cma, op{laddr: o.laddr + (mhi - lo), raddr: mhi, len: hi - mhi, rkey: o.rkey, memh: o.memh})
		}
		if !seen[s] {
			seen[s] = true
			ctls = append(ctls, s.ctl())
		}
	}
	return mem, cma, ctls
}

// shmSummary describes how many of the agent's regions are shared, for Info.
func (a *agent) shmSummary() string {
	if !a.set.path.sharesMemory() {
		return ""
	}
	n, shared := 0, 0
	for _, rs := range a.regions {
		for _, r := range rs {
			n++
			if r.shm != nil {
				shared++
			}
		}
	}
	var b bytes.Buffer
	fmt.Fprintf(&b, "; shm: %d of %d regions shared", shared, n)
	if a.shmWhy != "" {
		fmt.Fprintf(&b, " (not shared: %s)", a.shmWhy)
	}
	return b.String()
}

// shmSummary says how many of the peer's regions are mapped here.
func (p *peer) shmSummary() string {
	n, mapped := 0, 0
	for _, r := range p.md {
		if r.Shm != nil {
			n++
		}
	}
	for _, s := range p.shm {
		if s != nil {
			mapped++
		}
	}
	out := fmt.Sprintf("data path shm: %d of %d shared regions of %s mapped, %d regions in all", mapped, n, p.name, len(p.md))
	if p.shmWhy != "" {
		out += " (" + p.shmWhy + ")"
	}
	return out
}

// copyShm moves the data of a transfer to a peer whose regions are mapped
// here: memcpy for the mapped parts and CMA for the rest. It runs without
// the agent mutex, with copyMu held for reading (startHostCopy).
func (x *xfer) copyShm() C.int {
	p := x.peer
	return C.gx_shm_post(C.int(p.proc.Pid), p.pidfd, C.int(x.op),
		opsPtr(x.shmOps), C.size_t(len(x.shmOps)), opsPtr(x.cmaOps), C.size_t(len(x.cmaOps)),
		ctlsPtr(x.ctls), C.size_t(len(x.ctls)))
}

func opsPtr(o []op) *C.gx_iov {
	if len(o) == 0 {
		return nil
	}
	return (*C.gx_iov)(unsafe.Pointer(&o[0]))
}

func ctlsPtr(c []unsafe.Pointer) *unsafe.Pointer {
	if len(c) == 0 {
		return nil
	}
	return &c[0]
}
