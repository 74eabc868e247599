package libnixl

/*
#include <stdlib.h>
#include "gxnixl.h"
*/
import "C"

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"runtime"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/gonixl/gonixl/nixl"
)

// This engine's agent reports its long control calls (nixl/capabilities.go).
var (
	_ nixl.Agent       = (*agent)(nil)
	_ nixl.ControlBusy = (*agent)(nil)
	_ nixl.PostCopies  = (*agent)(nil)
)

// agent is one NIXL agent. mu serialises every call into NIXL.
type agent struct {
	mu sync.Mutex
	// control counts the control calls (metadata loads, list preparation
	// and release, memory registration) running or waiting for mu:
	// ControlBusy.
	control atomic.Int32
	// dram: DRAM was registered; NIXL's UCX backend then copies a
	// same-host transfer inside Post (nixl.PostCopies).
	dram     atomic.Bool
	h        unsafe.Pointer // nixl_capi_agent_t
	nmap     unsafe.Pointer // reusable notification map
	name     string
	cfg      nixl.AgentConfig
	closed   bool
	backends []string // created, in order of preference
	skipped  []string // configured but without a plugin
	lists    map[*descList]struct{}
	xfers    map[*xfer]struct{}
	// tainted is set once a transfer or notification failed: NIXL's UCX
	// backend then aborts the process (UCX assertion
	// "ucs_arbiter_group_is_empty") when the agent is destroyed, so Close
	// leaves such an agent to the process's end. See
	// docs/environment-nixl.md.
	tainted bool
}

var (
	leakMu sync.Mutex
	leaked []string
)

// LeakedAgents lists agents that Close left undestroyed because a peer
// failure would make NIXL abort on destruction.
func LeakedAgents() []string {
	leakMu.Lock()
	defer leakMu.Unlock()
	return append([]string(nil), leaked...)
}

func (a *agent) Name() string { return a.name }

func (a *agent) Engine() string { return "nixl" }

// Backends returns the backends the agent created and those it skipped
// because their plugin is missing.
func (a *agent) Backends() (created, skipped []string) {
	return append([]string(nil), a.backends...), append([]string(nil), a.skipped...)
}

// ControlBusy reports a control call running or waiting for the agent's
// lock (nixl.ControlBusy).
func (a *agent) ControlBusy() bool { return a.control.Load() > 0 }

// PostCopies reports that Post copies a DRAM transfer on the caller's
// thread (nixl.PostCopies): with NIXL's UCX backend a 14 MiB READ between
// two processes of one host spent all of its 1.97 ms inside Post
// (BenchmarkPostShare14MiB measures it in one process). VRAM was not
// measured and is left posted in place.
func (a *agent) PostCopies() bool { return a.dram.Load() }

// lockControl takes the agent's lock for a control call, counted in
// control from before it waits until it returns the lock.
func (a *agent) lockControl() (unlock func()) {
	a.control.Add(1)
	a.mu.Lock()
	return func() {
		a.mu.Unlock()
		a.control.Add(-1)
	}
}

func (a *agent) check(op string) error {
	if a.closed {
		return nixl.Errorf(nixl.ErrInvalidParam, op, "agent %q is closed", a.name)
	}
	return nil
}

func (a *agent) plugins() ([]string, error) {
	var buf *C.char
	var n C.size_t
	if s := C.gxnixl_plugins(a.h, &buf, &n); s != 0 {
		return nil, statusErr("NewAgent", s, "listing plugins")
	}
	defer C.gxnixl_free(unsafe.Pointer(buf))
	out := strings.Fields(C.GoStringN(buf, C.int(n)))
	sort.Strings(out)
	return out, nil
}

