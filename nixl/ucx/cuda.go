//go:build cgo && !gonixl_noucx

package ucx

/*
#include <stdlib.h>
#include "gxcuda.h"
*/
import "C"

import (
	_ "embed"
	"fmt"
	"os"
	"sync"
	"unsafe"

	"github.com/gonixl/gonixl/nixl"
)

// The CUDA IPC data path moves VRAM between processes of one host: a
// registered VRAM region is exported as the CUDA IPC handle of its
// allocation (published in the agent metadata), a peer maps the allocation
// once per handshake (cuIpcOpenMemHandle), and a transfer is one launch of
// a gather kernel (cuda/gather.cu) over all of its operations, on a
// goroutine like the host copies (xfer.startHostCopy), followed by the
// notification through UCX. The CUDA driver is loaded with dlopen on first
// use: without it the engine moves DRAM only. VRAM is not registered with
// UCX (Debian's UCX has no CUDA transports), so a VRAM peer on another
// host is refused at its metadata load: use transfer_engine nixl there.

//go:embed cuda/gather.ptx
var gatherPTX string

// EnvCudaLib overrides the CUDA driver library the engine loads
// (default libcuda.so.1 through the dynamic loader's search path).
const EnvCudaLib = "GONIXL_CUDA_LIB"

// cudaChunk bounds one gather operation, so that a long coalesced run is
// spread over many thread blocks instead of one.
const cudaChunk = 64 << 10

// gxErrCUDA marks a failed gather; the driver's message is in xfer.cudaErr.
const gxErrCUDA = -1100

var cudaLoad struct {
	once sync.Once
	err  error
}

// cudaAvailable loads the CUDA driver once per process.
func cudaAvailable() error {
	cudaLoad.once.Do(func() {
		var cpath *C.char
		if p := os.Getenv(EnvCudaLib); p != "" {
			cpath = C.CString(p)
			defer C.free(unsafe.Pointer(cpath))
		}
		errBuf := (*C.char)(C.malloc(512))
		defer C.free(unsafe.Pointer(errBuf))
		if rc := C.gx_cuda_load(cpath, errBuf, 512); rc != 0 {
			cudaLoad.err = fmt.Errorf("ucx: no CUDA driver (%s): %w", C.GoString(errBuf), nixl.ErrUnavailable)
		}
	})
	return cudaLoad.err
}

// cudaDriverVersion returns the loaded driver's version (e.g. 13000), 0
// when none is loaded.
func cudaDriverVersion() int {
	if cudaAvailable() != nil {
		return 0
	}
	var v C.int
	if C.gx_cuda_driver_version(&v) != 0 {
		return 0
	}
	return int(v)
}

func cudaError(rc C.int) string {
	buf := (*C.char)(C.malloc(256))
	defer C.free(unsafe.Pointer(buf))
	C.gx_cuda_strerror(rc, buf, 256)
	return C.GoString(buf)
}

// cudaDevice returns the agent's handle on device ordinal, opening it on
// first use (agent mutex held). The first device opened is the one peer
// allocations are mapped into.
func (a *agent) cudaDevice(ordinal int) (*C.gx_cuda_dev, error) {
	if d := a.cudaDevs[ordinal]; d != nil {
		return d, nil
	}
	if err := cudaAvailable(); err != nil {
		return nil, err
	}
	d := (*C.gx_cuda_dev)(C.calloc(1, C.size_t(unsafe.Sizeof(C.gx_cuda_dev{}))))
	if d == nil {
		return nil, fmt.Errorf("out of memory")
	}
	ptx := C.CString(gatherPTX)
	defer C.free(unsafe.Pointer(ptx))
	errBuf := (*C.char)(C.malloc(512))
	defer C.free(unsafe.Pointer(errBuf))
	if rc := C.gx_cuda_dev_open(C.int(ordinal), ptx, d, errBuf, 512); rc != 0 {
		C.free(unsafe.Pointer(d))
		return nil, fmt.Errorf("CUDA %s", C.GoString(errBuf))
	}
	if a.cudaDevs == nil {
		a.cudaDevs = map[int]*C.gx_cuda_dev{}
	}
	a.cudaDevs[ordinal] = d
	if a.cudaMain == nil {
		a.cudaMain = d
	}
	return d, nil
}

