//go:build cgo && !gonixl_noucx

package ucx

/*
#include <stdlib.h>
#include "gxucx.h"
#include "gxcuda.h"
*/
import "C"

import (
	"bytes"
	"fmt"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/gonixl/gonixl/nixl"
)

// Padding appended to the C copies of peer-supplied address and rkey bytes:
// UCX parses them by their inner lengths, and a short read past the end
// then stays inside our allocation.
const parsePad = 256

// Bounds on the waits of teardown.
const (
	flushTimeoutMs = 1000
	closeTimeoutMs = 1000
)

type localRegion struct {
	nixl.Region
	memh uint32    // index into agent.memhs; for VRAM the device ordinal (no UCX registration)
	rkey []byte    // packed rkey, published in the metadata
	shm  *shmLocal // data path shm: the interior re-backed by a memfd
	cuda *mdCuda   // VRAM: the CUDA IPC export of its allocation (cuda.go)
}

type remoteRegion struct {
	mem            nixl.MemType
	addr, len, dev uint64
	rkey           uint32 // index into peer.rkeys
}

type peer struct {
	name    string
	addr    []byte
	ep      *C.gx_ep
	regions []remoteRegion // sorted by (mem, addr)
	rkeys   []C.ucp_rkey_h
	retired []C.ucp_rkey_h // from earlier loads, destroyed at teardown
	gen     uint64

	proc  procID
	local bool // same host: liveness checked through /proc
	// sameNet: same host and network namespace; only such a peer's data
	// moves by host copy (cma, shm). One in another network namespace is
	// treated as another host (tests/e2e's netns hosts cut links between them).
	sameNet  bool
	lastLive time.Time
	dead     bool
	deadWhy  string
	noCMA    bool // the kernel denied cross-memory attach to this peer
	// established: a transfer to it completed, so its endpoint is wired
	// up and may be force-closed (see teardownPeer).
	established bool
	md          []mdRegion // regions as last loaded, to recognise a reload

	// Data path shm: the peer's shared regions mapped here (by rkey index,
	// nil where not mapped), a pidfd of its process (-1 if none), and why
	// a region could not be mapped.
	shm    []*shmRemote
	pidfd  C.int
	shmWhy string

	cuda *cudaPeer // the peer's VRAM allocations mapped here (cuda.go), nil if none
}

func sameRegions(a, b []mdRegion) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		x, y := a[i], b[i]
		if x.Mem != y.Mem || x.Addr != y.Addr || x.Len != y.Len || x.DevID != y.DevID || !bytes.Equal(x.Rkey, y.Rkey) {
			return false
		}
		if (x.Shm == nil) != (y.Shm == nil) || (x.Shm != nil && *x.Shm != *y.Shm) {
			return false
		}
		if (x.Cuda == nil) != (y.Cuda == nil) || (x.Cuda != nil && *x.Cuda != *y.Cuda) {
			return false
		}
	}
	return true
}

// checkDead reports whether the peer is known dead, looking at /proc (at
// most every livenessPeriod) when it runs on this host.
func (p *peer) checkDead(now time.Time) bool {
	if p.dead || !p.local || now.Sub(p.lastLive) < livenessPeriod {
		return p.dead
	}
	p.lastLive = now
	p.dead, p.deadWhy = procDead(p.proc)
	return p.dead
}

// The optional capabilities this engine's agent (and transfer) provides (nixl/capabilities.go).
var (
	_ nixl.Agent             = (*agent)(nil)
	_ nixl.StridedPreparer   = (*agent)(nil)
	_ nixl.Describer         = (*agent)(nil)
	_ nixl.EndpointDescriber = (*agent)(nil)
	_ nixl.NotifDropCounter  = (*agent)(nil)
	_ nixl.Lander            = (*xfer)(nil)
)

// agent implements nixl.Agent over one UCP context and one worker. mu
// guards all fields and every call into C that touches the worker.
type agent struct {
	name      string
	set       settings
	telemetry bool

	mu sync.Mutex
	// copyMu is held for reading by a shm post while it copies outside mu,
	// and for writing (with mu) by whatever unmaps a peer's regions or
	// restores local ones.
	copyMu    sync.RWMutex
	copies    sync.WaitGroup // host copies running outside mu (startHostCopy); Close waits for them
	shmWhy    string         // why a local region was not shared (the first reason)
	c         *C.gx_agent
	closing   bool
	closed    bool
	addr      []byte
	regions   map[nixl.MemType][]*localRegion // sorted by Addr
	memhs     []C.ucp_mem_h                   // nil once deregistered; slots are never reused
	localGen  uint64
	peers     map[string]*peer
	gen       uint64
	selfGen   uint64 // localGen the loopback peer was built from
	graveyard []*C.gx_ep
	retiring  []*retiring // invalidated peers whose endpoint is still flushing or closing
	xfers     map[*xfer]struct{}
	epInfo    string
	epPeer    string // the peer epInfo describes
	dropped   uint64
	prog      *progressThread
	progFault atomic.Pointer[string] // set when the progress thread panicked; reported once
	polled    time.Time              // last progress by a caller (Check), see progress.go
	// CUDA devices opened for VRAM regions (cuda.go); peers' VRAM is
	// mapped into cudaMain, the first one.
	cudaDevs map[int]*C.gx_cuda_dev
	cudaMain *C.gx_cuda_dev
}

func (e *engine) NewAgent(cfg nixl.AgentConfig) (nixl.Agent, error) {
	if err := e.Available(); err != nil {
		return nil, err
	}
	set, err := resolveSettings(cfg, os.Getenv)
	if err != nil {
		return nil, err
	}
	cname := C.CString(cfg.Name)
	defer C.free(unsafe.Pointer(cname))
	ccfg := C.CString(strings.Join(set.ucxCfg, "\n"))
	defer C.free(unsafe.Pointer(ccfg))
	errBuf := (*C.char)(C.malloc(1024))
	defer C.free(unsafe.Pointer(errBuf))
	wakeup := C.int(0)
	if cfg.ProgressThread {
		wakeup = 1
	}
	c := C.gx_agent_create(cname, ccfg, wakeup, errBuf, 1024)
	if c == nil {
		return nil, &nixl.Error{Status: nixl.ErrBackend, Op: "NewAgent", Msg: C.GoString(errBuf)}
	}
	var p unsafe.Pointer
	var n C.size_t
	if rc := C.gx_worker_address(c, &p, &n); rc != 0 {
		C.gx_agent_destroy(c)
		return nil, rcError(C.int(rc), "NewAgent", "worker address")
	}
	a := &agent{
		name:      cfg.Name,
		set:       set,
		telemetry: cfg.Telemetry,
		c:         c,
		addr:      C.GoBytes(p, C.int(n)),
		regions:   map[nixl.MemType][]*localRegion{},
		peers:     map[string]*peer{},
		xfers:     map[*xfer]struct{}{},
	}
	C.free(p)
	if cfg.ProgressThread {
		pt, err := startProgress(a, int(c.efd))
		if err != nil {
			C.gx_agent_destroy(c)
			return nil, &nixl.Error{Status: nixl.ErrBackend, Op: "NewAgent", Msg: "progress thread", Err: err}
		}
		a.prog = pt
	}
	return a, nil
}