func (a *agent) createBackend(name string, params map[string]string) error {
	keys := make([]string, 0, len(params))
	for k := range params {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	n := len(keys)
	ck := (*[1 << 20]*C.char)(C.malloc(C.size_t(2*n+1) * C.size_t(unsafe.Sizeof(uintptr(0)))))
	defer C.free(unsafe.Pointer(ck))
	for i, k := range keys {
		ck[i] = C.CString(k)
		ck[n+i] = C.CString(params[k])
	}
	defer func() {
		for i := 0; i < 2*n; i++ {
			C.free(unsafe.Pointer(ck[i]))
		}
	}()
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	if s := C.gxnixl_backend_new(a.h, cname, &ck[0], &ck[n], C.size_t(n)); s != 0 {
		return statusErr("NewAgent", s, "creating backend %s with %v", name, params)
	}
	return nil
}

// descPtr passes a descriptor table as {addr, len, devId} triples: the
// layout of nixl.Desc, three uint64 fields.
func descPtr(d []nixl.Desc) *C.uint64_t {
	if len(d) == 0 {
		return nil
	}
	return (*C.uint64_t)(unsafe.Pointer(&d[0]))
}

func (a *agent) regMem(op string, mem nixl.MemType, regions []nixl.Region, dereg int) error {
	defer a.lockControl()()
	if err := a.check(op); err != nil {
		return err
	}
	if len(regions) == 0 {
		return nixl.Errorf(nixl.ErrInvalidParam, op, "no regions")
	}
	s := C.gxnixl_register(a.h, C.int(mem), descPtr(regions), C.size_t(len(regions)), C.int(dereg))
	runtime.KeepAlive(regions)
	if s != 0 {
		return statusErr(op, s, "%d %v regions", len(regions), mem)
	}
	if mem == nixl.DRAM && dereg == 0 {
		a.dram.Store(true)
	}
	return nil
}

func (a *agent) RegisterMem(mem nixl.MemType, regions []nixl.Region) error {
	return a.regMem("RegisterMem", mem, regions, 0)
}

func (a *agent) DeregisterMem(mem nixl.MemType, regions []nixl.Region) error {
	return a.regMem("DeregisterMem", mem, regions, 1)
}

func (a *agent) LocalMetadata() ([]byte, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.check("LocalMetadata"); err != nil {
		return nil, err
	}
	var p unsafe.Pointer
	var n C.size_t
	if s := C.gxnixl_local_md(a.h, &p, &n); s != 0 {
		return nil, statusErr("LocalMetadata", s, "")
	}
	defer C.gxnixl_free(p)
	return C.GoBytes(p, C.int(n)), nil
}

func (a *agent) LoadRemoteMetadata(md []byte) (string, error) {
	defer a.lockControl()()
	if err := a.check("LoadRemoteMetadata"); err != nil {
		return "", err
	}
	if len(md) == 0 {
		return "", nixl.Errorf(nixl.ErrInvalidParam, "LoadRemoteMetadata", "empty metadata")
	}
	var name *C.char
	s := C.gxnixl_load_md(a.h, unsafe.Pointer(&md[0]), C.size_t(len(md)), &name)
	runtime.KeepAlive(md)
	if s != 0 {
		return "", statusErr("LoadRemoteMetadata", s, "%d bytes of metadata rejected", len(md))
	}
	defer C.gxnixl_free(unsafe.Pointer(name))
	return C.GoString(name), nil
}

func (a *agent) InvalidateRemote(name string) error {
	defer a.lockControl()()
	if err := a.check("InvalidateRemote"); err != nil {
		return err
	}
	cn := C.CString(name)
	defer C.free(unsafe.Pointer(cn))
	if s := C.gxnixl_invalidate(a.h, cn); s != 0 {
		return statusErr("InvalidateRemote", s, "agent %q", name)
	}
	return nil
}

func (a *agent) PrepDescList(remote string, mem nixl.MemType, descs []nixl.Desc) (nixl.DescList, error) {
	defer a.lockControl()()
	if err := a.check("PrepDescList"); err != nil {
		return nil, err
	}
	cn := C.CString(remote)
	defer C.free(unsafe.Pointer(cn))
	var h unsafe.Pointer
	s := C.gxnixl_prep(a.h, cn, C.int(mem), descPtr(descs), C.size_t(len(descs)), &h)
	runtime.KeepAlive(descs)
	if s != 0 {
		who := "local"
		if remote != "" {
			who = "agent " + remote
		}
		return nil, statusErr("PrepDescList", s, "%d %v descriptors for %s", len(descs), mem, who)
	}
	l := &descList{a: a, h: h, remote: remote, mem: mem, lens: make([]uint64, len(descs))}
	for i, d := range descs {
		l.lens[i] = d.Len
	}
	a.lists[l] = struct{}{}
	return l, nil
}

// descList is a prepared list; lens lets MakeXfer check indices and pair
// lengths in Go, before anything crosses into NIXL.
type descList struct {
	a        *agent
	h        unsafe.Pointer
	remote   string
	mem      nixl.MemType
	lens     []uint64
	released bool
}

func (l *descList) Len() int { return len(l.lens) }

func (l *descList) Agent() string { return l.remote }

func (l *descList) Release() error {
	a := l.a
	defer a.lockControl()()
	if l.released {
		return nixl.Errorf(nixl.ErrInvalidParam, "DescList.Release", "list already released")
	}
	if a.closed {
		l.released = true // freed with the agent
		return nil
	}
	l.released = true
	delete(a.lists, l)
	if s := C.gxnixl_release_dlist(a.h, l.h); s != 0 {
		return statusErr("DescList.Release", s, "")
	}
	return nil
}

func (a *agent) MakeXfer(op nixl.XferOp, local nixl.DescList, localIdx []int32, remote nixl.DescList, remoteIdx []int32, notif []byte) (nixl.Xfer, error) {
	bad := func(f string, args ...any) error { return nixl.Errorf(nixl.ErrInvalidParam, "MakeXfer", f, args...) }
	if op != nixl.Read && op != nixl.Write {
		return nil, bad("unknown operation %v", op)
	}
	ll, ok1 := local.(*descList)
	rl, ok2 := remote.(*descList)
	if !ok1 || !ok2 || ll == nil || rl == nil || ll.a != a || rl.a != a {
		return nil, bad("descriptor lists were not prepared by this agent")
	}
	if err := nixl.CheckIndexArrays(localIdx, remoteIdx); err != nil {
		return nil, err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.check("MakeXfer"); err != nil {
		return nil, err
	}
	if ll.released || rl.released {
		return nil, bad("descriptor list already released")
	}
	if ll.remote != "" || rl.remote == "" {
		return nil, bad("the local list must be prepared for \"\" and the remote list for a remote agent")
	}
	if ll.mem != rl.mem {
		return nil, bad("memory types differ: %v and %v", ll.mem, rl.mem)
	}
	if err := checkPairs(ll.lens, rl.lens, localIdx, remoteIdx); err != nil {
		return nil, err
	}
	var np unsafe.Pointer
	if len(notif) > 0 {
		np = unsafe.Pointer(&notif[0])
	}
	has := 0
	if notif != nil {
		has = 1
	}
	var h unsafe.Pointer
	s := C.gxnixl_make(a.h, C.int(op), ll.h, (*C.int32_t)(unsafe.Pointer(&localIdx[0])), rl.h,
		(*C.int32_t)(unsafe.Pointer(&remoteIdx[0])), C.size_t(len(localIdx)), np, C.size_t(len(notif)), C.int(has), &h)
	runtime.KeepAlive(localIdx)
	runtime.KeepAlive(remoteIdx)
	runtime.KeepAlive(notif)
	if s != 0 {
		return nil, statusErr("MakeXfer", s, "%v of %d descriptors from agent %q", op, len(localIdx), rl.remote)
	}
	x := &xfer{a: a, h: h, op: op, remote: rl.remote, n: len(localIdx)}
	a.xfers[x] = struct{}{}
	return x, nil
}

// checkPairs validates index pairs against the lists' descriptor lengths:
// every index in range, each pair of equal length. It is the whole of our
// per-descriptor work in MakeXfer besides the one cgo call.
func checkPairs(llens, rlens []uint64, localIdx, remoteIdx []int32) error {
	for i, li := range localIdx {
		ri := remoteIdx[i]
		if err := nixl.CheckPairRange(i, li, ri, len(llens), len(rlens)); err != nil {
			return err
		}
		if err := nixl.CheckPairLengths(i, llens[li], rlens[ri]); err != nil {
			return err
		}
	}
	return nil
}

func (a *agent) SendNotif(remote string, msg []byte) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.check("SendNotif"); err != nil {
		return err
	}
	cn := C.CString(remote)
	defer C.free(unsafe.Pointer(cn))
	var p unsafe.Pointer
	if len(msg) > 0 {
		p = unsafe.Pointer(&msg[0])
	}
	s := C.gxnixl_gen_notif(a.h, cn, p, C.size_t(len(msg)))
	runtime.KeepAlive(msg)
	if s != 0 {
		if nixl.Status(s) != nixl.ErrNotFound && nixl.Status(s) != nixl.ErrInvalidParam {
			a.tainted = true
		}
		return statusErr("SendNotif", s, "to agent %q", remote)
	}
	return nil
}

func (a *agent) GetNotifs() ([]nixl.Notif, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.check("GetNotifs"); err != nil {
		return nil, err
	}
	var buf unsafe.Pointer
	var n, count C.size_t
	if s := C.gxnixl_get_notifs(a.h, a.nmap, &buf, &n, &count); s != 0 {
		return nil, statusErr("GetNotifs", s, "")
	}
	if count == 0 {
		return nil, nil
	}
	defer C.gxnixl_free(buf)
	return parseNotifs(C.GoBytes(buf, C.int(n)), int(count))
}

// parseNotifs decodes gxnixl_get_notifs's records.
func parseNotifs(b []byte, count int) ([]nixl.Notif, error) {
	out := make([]nixl.Notif, 0, count)
	r := bytes.NewReader(b)
	next := func() ([]byte, error) {
		var l uint32
		if err := binary.Read(r, binary.NativeEndian, &l); err != nil {
			return nil, err
		}
		if int64(l) > int64(r.Len()) {
			return nil, fmt.Errorf("record of %d bytes, %d left", l, r.Len())
		}
		v := make([]byte, l)
		// ReadFull: a bytes.Reader's Read at the end of the buffer returns
		// io.EOF even for an empty record (an empty message, last), which
		// lost the whole batch.
		_, err := io.ReadFull(r, v)
		return v, err
	}
	for i := 0; i < count; i++ {
		ag, err := next()
		if err != nil {
			return out, nixl.Errorf(nixl.ErrUnknown, "GetNotifs", "corrupt notification buffer: %v", err)
		}
		msg, err := next()
		if err != nil {
			return out, nixl.Errorf(nixl.ErrUnknown, "GetNotifs", "corrupt notification buffer: %v", err)
		}
		out = append(out, nixl.Notif{Agent: string(ag), Msg: msg})
	}
	return out, nil
}

// Close releases the agent's transfer requests and lists, then the agent.
func (a *agent) Close() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed || a.h == nil {
		a.closed = true
		return nil
	}
	for x := range a.xfers {
		_ = C.gxnixl_release_xfer(a.h, x.h) // NIXL frees what is left with the agent
		x.released = true
	}
	for l := range a.lists {
		_ = C.gxnixl_release_dlist(a.h, l.h)
		l.released = true
	}
	a.xfers, a.lists = nil, nil
	C.gxnixl_notif_map_free(a.nmap)
	a.nmap = nil
	if a.tainted {
		leakMu.Lock()
		leaked = append(leaked, a.name)
		leakMu.Unlock()
		a.h = nil
		a.closed = true
		return nil
	}
	s := C.gxnixl_agent_free(a.h)
	a.h = nil
	a.closed = true
	if s != 0 {
		return statusErr("Close", s, "destroying agent %q", a.name)
	}
	return nil
}

// touchArrays crosses cgo once with two index arrays, as MakeXfer does, and
// does no NIXL work: the benchmarks use it to measure our side alone.
func touchArrays(li, ri []int32) int64 {
	if len(li) == 0 || len(ri) < len(li) {
		return 0
	}
	r := C.gxnixl_touch((*C.int32_t)(unsafe.Pointer(&li[0])), (*C.int32_t)(unsafe.Pointer(&ri[0])), C.size_t(len(li)))
	runtime.KeepAlive(li)
	runtime.KeepAlive(ri)
	return int64(r)
}