// registerVRAM exports VRAM regions for CUDA IPC. Each region must lie in
// one device allocation of the device its DevID names.
func (a *agent) registerVRAM(regions []nixl.Region) error {
	const op = "RegisterMem"
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.checkOpen(op); err != nil {
		return err
	}
	var done []*localRegion
	undo := func() {
		for _, lr := range done {
			a.removeLocal(nixl.VRAM, lr)
		}
	}
	errBuf := (*C.char)(C.malloc(512))
	defer C.free(unsafe.Pointer(errBuf))
	for _, r := range regions {
		if a.findExact(nixl.VRAM, r) >= 0 {
			undo()
			return nixl.Errorf(nixl.ErrInvalidParam, op, "region %#x+%d dev %d is already registered", r.Addr, r.Len, r.DevID)
		}
		if r.DevID > 1<<20 {
			undo()
			return nixl.Errorf(nixl.ErrInvalidParam, op, "region %#x+%d: device id %d", r.Addr, r.Len, r.DevID)
		}
		d, err := a.cudaDevice(int(r.DevID))
		if err != nil {
			undo()
			return &nixl.Error{Status: nixl.ErrNotSupported, Op: op, Msg: "VRAM through the ucx engine needs the CUDA driver", Err: err}
		}
		var base, size C.uint64_t
		c := &mdCuda{UUID: *(*[16]byte)(unsafe.Pointer(&d.uuid[0]))}
		if rc := C.gx_cuda_export(d, C.uint64_t(r.Addr), C.uint64_t(r.Len), &base, &size,
			(*C.uint8_t)(unsafe.Pointer(&c.Handle[0])), errBuf, 512); rc != 0 {
			undo()
			return nixl.Errorf(nixl.ErrBackend, op,
				"VRAM region %#x+%d dev %d cannot be shared with CUDA IPC: %s (memory from cuMemCreate, such as PyTorch's expandable segments, has no IPC handle)",
				r.Addr, r.Len, r.DevID, C.GoString(errBuf))
		}
		c.Base, c.Size = uint64(base), uint64(size)
		lr := &localRegion{Region: r, memh: uint32(r.DevID), cuda: c}
		a.insertLocal(nixl.VRAM, lr)
		done = append(done, lr)
	}
	a.localGen++
	return nil
}

// cop is one gather operation; its layout is that of the C struct gx_cop
// (checked below), so a []cop crosses into C as one array.
type cop struct{ src, dst, len uint64 }

var (
	_ [unsafe.Sizeof(C.gx_cop{}) - unsafe.Sizeof(cop{})]byte
	_ [unsafe.Sizeof(cop{}) - unsafe.Sizeof(C.gx_cop{})]byte
)

// cudaPeer is a peer's VRAM as mapped here: per region (by rkey index) the
// offset to add to the peer's address to reach it in this process, and the
// mappings to close, by handle.
type cudaPeer struct {
	delta  []uint64
	mapped map[[cudaIPCHandleLen]byte]uint64
}

// attachCuda maps the CUDA allocations behind a peer's VRAM regions (agent
// mutex held; copyMu held for writing by the caller when it replaces an
// earlier mapping). regions are the peer's metadata regions in rkey order.
// The loopback peer needs no mapping: its addresses are this process's.
func (a *agent) attachCuda(p *peer, regions []mdRegion, self bool) error {
	var vram int
	for _, r := range regions {
		if r.Cuda != nil {
			vram++
		}
	}
	if vram == 0 {
		return nil
	}
	cp := &cudaPeer{delta: make([]uint64, len(regions)), mapped: map[[cudaIPCHandleLen]byte]uint64{}}
	if self {
		p.cuda = cp
		return nil
	}
	if !p.local {
		return fmt.Errorf("agent %q offers VRAM from another host: the ucx engine moves VRAM only between processes of one host (CUDA IPC); use transfer_engine nixl for VRAM across hosts", p.name)
	}
	if a.cudaMain == nil {
		return fmt.Errorf("agent %q offers VRAM, but this agent has no VRAM registered: register the local KV cache before loading peers", p.name)
	}
	for i, r := range regions {
		if r.Cuda == nil {
			continue
		}
		m, ok := cp.mapped[r.Cuda.Handle]
		if !ok {
			var out C.uint64_t
			if rc := C.gx_cuda_ipc_open(a.cudaMain, (*C.uint8_t)(unsafe.Pointer(&r.Cuda.Handle[0])), &out); rc != 0 {
				a.closeCuda(cp)
				return fmt.Errorf("agent %q region %d (device %x): cuIpcOpenMemHandle: %s (is the peer's GPU visible to this process, and peer access possible?)",
					p.name, i, r.Cuda.UUID[:4], cudaError(rc))
			}
			m = uint64(out)
			cp.mapped[r.Cuda.Handle] = m
		}
		cp.delta[i] = m - r.Cuda.Base
	}
	p.cuda = cp
	return nil
}

// closeCuda unmaps a peer's allocations (no copy may run through them:
// copyMu held for writing, or the mapping never used).
func (a *agent) closeCuda(cp *cudaPeer) {
	if cp == nil || a.cudaMain == nil {
		return
	}
	for _, m := range cp.mapped {
		C.gx_cuda_ipc_close(a.cudaMain, C.uint64_t(m))
	}
	cp.mapped = nil
}

// detachCuda forgets a peer's VRAM mappings; copyMu held for writing.
func (a *agent) detachCuda(p *peer) {
	a.closeCuda(p.cuda)
	p.cuda = nil
}