func (a *agent) Name() string   { return a.name }
func (a *agent) Engine() string { return EngineName }

// Info describes the agent's UCX setup in one line, for the caller's log.
func (a *agent) Info() string {
	prog := "progress in Check/GetNotifs"
	if a.prog != nil {
		prog = "progress thread"
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	return fmt.Sprintf("%s; agent %s: %s, %s%s", theEngine.Info(), a.name, a.set, prog, a.shmSummary())
}

// EndpointInfo returns UCX's description (ucp_ep_print_info) of the first
// endpoint this agent created: the transports and lanes UCX selected. It is
// "" until remote metadata has been loaded. Log it at info level: a
// same-host peer on tcp instead of shared memory shows up here.
func (a *agent) EndpointInfo() string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.epInfo
}

// DroppedNotifs counts received notifications that were malformed or too
// large and therefore discarded.
func (a *agent) DroppedNotifs() uint64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.dropped
}

func (a *agent) checkOpen(op string) error {
	if a.closed || a.closing {
		return nixl.Errorf(nixl.ErrInvalidParam, op, "agent %s is closed", a.name)
	}
	return nil
}

func validRegion(r nixl.Region) error {
	if r.Len == 0 {
		return fmt.Errorf("region at %#x has zero length", r.Addr)
	}
	if r.Addr == 0 {
		return fmt.Errorf("region has a null address")
	}
	if r.Addr+r.Len < r.Addr {
		return fmt.Errorf("region %#x+%d wraps around", r.Addr, r.Len)
	}
	return nil
}