// cudaOps builds a VRAM transfer's gather operations from its coalesced
// UCP-style operations, translating the peer's addresses into its mapping
// here and splitting long runs into cudaChunk pieces.
func (a *agent) cudaOps(xop nixl.XferOp, p *peer, ops []op) (*C.gx_cuda_dev, []cop, error) {
	if p.cuda == nil {
		return nil, nil, fmt.Errorf("agent %q has no VRAM mapped here", p.name)
	}
	if len(ops) == 0 {
		return nil, nil, fmt.Errorf("no operations")
	}
	dev := -1
	n := 0
	for _, o := range ops {
		if dev >= 0 && int(o.memh) != dev {
			return nil, nil, fmt.Errorf("a VRAM transfer's local blocks lie on devices %d and %d: one device per transfer", dev, o.memh)
		}
		dev = int(o.memh)
		n += int((o.len + cudaChunk - 1) / cudaChunk)
	}
	d := a.cudaDevs[dev]
	if d == nil || (d != a.cudaMain && len(p.cuda.mapped) > 0) {
		return nil, nil, fmt.Errorf("local VRAM on device %d, but peers are mapped into device %d", dev, int(a.cudaMain.ordinal))
	}
	return d, gatherOps(xop, ops, p.cuda.delta, n), nil
}

// gatherOps turns coalesced operations into gather operations: the remote
// address moved by delta[rkey] (its place in this process), split into
// pieces of at most cudaChunk bytes; n is a capacity hint.
func gatherOps(xop nixl.XferOp, ops []op, delta []uint64, n int) []cop {
	cops := make([]cop, 0, n)
	for _, o := range ops {
		r := o.raddr + delta[o.rkey]
		for off := uint64(0); off < o.len; off += cudaChunk {
			c := cop{src: r + off, dst: o.laddr + off, len: min(cudaChunk, o.len-off)}
			if xop == nixl.Write {
				c.src, c.dst = c.dst, c.src
			}
			cops = append(cops, c)
		}
	}
	return cops
}

// gatherBlocks is a regions × blocks VRAM transfer as the gather_blocks
// kernel takes it: buf holds the region table (five words a region: src,
// dst, src stride, dst stride, length) then the block pairs (one word a
// pair: src block | dst block << 32).
type gatherBlocks struct {
	buf            []uint64
	nregs, npairs  int
	chunk, nchunks uint64
}

// cudaBlocks builds a regions × blocks VRAM transfer's region table and
// block pairs from its spans (MakeXferBlocks), translating the peer's
// addresses into its mapping here.
func (a *agent) cudaBlocks(xop nixl.XferOp, p *peer, spans []blockSpan, lb, rb []int32) (*C.gx_cuda_dev, *gatherBlocks, error) {
	if p.cuda == nil {
		return nil, nil, fmt.Errorf("agent %q has no VRAM mapped here", p.name)
	}
	dev := int(spans[0].memh)
	d := a.cudaDevs[dev]
	if d == nil || (d != a.cudaMain && len(p.cuda.mapped) > 0) {
		return nil, nil, fmt.Errorf("local VRAM on device %d is not the device peers are mapped into", dev)
	}
	g := &gatherBlocks{nregs: len(spans), npairs: len(lb), chunk: cudaChunk}
	g.buf = make([]uint64, 0, 5*len(spans)+len(lb))
	var longest uint64
	for _, s := range spans {
		if int(s.memh) != dev {
			return nil, nil, fmt.Errorf("a VRAM transfer's local blocks lie on devices %d and %d: one device per transfer", dev, s.memh)
		}
		remote := s.raddr + p.cuda.delta[s.rkey]
		if xop == nixl.Read {
			g.buf = append(g.buf, remote, s.laddr, s.rstride, s.lstride, s.len)
		} else {
			g.buf = append(g.buf, s.laddr, remote, s.lstride, s.rstride, s.len)
		}
		longest = max(longest, s.len)
	}
	for k := range lb {
		src, dst := uint64(uint32(rb[k])), uint64(uint32(lb[k]))
		if xop == nixl.Write {
			src, dst = dst, src
		}
		g.buf = append(g.buf, src|dst<<32)
	}
	g.nchunks = (longest + cudaChunk - 1) / cudaChunk
	return d, g, nil
}

// cudaCopy returns the copy function of a VRAM transfer: one upload of its
// operation table and one launch of the gather kernel, waited for.
func (x *xfer) cudaCopy() func() C.int {
	if g := x.cblocks; g != nil {
		return func() C.int {
			if rc := C.gx_cuda_gather_blocks(x.cdev, unsafe.Pointer(&g.buf[0]), C.size_t(len(g.buf)*8),
				C.size_t(g.nregs), C.size_t(g.npairs), C.uint64_t(g.chunk), C.uint64_t(g.nchunks)); rc != 0 {
				x.cudaErr = "gather kernel: " + cudaError(rc)
				return gxErrCUDA
			}
			return 0
		}
	}
	return func() C.int {
		if rc := C.gx_cuda_gather(x.cdev, (*C.gx_cop)(unsafe.Pointer(&x.cops[0])), C.size_t(len(x.cops))); rc != 0 {
			x.cudaErr = "gather kernel: " + cudaError(rc)
			return gxErrCUDA
		}
		return 0
	}
}

// closeCudaDevs releases the agent's devices (agent Close, last).
func (a *agent) closeCudaDevs() {
	for k, d := range a.cudaDevs {
		C.gx_cuda_dev_close(d)
		C.free(unsafe.Pointer(d))
		delete(a.cudaDevs, k)
	}
	a.cudaMain = nil
}