func (a *agent) RegisterMem(mem nixl.MemType, regions []nixl.Region) error {
	const op = "RegisterMem"
	if mem != nixl.DRAM && mem != nixl.VRAM {
		return nixl.Errorf(nixl.ErrNotSupported, op, "the ucx engine registers DRAM and VRAM only, not %v", mem)
	}
	if len(regions) == 0 {
		return nixl.Errorf(nixl.ErrInvalidParam, op, "no regions")
	}
	for _, r := range regions {
		if err := validRegion(r); err != nil {
			return &nixl.Error{Status: nixl.ErrInvalidParam, Op: op, Msg: err.Error()}
		}
	}
	if mem == nixl.VRAM {
		return a.registerVRAM(regions)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.checkOpen(op); err != nil {
		return err
	}
	var maps []vma
	if a.set.path.sharesMemory() {
		var err error
		if maps, err = readMaps(); err != nil && a.shmWhy == "" {
			a.shmWhy = "reading /proc/self/maps: " + err.Error()
		}
	}
	var done []*localRegion
	for _, r := range regions {
		if a.findExact(mem, r) >= 0 {
			a.rollback(done)
			return nixl.Errorf(nixl.ErrInvalidParam, op, "region %#x+%d dev %d is already registered", r.Addr, r.Len, r.DevID)
		}
		// Re-back before UCX sees the memory, so it never registers the
		// pages being replaced.
		var sh *shmLocal
		if maps != nil {
			var why string
			if a.overlapsShared(r) {
				why = "overlaps a region that is already shared"
			} else {
				sh, why = share(r, maps)
			}
			if sh == nil && a.shmWhy == "" {
				a.shmWhy = fmt.Sprintf("region %#x+%d: %s", r.Addr, r.Len, why)
			}
		}
		var memh C.ucp_mem_h
		var rk unsafe.Pointer
		var rkLen C.size_t
		rc := C.gx_mem_map(a.c, C.uint64_t(r.Addr), C.uint64_t(r.Len), &memh, &rk, &rkLen)
		if rc != 0 {
			_ = unshare(sh)
			a.rollback(done)
			return rcError(rc, op, fmt.Sprintf("ucp_mem_map(%#x, %d)", r.Addr, r.Len))
		}
		lr := &localRegion{Region: r, memh: uint32(len(a.memhs)), rkey: C.GoBytes(rk, C.int(rkLen)), shm: sh}
		C.free(rk)
		if len(lr.rkey) == 0 || len(lr.rkey) > maxRkeyLen {
			C.gx_mem_unmap(a.c, memh)
			_ = unshare(sh)
			a.rollback(done)
			return nixl.Errorf(nixl.ErrBackend, op, "packed rkey of %d bytes", len(lr.rkey))
		}
		a.memhs = append(a.memhs, memh)
		a.insertLocal(mem, lr)
		done = append(done, lr)
	}
	a.localGen++
	return nil
}

// overlapsShared reports whether r's whole pages meet a registered region's
// shared range: re-backing them again would detach that region's memfd
// (and its peers' mappings) from the memory.
func (a *agent) overlapsShared(r nixl.Region) bool {
	base, n := interior(r)
	for _, rs := range a.regions {
		for _, lr := range rs {
			if s := lr.shm; s != nil && base < s.base+s.len && s.base < base+n {
				return true
			}
		}
	}
	return false
}

// rollback unmaps regions registered by a failing RegisterMem call.
func (a *agent) rollback(done []*localRegion) {
	for _, lr := range done {
		a.removeLocal(nixl.DRAM, lr)
		C.gx_mem_unmap(a.c, a.memhs[lr.memh])
		a.memhs[lr.memh] = nil
		_ = a.unshareLocal(lr)
	}
}

// unshareLocal gives a deregistered region's memory back as private
// memory (data path shm), with no copy running.
func (a *agent) unshareLocal(lr *localRegion) error {
	if lr.shm == nil {
		return nil
	}
	a.copyMu.Lock()
	defer a.copyMu.Unlock()
	err := unshare(lr.shm)
	lr.shm = nil
	return err
}

func (a *agent) insertLocal(mem nixl.MemType, lr *localRegion) {
	rs := a.regions[mem]
	i := sort.Search(len(rs), func(i int) bool { return rs[i].Addr > lr.Addr })
	rs = append(rs, nil)
	copy(rs[i+1:], rs[i:])
	rs[i] = lr
	a.regions[mem] = rs
}

func (a *agent) removeLocal(mem nixl.MemType, lr *localRegion) {
	rs := a.regions[mem]
	for i, x := range rs {
		if x == lr {
			a.regions[mem] = append(rs[:i], rs[i+1:]...)
			return
		}
	}
}

func (a *agent) findExact(mem nixl.MemType, r nixl.Region) int {
	for i, x := range a.regions[mem] {
		if x.Region == r {
			return i
		}
	}
	return -1
}

func (a *agent) DeregisterMem(mem nixl.MemType, regions []nixl.Region) error {
	const op = "DeregisterMem"
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.checkOpen(op); err != nil {
		return err
	}
	// All or nothing: every region must match a registration exactly.
	for _, r := range regions {
		if a.findExact(mem, r) < 0 {
			return nixl.Errorf(nixl.ErrNotFound, op, "region %#x+%d dev %d (%v) is not registered", r.Addr, r.Len, r.DevID, mem)
		}
	}
	var last error
	for _, r := range regions {
		i := a.findExact(mem, r)
		if i < 0 {
			continue // listed twice
		}
		lr := a.regions[mem][i]
		a.removeLocal(mem, lr)
		if lr.cuda != nil {
			continue // not registered with UCX; the export needs no undoing
		}
		if rc := C.gx_mem_unmap(a.c, a.memhs[lr.memh]); rc != 0 {
			last = rcError(rc, op, "ucp_mem_unmap")
		}
		a.memhs[lr.memh] = nil
		if err := a.unshareLocal(lr); err != nil {
			last = &nixl.Error{Status: nixl.ErrBackend, Op: op, Msg: err.Error()}
		}
	}
	a.localGen++
	return last
}

func (a *agent) LocalMetadata() ([]byte, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.checkOpen("LocalMetadata"); err != nil {
		return nil, err
	}
	return a.localMetadataLocked()
}

func (a *agent) localMetadataLocked() ([]byte, error) {
	v := theEngine.version
	m := metadata{
		UCXVersion: uint32(v[0])<<16 | uint32(v[1])<<8 | uint32(v[2]),
		Name:       a.name,
		Address:    a.addr,
		Proc:       thisProc(),
	}
	mems := make([]int, 0, len(a.regions))
	for mem := range a.regions {
		mems = append(mems, int(mem))
	}
	sort.Ints(mems)
	for _, mem := range mems {
		for _, lr := range a.regions[nixl.MemType(mem)] {
			g := mdRegion{Mem: nixl.MemType(mem), Addr: lr.Addr, Len: lr.Len, DevID: lr.DevID, Rkey: lr.rkey, Cuda: lr.cuda}
			if lr.shm != nil {
				g.Shm = lr.shm.md()
			}
			m.Regions = append(m.Regions, g)
		}
	}
	b, err := m.encode()
	if err != nil {
		return nil, &nixl.Error{Status: nixl.ErrBackend, Op: "LocalMetadata", Msg: err.Error()}
	}
	return b, nil
}

func (a *agent) LoadRemoteMetadata(md []byte) (string, error) {
	const op = "LoadRemoteMetadata"
	m, err := decodeMetadata(md)
	if err != nil {
		return "", &nixl.Error{Status: nixl.ErrInvalidParam, Op: op, Msg: err.Error()}
	}
	if m.Name == a.name {
		return "", nixl.Errorf(nixl.ErrInvalidParam, op, "metadata of agent %q is this agent's own", m.Name)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.checkOpen(op); err != nil {
		return "", err
	}
	if err := a.loadLocked(m); err != nil {
		return "", err
	}
	return m.Name, nil
}

// cBytes copies b into C memory with parsePad zero bytes after it.
func cBytes(b []byte) unsafe.Pointer {
	p := C.calloc(C.size_t(len(b)+parsePad), 1)
	if p != nil && len(b) > 0 {
		copy(unsafe.Slice((*byte)(p), len(b)), b)
	}
	return p
}

func (a *agent) loadLocked(m *metadata) error {
	const op = "LoadRemoteMetadata"
	p := a.peers[m.Name]
	if p != nil && !bytes.Equal(p.addr, m.Address) {
		var st C.int
		p.lastLive = time.Time{}
		if C.gx_ep_failed(p.ep, &st) == 0 && !p.checkDead(time.Now()) {
			return nixl.Errorf(nixl.ErrNotAllowed, op,
				"agent %q is loaded with another worker address; invalidate it first", m.Name)
		}
		// The old incarnation failed or exited: this is a restarted peer.
		a.teardownPeer(p)
		delete(a.peers, m.Name)
		p = nil
	}
	if p != nil && sameRegions(p.md, m.Regions) {
		// A re-handshake with unchanged metadata: keep the rkeys, and the
		// lists and transfers prepared against them stay valid.
		return nil
	}
	fresh := p == nil
	if fresh {
		ca := cBytes(m.Address)
		if ca == nil {
			return nixl.Errorf(nixl.ErrBackend, op, "out of memory")
		}
		errBuf := (*C.char)(C.malloc(1024))
		pm := a.set.peerModeFor(m.Proc)
		peerMode, modeName := C.int(0), "none"
		if pm {
			peerMode, modeName = 1, "peer"
		}
		ep := C.gx_ep_create(a.c, ca, C.size_t(len(m.Address)), peerMode, errBuf, 1024)
		C.free(ca)
		if ep == nil {
			msg := C.GoString(errBuf)
			C.free(unsafe.Pointer(errBuf))
			if !pm {
				return nixl.Errorf(nixl.ErrBackend, op, "connect to %q: %s", m.Name, msg)
			}
			return nixl.Errorf(nixl.ErrBackend, op,
				"connect to %q: %s (error handling mode peer needs a transport with peer-failure detection; UCX 1.13's shared-memory transports have none: add tcp to UCX_TLS or set %s=none)",
				m.Name, msg, ParamErrMode)
		}
		C.free(unsafe.Pointer(errBuf))
		p = &peer{name: m.Name, addr: m.Address, ep: ep, proc: m.Proc, local: sameHost(m.Proc), sameNet: sameNetwork(m.Proc), pidfd: -1}
		if a.epInfo == "" {
			if s := C.gx_ep_info(ep); s != nil {
				a.epPeer = m.Name
				a.epInfo = fmt.Sprintf("ucx endpoint %s -> %s (error handling %s, setting %s):\n%s", a.name, m.Name, modeName, a.set.errMode, strings.TrimRight(C.GoString(s), "\n"))
				C.free(unsafe.Pointer(s))
			}
		}
	}
	rkeys := make([]C.ucp_rkey_h, 0, len(m.Regions))
	regions := make([]remoteRegion, 0, len(m.Regions))
	for i, r := range m.Regions {
		if len(r.Rkey) == 0 { // VRAM offered through CUDA IPC only
			regions = append(regions, remoteRegion{mem: r.Mem, addr: r.Addr, len: r.Len, dev: r.DevID, rkey: uint32(len(rkeys))})
			rkeys = append(rkeys, nil)
			continue
		}
		ck := cBytes(r.Rkey)
		if ck == nil {
			a.destroyRkeys(rkeys)
			return nixl.Errorf(nixl.ErrBackend, op, "out of memory")
		}
		var rk C.ucp_rkey_h
		rc := C.gx_rkey_unpack(p.ep, ck, C.size_t(len(r.Rkey)), &rk)
		C.free(ck)
		if rc != 0 {
			a.destroyRkeys(rkeys)
			if fresh {
				a.teardownPeer(p)
			}
			return rcError(rc, op, fmt.Sprintf("agent %q region %d: ucp_ep_rkey_unpack", m.Name, i))
		}
		regions = append(regions, remoteRegion{mem: r.Mem, addr: r.Addr, len: r.Len, dev: r.DevID, rkey: uint32(len(rkeys))})
		rkeys = append(rkeys, rk)
	}
	sort.Slice(regions, func(i, j int) bool {
		if regions[i].mem != regions[j].mem {
			return regions[i].mem < regions[j].mem
		}
		return regions[i].addr < regions[j].addr
	})
	// Map the peer's VRAM before anything of the new load is kept; the
	// previous mappings go once no copy runs through them.
	old := p.cuda
	p.cuda = nil
	if err := a.attachCuda(p, m.Regions, m.Name == a.name); err != nil {
		p.cuda = old
		a.destroyRkeys(rkeys)
		if fresh {
			a.teardownPeer(p)
		}
		return nixl.Errorf(nixl.ErrNotSupported, op, "%v", err)
	}
	if old != nil {
		a.copyMu.Lock()
		a.closeCuda(old)
		a.copyMu.Unlock()
	}
	// Transfers made against the previous load keep pointers to its rkeys
	// until they are checked again; retire rather than destroy them.
	p.retired = append(p.retired, p.rkeys...)
	p.rkeys = rkeys
	p.regions = regions
	p.md = m.Regions
	if a.set.path.sharesMemory() && p.local {
		a.copyMu.Lock()
		detachShm(p)
		p.shmWhy = ""
		attachShm(p, m.Regions)
		a.copyMu.Unlock()
		if fresh && a.epPeer == m.Name {
			a.epInfo += "\n" + p.shmSummary()
		}
	}
	a.gen++
	p.gen = a.gen
	a.peers[m.Name] = p
	return nil
}

func (a *agent) destroyRkeys(rk []C.ucp_rkey_h) {
	for _, r := range rk {
		if r != nil {
			C.gx_rkey_destroy(r)
		}
	}
}

// teardownPeer releases a peer in UCX's order: flush the endpoint, destroy
// its rkeys, close it. When a live endpoint cannot be flushed in time the
// rkeys are leaked rather than destroyed under outstanding operations.
func (a *agent) teardownPeer(p *peer) {
	var st C.int
	force := C.int(0)
	if p.dead {
		// Operations towards a dead process never complete: no flush, and
		// the rkeys they reference are leaked; the close is forced.
		force = 1
	} else if rc := C.gx_ep_flush(a.c, p.ep, flushTimeoutMs); rc <= 0 || C.gx_ep_failed(p.ep, &st) != 0 {
		a.destroyRkeys(p.rkeys)
		a.destroyRkeys(p.retired)
	} else if p.established {
		// Operations still in flight after the flush timeout (a peer
		// that stopped answering, a cut link): in error mode peer a
		// forced close completes them (canceled), and the peer's late
		// answers are dropped, so no GET lands in local memory after its
		// transfer was given up (a graceful close leaves them running
		// inside UCX). In error mode none UCX 1.13 leaves them
		// outstanding even then (TestGivenUpReadNeverLandsLate/sm-none):
		// their transfers stay busy (Release refuses) until the peer
		// answers or is found dead. Only on an endpoint known to be wired
		// up: UCX 1.13 aborts the process (wireup_ep.c assertion) when it
		// force-closes one whose wireup is still pending; there too the
		// transfers stay busy until their operations end on their own.
		// Their rkeys are leaked (the ops may reference them).
		force = 1
	}
	p.rkeys, p.retired, p.regions = nil, nil, nil
	a.copyMu.Lock()
	detachShm(p)
	a.detachCuda(p)
	a.copyMu.Unlock()
	p.closePidfd()
	C.gx_ep_close(a.c, p.ep, force, closeTimeoutMs)
	// Transfers may still hold the gx_ep; it is freed with the agent.
	a.graveyard = append(a.graveyard, p.ep)
	p.gen = 0
}

// InvalidateRemote forgets a peer at once (a new load of the same name gets
// a new endpoint) and retires its endpoint in the background: the flush and
// close that teardownPeer waits for advance with the agent's progress
// (advanceRetiringLocked), so the caller -- vLLM's model thread, through the
// worker -- never waits for a peer that stopped answering.
func (a *agent) InvalidateRemote(name string) error {
	const op = "InvalidateRemote"
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.checkOpen(op); err != nil {
		return err
	}
	p := a.peers[name]
	if p == nil {
		return nixl.Errorf(nixl.ErrNotFound, op, "agent %q is not loaded", name)
	}
	delete(a.peers, name)
	a.retireLocked(p, time.Now())
	return nil
}

// retiring is an invalidated peer on its way out: flushing (its
// operations may end), then closing. teardownPeer's rules apply: a flushed
// or failed endpoint gets its rkeys destroyed and a graceful close; one
// whose flush timed out keeps its rkeys (operations may reference them)
// and is force-closed if it is known to be wired up; a dead peer's is
// force-closed at once.
type retiring struct {
	p        *peer
	closing  bool
	req      unsafe.Pointer // the flush or close request, nil when none
	deadline time.Time
}

func (a *agent) retireLocked(p *peer, now time.Time) {
	p.gen = 0
	a.copyMu.Lock()
	detachShm(p)
	a.detachCuda(p)
	a.copyMu.Unlock()
	p.closePidfd()
	r := &retiring{p: p}
	if p.dead {
		a.closeRetiringLocked(r, true, now)
		return
	}
	switch rc := C.gx_ep_flush_start(a.c, p.ep, &r.req); {
	case rc == 1:
		r.deadline = now.Add(flushTimeoutMs * time.Millisecond)
		a.retiring = append(a.retiring, r)
	default: // flushed at once, or failed
		a.destroyRkeys(p.rkeys)
		a.destroyRkeys(p.retired)
		a.closeRetiringLocked(r, false, now)
	}
}

// closeRetiringLocked starts r's close; r joins a.retiring while it runs.
func (a *agent) closeRetiringLocked(r *retiring, force bool, now time.Time) {
	p := r.p
	p.rkeys, p.retired, p.regions = nil, nil, nil
	r.closing = true
	cf := C.int(0)
	if force {
		cf = 1
	}
	if C.gx_ep_close_start(a.c, p.ep, cf, &r.req) == 1 {
		r.deadline = now.Add(closeTimeoutMs * time.Millisecond)
		for _, q := range a.retiring {
			if q == r {
				return
			}
		}
		a.retiring = append(a.retiring, r)
		return
	}
	// Transfers may still hold the gx_ep; it is freed with the agent.
	a.graveyard = append(a.graveyard, p.ep)
}

// advanceRetiringLocked moves every retiring peer on by one poll: called
// wherever the agent progresses its worker under mu (the progress thread,
// Check, Release, GetNotifs).
func (a *agent) advanceRetiringLocked(now time.Time) {
	if len(a.retiring) == 0 {
		return
	}
	cur := a.retiring
	a.retiring = nil
	for _, r := range cur {
		rc := C.gx_req_poll(a.c, &r.req)
		if rc == 1 && now.Before(r.deadline) {
			a.retiring = append(a.retiring, r)
			continue
		}
		C.gx_req_abandon(&r.req)
		if r.closing {
			// Closed, or the peer does not answer the close handshake:
			// worker destruction reclaims the endpoint.
			a.graveyard = append(a.graveyard, r.p.ep)
			continue
		}
		if rc == 1 {
			// The flush timed out (a peer that stopped answering, a cut
			// link): see teardownPeer for why only an established
			// endpoint is force-closed, and why the rkeys are leaked.
			a.closeRetiringLocked(r, r.p.established, now)
			continue
		}
		a.destroyRkeys(r.p.rkeys)
		a.destroyRkeys(r.p.retired)
		a.closeRetiringLocked(r, false, now)
	}
}

// finishRetiringLocked ends every retirement at once (agent Close): a
// flush still running is given up as teardownPeer would on timeout.
func (a *agent) finishRetiringLocked() {
	for _, r := range a.retiring {
		C.gx_req_abandon(&r.req)
		if !r.closing {
			r.p.rkeys, r.p.retired, r.p.regions = nil, nil, nil
			C.gx_ep_close(a.c, r.p.ep, boolInt(r.p.established || r.p.dead), closeTimeoutMs)
		}
		a.graveyard = append(a.graveyard, r.p.ep)
	}
	a.retiring = nil
}

func boolInt(b bool) C.int {
	if b {
		return 1
	}
	return 0
}

// selfPeer returns the loopback peer (an endpoint to this agent's own
// worker), rebuilt when local registrations changed.
func (a *agent) selfPeer() (*peer, error) {
	if p := a.peers[a.name]; p != nil && a.selfGen == a.localGen {
		return p, nil
	}
	b, err := a.localMetadataLocked()
	if err != nil {
		return nil, err
	}
	m, err := decodeMetadata(b)
	if err != nil {
		return nil, &nixl.Error{Status: nixl.ErrBackend, Op: "PrepDescList", Msg: err.Error()}
	}
	if err := a.loadLocked(m); err != nil {
		return nil, err
	}
	a.selfGen = a.localGen
	return a.peers[a.name], nil
}

type descEnt struct {
	addr, len uint64
	idx       uint32 // memh index (local) or rkey index (remote)
}

type descList struct {
	a     *agent
	agent string
	peer  *peer // nil for local lists
	gen   uint64
	mem   nixl.MemType
	// One of: ents (PrepDescList), or runs of n descriptors in all
	// (PrepStridedDescList).
	ents     []descEnt
	runs     []descRun
	n        int
	released bool
}

// descRun is a strided run: descriptor first+k is at addr + k*stride.
type descRun struct {
	first             int
	addr, stride, len uint64
	idx               uint32
}

// ent returns descriptor i (in range); hint caches the run of the last
// lookup, as MakeXfer's indices mostly walk a run in order.
func (d *descList) ent(i int32, hint *int) descEnt {
	if d.runs == nil {
		return d.ents[i]
	}
	k := int(i)
	h := *hint
	if h >= len(d.runs) || k < d.runs[h].first || (h+1 < len(d.runs) && k >= d.runs[h+1].first) {
		h = sort.Search(len(d.runs), func(j int) bool { return d.runs[j].first > k }) - 1
		*hint = h
	}
	r := &d.runs[h]
	return descEnt{addr: r.addr + uint64(k-r.first)*r.stride, len: r.len, idx: r.idx}
}

func (d *descList) Len() int {
	if d.runs != nil {
		return d.n
	}
	return len(d.ents)
}
func (d *descList) Agent() string { return d.agent }
func (d *descList) Release() error {
	d.a.mu.Lock()
	defer d.a.mu.Unlock()
	if d.released {
		return nixl.Errorf(nixl.ErrInvalidParam, "ReleaseDescList", "descriptor list released twice")
	}
	d.released = true
	d.ents, d.runs = nil, nil
	return nil
}

func (a *agent) PrepDescList(agentName string, mem nixl.MemType, descs []nixl.Desc) (nixl.DescList, error) {
	const op = "PrepDescList"
	for i, x := range descs {
		if x.Len == 0 || x.Addr+x.Len < x.Addr {
			return nil, nixl.Errorf(nixl.ErrInvalidParam, op, "descriptor %d: bad range %#x+%d", i, x.Addr, x.Len)
		}
	}
	snap, err := a.snapshotRegions(op, agentName, mem)
	if err != nil {
		return nil, err
	}
	ents := make([]descEnt, len(descs))
	if snap.p == nil {
		var last *localRegion
		for i, x := range descs {
			// Descriptors come in runs over one region: try the last first.
			lr := last
			if lr == nil || lr.DevID != x.DevID || x.Addr < lr.Addr || x.Addr+x.Len > lr.Addr+lr.Len {
				if lr = findCover(snap.local, x); lr == nil {
					return nil, nixl.Errorf(nixl.ErrNotFound, op,
						"descriptor %d (%#x+%d dev %d) is not inside a registered %v region", i, x.Addr, x.Len, x.DevID, mem)
				}
				last = lr
			}
			ents[i] = descEnt{addr: x.Addr, len: x.Len, idx: lr.memh}
		}
	} else {
		var last *remoteRegion
		for i, x := range descs {
			r := last
			if r == nil || r.dev != x.DevID || x.Addr < r.addr || x.Addr+x.Len > r.addr+r.len {
				if r = findRemote(snap.remote, mem, x); r == nil {
					return nil, nixl.Errorf(nixl.ErrNotFound, op,
						"descriptor %d (%#x+%d dev %d) is outside every %v region agent %q advertised", i, x.Addr, x.Len, x.DevID, mem, agentName)
				}
				last = r
			}
			ents[i] = descEnt{addr: x.Addr, len: x.Len, idx: r.rkey}
		}
	}
	d := &descList{a: a, agent: agentName, mem: mem, ents: ents}
	return d, a.installList(op, d, snap)
}

// PrepStridedDescList prepares a list kept as strided runs (nixl.Strided):
// each run is checked once, as one span that a single registered (or
// advertised) region must hold, and nothing is expanded, so a large
// model's first contact costs microseconds rather than a pass over 1.6M
// descriptors. Runs whose span no single region holds (a peer that
// registered every block on its own) are expanded and checked one
// descriptor at a time, as PrepDescList does.
func (a *agent) PrepStridedDescList(agentName string, mem nixl.MemType, runs []nixl.Strided) (nixl.DescList, error) {
	const op = "PrepDescList"
	snap, err := a.snapshotRegions(op, agentName, mem)
	if err != nil {
		return nil, err
	}
	out := make([]descRun, 0, len(runs))
	first := 0
	for i, r := range runs {
		end, ok := r.End()
		if r.Len == 0 || r.Count == 0 || !ok || first+int(r.Count) < first || uint64(first)+r.Count > 1<<31-1 {
			return nil, nixl.Errorf(nixl.ErrInvalidParam, op, "run %d: bad run %#x + %d x %d (+%d)", i, r.Addr, r.Count, r.Stride, r.Len)
		}
		span := nixl.Desc{Addr: r.Addr, Len: end - r.Addr, DevID: r.DevID}
		var idx uint32
		if snap.p == nil {
			lr := findCover(snap.local, span)
			if lr == nil {
				return a.PrepDescList(agentName, mem, nixl.ExpandStrided(runs))
			}
			idx = lr.memh
		} else {
			rr := findRemote(snap.remote, mem, span)
			if rr == nil {
				return a.PrepDescList(agentName, mem, nixl.ExpandStrided(runs))
			}
			idx = rr.rkey
		}
		out = append(out, descRun{first: first, addr: r.Addr, stride: r.Stride, len: r.Len, idx: idx})
		first += int(r.Count)
	}
	d := &descList{a: a, agent: agentName, mem: mem, runs: out, n: first}
	return d, a.installList(op, d, snap)
}

// regionSnap is the registration state a list is checked against, taken
// under the agent lock and checked without it: a large list must not stall
// transfers in flight. A change made meanwhile is detected at install.
type regionSnap struct {
	p      *peer // nil for a local list
	local  []*localRegion
	remote []remoteRegion
	gen    uint64
}

func (a *agent) snapshotRegions(op, agentName string, mem nixl.MemType) (regionSnap, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	var s regionSnap
	if err := a.checkOpen(op); err != nil {
		return s, err
	}
	switch {
	case agentName == "":
		s.local = slices.Clone(a.regions[mem])
		return s, nil
	case agentName == a.name:
		p, err := a.selfPeer()
		if err != nil {
			return s, err
		}
		s.p = p
	default:
		if s.p = a.peers[agentName]; s.p == nil {
			return s, nixl.Errorf(nixl.ErrNotFound, op, "no metadata loaded for agent %q", agentName)
		}
	}
	s.remote, s.gen = s.p.regions, s.p.gen // replaced, never changed in place
	return s, nil
}

// installList binds d to the state it was checked against, or fails when
// that state changed meanwhile.
func (a *agent) installList(op string, d *descList, s regionSnap) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.checkOpen(op); err != nil {
		return err
	}
	if s.p != nil {
		if d.agent != a.name && (a.peers[d.agent] != s.p || s.p.gen != s.gen) {
			return nixl.Errorf(nixl.ErrNotFound, op, "metadata of agent %q was invalidated or reloaded while the list was prepared", d.agent)
		}
		d.peer, d.gen = s.p, s.gen
	} else if !slices.Equal(s.local, a.regions[d.mem]) {
		return nixl.Errorf(nixl.ErrInvalidParam, op, "memory was registered or deregistered while the list was prepared; prepare it again")
	}
	return nil
}

// findCover returns a region of rs (sorted by Addr) holding all of x.
func findCover(rs []*localRegion, x nixl.Desc) *localRegion {
	i := sort.Search(len(rs), func(i int) bool { return rs[i].Addr > x.Addr })
	for j := i - 1; j >= 0; j-- {
		r := rs[j]
		if r.DevID == x.DevID && x.Addr+x.Len <= r.Addr+r.Len {
			return r
		}
	}
	return nil
}

// findRemote returns the advertised region of type mem holding all of x.
func findRemote(rs []remoteRegion, mem nixl.MemType, x nixl.Desc) *remoteRegion {
	i := sort.Search(len(rs), func(i int) bool {
		return rs[i].mem > mem || (rs[i].mem == mem && rs[i].addr > x.Addr)
	})
	for j := i - 1; j >= 0 && rs[j].mem == mem; j-- {
		r := &rs[j]
		if r.dev == x.DevID && x.Addr >= r.addr && x.Addr+x.Len <= r.addr+r.len {
			return r
		}
	}
	return nil
}

func (a *agent) MakeXfer(xop nixl.XferOp, local nixl.DescList, localIdx []int32, remote nixl.DescList, remoteIdx []int32, notif []byte) (nixl.Xfer, error) {
	const fn = "MakeXfer"
	a.mu.Lock()
	defer a.mu.Unlock()
	ll, rl, err := a.xferListsLocked(fn, xop, local, remote, notif)
	if err != nil {
		return nil, err
	}
	return a.makeXferLocked(fn, xop, ll, localIdx, rl, remoteIdx, notif)
}

// xferListsLocked checks what every MakeXfer form checks: the operation,
// the notification, and a live local and remote list of this agent.
func (a *agent) xferListsLocked(fn string, xop nixl.XferOp, local, remote nixl.DescList, notif []byte) (ll, rl *descList, err error) {
	if xop != nixl.Read && xop != nixl.Write {
		return nil, nil, nixl.Errorf(nixl.ErrInvalidParam, fn, "unknown operation %v", xop)
	}
	ll, ok1 := local.(*descList)
	rl, ok2 := remote.(*descList)
	if !ok1 || !ok2 || ll == nil || rl == nil || ll.a != a || rl.a != a {
		return nil, nil, nixl.Errorf(nixl.ErrInvalidParam, fn, "descriptor lists were not prepared by this agent")
	}
	if len(notif) > int(C.GX_MAX_NOTIF) {
		return nil, nil, nixl.Errorf(nixl.ErrInvalidParam, fn, "notification of %d bytes, limit %d", len(notif), int(C.GX_MAX_NOTIF))
	}
	if err := a.checkOpen(fn); err != nil {
		return nil, nil, err
	}
	if ll.released || rl.released {
		return nil, nil, nixl.Errorf(nixl.ErrInvalidParam, fn, "descriptor list already released")
	}
	if ll.agent != "" || rl.agent == "" {
		return nil, nil, nixl.Errorf(nixl.ErrInvalidParam, fn, "want a local list and a remote list, got agents %q and %q", ll.agent, rl.agent)
	}
	if ll.mem != rl.mem || (ll.mem != nixl.DRAM && ll.mem != nixl.VRAM) {
		return nil, nil, nixl.Errorf(nixl.ErrNotSupported, fn, "the ucx engine moves DRAM to DRAM and VRAM to VRAM, not %v to %v", rl.mem, ll.mem)
	}
	if a.peers[rl.agent] != rl.peer || rl.peer.gen != rl.gen {
		return nil, nil, nixl.Errorf(nixl.ErrNotFound, fn, "metadata of agent %q was invalidated or reloaded after the list was prepared", rl.agent)
	}
	return ll, rl, nil
}

func (a *agent) makeXferLocked(fn string, xop nixl.XferOp, ll *descList, localIdx []int32, rl *descList, remoteIdx []int32, notif []byte) (nixl.Xfer, error) {
	if err := nixl.CheckIndexArrays(localIdx, remoteIdx); err != nil {
		return nil, err
	}
	ops := make([]op, len(localIdx))
	var total uint64
	nl, nr := ll.Len(), rl.Len()
	var lh, rh int
	for i := range localIdx {
		li, ri := localIdx[i], remoteIdx[i]
		if err := nixl.CheckPairRange(i, li, ri, nl, nr); err != nil {
			return nil, err
		}
		le, re := ll.ent(li, &lh), rl.ent(ri, &rh)
		if err := nixl.CheckPairLengths(i, le.len, re.len); err != nil {
			return nil, err
		}
		ops[i] = op{laddr: le.addr, raddr: re.addr, len: le.len, rkey: re.idx, memh: le.idx}
		total += le.len
	}
	x := &xfer{a: a, op: xop, peer: rl.peer, gen: rl.gen, ops: coalesce(ops), bytes: total, descs: len(localIdx)}
	if ll.mem == nixl.VRAM {
		var err error
		if x.cdev, x.cops, err = a.cudaOps(xop, rl.peer, x.ops); err != nil {
			return nil, nixl.Errorf(nixl.ErrNotSupported, fn, "%v", err)
		}
	} else if a.set.path.sharesMemory() && rl.peer.shm != nil {
		x.shmOps, x.cmaOps, x.ctls = splitShm(x.ops, rl.peer.shm)
	}
	return a.finishXferLocked(fn, x, notif)
}

// finishXferLocked gives a built transfer its C state and notification.
func (a *agent) finishXferLocked(fn string, x *xfer, notif []byte) (nixl.Xfer, error) {
	x.c = C.gx_xfer_new()
	if x.c == nil {
		return nil, nixl.Errorf(nixl.ErrBackend, fn, "out of memory")
	}
	if notif != nil {
		payload := notifPayload(a.name, notif)
		if rc := C.gx_xfer_set_notif(x.c, unsafe.Pointer(&payload[0]), C.size_t(len(payload))); rc != 0 {
			C.gx_xfer_free(a.c, x.c)
			return nil, rcError(rc, fn, "notification")
		}
	}
	a.xfers[x] = struct{}{}
	return x, nil
}

// MakeXferBlocks is MakeXfer for a transfer of regions × blocks
// (nixl.BlockXferMaker). When every region's blocks lie in one strided run
// on both sides, the operations are computed from the runs (VRAM: kept as
// a region table and block pairs for the gather kernel); otherwise the
// index arrays are expanded and MakeXfer's rules apply.
func (a *agent) MakeXferBlocks(xop nixl.XferOp, local, remote nixl.DescList, regions []nixl.BlockRegion, localBlocks, remoteBlocks []int32, notif []byte) (nixl.Xfer, error) {
	const fn = "MakeXfer"
	a.mu.Lock()
	defer a.mu.Unlock()
	ll, rl, err := a.xferListsLocked(fn, xop, local, remote, notif)
	if err != nil {
		return nil, err
	}
	spans, ok := blockSpans(ll, rl, regions, localBlocks, remoteBlocks)
	if !ok {
		li, ri, err := nixl.ExpandBlocks(regions, localBlocks, remoteBlocks)
		if err != nil {
			return nil, err
		}
		return a.makeXferLocked(fn, xop, ll, li, rl, ri, notif)
	}
	n := len(regions) * len(localBlocks)
	var total uint64
	for _, s := range spans {
		total += s.len * uint64(len(localBlocks))
	}
	x := &xfer{a: a, op: xop, peer: rl.peer, gen: rl.gen, bytes: total, descs: n}
	if ll.mem == nixl.VRAM {
		if x.cdev, x.cblocks, err = a.cudaBlocks(xop, rl.peer, spans, localBlocks, remoteBlocks); err != nil {
			return nil, nixl.Errorf(nixl.ErrNotSupported, fn, "%v", err)
		}
		return a.finishXferLocked(fn, x, notif)
	}
	x.lazy = &lazyOps{spans: spans, lb: localBlocks, rb: remoteBlocks}
	if !a.set.path.sharesMemory() {
		// The operations are built where they are first needed: on the
		// copy goroutine for a same-host peer (data path cma), so that
		// vLLM's model thread, which makes the transfer, does not spend
		// O(descriptors) on it; in Post for UCP.
		return a.finishXferLocked(fn, x, notif)
	}
	x.materialize()
	if rl.peer.shm != nil {
		x.shmOps, x.cmaOps, x.ctls = splitShm(x.ops, rl.peer.shm)
	}
	return a.finishXferLocked(fn, x, notif)
}

// blockSpan is one region of a regions × blocks transfer resolved against
// the strided runs: block b of the region is at laddr + b*lstride locally
// and raddr + b*rstride remotely.
type blockSpan struct {
	laddr, lstride, raddr, rstride, len uint64
	memh, rkey                          uint32
}

// blockSpans resolves every region's blocks to one run on each side, after
// the range checks MakeXfer would make; ok is false when a region's blocks
// span runs (or a list has no runs), and then nothing is decided here.
func blockSpans(ll, rl *descList, regions []nixl.BlockRegion, lb, rb []int32) (spans []blockSpan, ok bool) {
	if ll.runs == nil || rl.runs == nil || len(lb) == 0 || len(lb) != len(rb) {
		return nil, false
	}
	lmin, lmax := minMax(lb)
	rmin, rmax := minMax(rb)
	if lmin < 0 || rmin < 0 {
		return nil, false
	}
	spans = make([]blockSpan, len(regions))
	var lh, rh int
	for i, r := range regions {
		lr, lfirst, okl := ll.runSpan(int64(r.Local)+lmin, int64(r.Local)+lmax, &lh)
		rr, rfirst, okr := rl.runSpan(int64(r.Remote)+rmin, int64(r.Remote)+rmax, &rh)
		if !okl || !okr || lr.len != rr.len {
			return nil, false
		}
		spans[i] = blockSpan{
			laddr: lr.addr + uint64(int64(r.Local)-lfirst)*lr.stride, lstride: lr.stride,
			raddr: rr.addr + uint64(int64(r.Remote)-rfirst)*rr.stride, rstride: rr.stride,
			len: lr.len, memh: lr.idx, rkey: rr.idx,
		}
	}
	return spans, true
}

func minMax(xs []int32) (lo, hi int64) {
	lo, hi = int64(xs[0]), int64(xs[0])
	for _, x := range xs[1:] {
		lo, hi = min(lo, int64(x)), max(hi, int64(x))
	}
	return lo, hi
}

// runSpan returns the run holding descriptors lo..hi (both), with its
// first descriptor id, if one run holds them all.
func (d *descList) runSpan(lo, hi int64, hint *int) (descRun, int64, bool) {
	if lo < 0 || hi >= int64(d.n) || lo > hi {
		return descRun{}, 0, false
	}
	d.ent(int32(lo), hint)
	h := *hint
	end := int64(d.n)
	if h+1 < len(d.runs) {
		end = int64(d.runs[h+1].first)
	}
	if hi >= end {
		return descRun{}, 0, false
	}
	return d.runs[h], int64(d.runs[h].first), true
}

// notifPayload frames a notification: [u16 name length][name][msg].
func notifPayload(name string, msg []byte) []byte {
	b := make([]byte, 2+len(name)+len(msg))
	b[0], b[1] = byte(len(name)), byte(len(name)>>8)
	copy(b[2:], name)
	copy(b[2+len(name):], msg)
	return b
}

func (a *agent) SendNotif(agentName string, msg []byte) error {
	const op = "SendNotif"
	if len(msg) > int(C.GX_MAX_NOTIF) {
		return nixl.Errorf(nixl.ErrInvalidParam, op, "notification of %d bytes, limit %d", len(msg), int(C.GX_MAX_NOTIF))
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.checkOpen(op); err != nil {
		return err
	}
	var p *peer
	if agentName == a.name {
		var err error
		if p, err = a.selfPeer(); err != nil {
			return err
		}
	} else if p = a.peers[agentName]; p == nil {
		return nixl.Errorf(nixl.ErrNotFound, op, "no metadata loaded for agent %q", agentName)
	}
	if p.dead {
		return nixl.Errorf(nixl.ErrRemoteDiscon, op, "%s", p.deadWhy)
	}
	payload := notifPayload(a.name, msg)
	if rc := C.gx_send_notif(a.c, p.ep, unsafe.Pointer(&payload[0]), C.size_t(len(payload))); rc != 0 {
		return rcError(rc, op, "to "+agentName)
	}
	return nil
}

func (a *agent) GetNotifs() ([]nixl.Notif, error) {
	a.mu.Lock()
	return a.takeNotifs()
}

// TryGetNotifs is nixl.TryNotifier's: GetNotifs, unless the agent mutex is
// held (the progress thread's sweep, a post).
func (a *agent) TryGetNotifs() ([]nixl.Notif, error, bool) {
	if !a.mu.TryLock() {
		return nil, nil, false
	}
	n, err := a.takeNotifs()
	return n, err, true
}

// takeNotifs is GetNotifs with the agent mutex held; it unlocks it.
func (a *agent) takeNotifs() ([]nixl.Notif, error) {
	if err := a.checkOpen("GetNotifs"); err != nil {
		a.mu.Unlock()
		return nil, err
	}
	if msg := a.progFault.Swap(nil); msg != nil {
		a.mu.Unlock()
		return nil, nixl.Errorf(nixl.ErrBackend, "GetNotifs", "%s", *msg)
	}
	C.gx_progress(a.c, 64)
	a.advanceRetiringLocked(time.Now())
	var dropped C.uint64_t
	head := C.gx_notifs_take(a.c, &dropped)
	a.dropped += uint64(dropped)
	a.mu.Unlock()
	var out []nixl.Notif
	for n := head; n != nil; n = n.next {
		data := unsafe.Pointer(C.gx_notif_data(n))
		out = append(out, nixl.Notif{
			Agent: C.GoStringN((*C.char)(data), C.int(n.name_len)),
			Msg:   C.GoBytes(unsafe.Add(data, int(n.name_len)), C.int(n.msg_len)),
		})
	}
	C.gx_notifs_free(head)
	return out, nil
}

func (a *agent) Close() error {
	a.mu.Lock()
	if a.closed || a.closing {
		a.mu.Unlock()
		return nil
	}
	a.closing = true
	pt := a.prog
	a.mu.Unlock()
	var err error
	if pt != nil {
		err = pt.stop() // the thread exits at its next look at a.closing
	}
	// A host copy writes into registered memory: none may outlive Close.
	// They end on their own (a copy between live mappings, or a CMA call
	// the kernel bounds); no new one starts once closing is set.
	a.copies.Wait()
	a.mu.Lock()
	defer a.mu.Unlock()
	// Documented order: requests, then per peer flush / rkeys / endpoint,
	// then local registrations, worker and context.
	for x := range a.xfers {
		C.gx_xfer_free(a.c, x.c)
		x.c = nil
	}
	a.xfers = nil
	a.finishRetiringLocked()
	names := make([]string, 0, len(a.peers))
	for n := range a.peers {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		a.teardownPeer(a.peers[n])
	}
	a.peers = nil
	for i, m := range a.memhs {
		if m != nil {
			C.gx_mem_unmap(a.c, m)
			a.memhs[i] = nil
		}
	}
	for _, rs := range a.regions {
		for _, lr := range rs {
			_ = a.unshareLocal(lr)
		}
	}
	a.regions = nil
	a.closeCudaDevs()
	if pt != nil && err != nil {
		// The thread did not stop: it may still touch the worker, so the
		// worker is leaked rather than destroyed under it.
		a.closed = true
		return &nixl.Error{Status: nixl.ErrBackend, Op: "Close", Msg: "progress thread did not stop", Err: err}
	}
	C.gx_agent_destroy(a.c)
	a.c = nil
	for _, ep := range a.graveyard {
		C.gx_ep_free(ep)
	}
	a.graveyard = nil
	a.closed = true
	return nil
}
