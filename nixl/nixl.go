package nixl

import (
	"errors"
	"fmt"
	"math/bits"
	"sort"
	"sync"
	"time"
)

// MemType is the kind of memory a descriptor points at. Values match NIXL's
// nixl_mem_t.
type MemType int32

const (
	DRAM MemType = 0
	VRAM MemType = 1
	BLK  MemType = 2
	OBJ  MemType = 3
	FILE MemType = 4
)

func (m MemType) String() string {
	switch m {
	case DRAM:
		return "DRAM"
	case VRAM:
		return "VRAM"
	case BLK:
		return "BLK"
	case OBJ:
		return "OBJ"
	case FILE:
		return "FILE"
	}
	return fmt.Sprintf("MemType(%d)", int32(m))
}

// ParseMemType accepts NIXL's memory-type strings, including the deprecated
// "cpu" and "cuda" spellings.
func ParseMemType(s string) (MemType, error) {
	switch s {
	case "DRAM", "cpu":
		return DRAM, nil
	case "VRAM", "cuda":
		return VRAM, nil
	case "BLK", "BLOCK":
		return BLK, nil
	case "OBJ":
		return OBJ, nil
	case "FILE":
		return FILE, nil
	}
	return 0, fmt.Errorf("nixl: unknown memory type %q", s)
}

// XferOp is the direction of a one-sided transfer. Values match nixl_xfer_op_t.
type XferOp int32

const (
	Read  XferOp = 0 // remote → local
	Write XferOp = 1 // local → remote
)

func (o XferOp) String() string {
	switch o {
	case Read:
		return "READ"
	case Write:
		return "WRITE"
	}
	return fmt.Sprintf("XferOp(%d)", int32(o))
}

// Status is a NIXL status code. The values are NIXL's own (nixl_status_t) and
// are kept distinct: a remote disconnect is not a generic backend error.
type Status int32

const (
	InProgress      Status = 1
	Success         Status = 0
	ErrNotPosted    Status = -1
	ErrInvalidParam Status = -2
	ErrBackend      Status = -3
	ErrNotFound     Status = -4
	ErrMismatch     Status = -5
	ErrNotAllowed   Status = -6
	ErrRepostActive Status = -7
	ErrUnknown      Status = -8
	ErrNotSupported Status = -9
	ErrRemoteDiscon Status = -10
	ErrCanceled     Status = -11
	ErrNoTelemetry  Status = -12
)

var statusNames = map[Status]string{
	InProgress:      "IN_PROG",
	Success:         "SUCCESS",
	ErrNotPosted:    "ERR_NOT_POSTED",
	ErrInvalidParam: "ERR_INVALID_PARAM",
	ErrBackend:      "ERR_BACKEND",
	ErrNotFound:     "ERR_NOT_FOUND",
	ErrMismatch:     "ERR_MISMATCH",
	ErrNotAllowed:   "ERR_NOT_ALLOWED",
	ErrRepostActive: "ERR_REPOST_ACTIVE",
	ErrUnknown:      "ERR_UNKNOWN",
	ErrNotSupported: "ERR_NOT_SUPPORTED",
	ErrRemoteDiscon: "ERR_REMOTE_DISCONNECT",
	ErrCanceled:     "ERR_CANCELED",
	ErrNoTelemetry:  "ERR_NO_TELEMETRY",
}

func (s Status) String() string {
	if n, ok := statusNames[s]; ok {
		return n
	}
	return fmt.Sprintf("Status(%d)", int32(s))
}

// IsError reports whether s is a terminal error (negative).
func (s Status) IsError() bool { return s < 0 }

// Error is the typed error every engine returns. Status keeps NIXL's code;
// errors.Is(err, Status) matches on the code.
type Error struct {
	Status Status
	Op     string // the API operation that failed, e.g. "LoadRemoteMetadata"
	Msg    string
	Err    error // optional cause
}

func (e *Error) Error() string {
	s := "nixl: " + e.Op + ": " + e.Status.String()
	if e.Msg != "" {
		s += ": " + e.Msg
	}
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	return s
}

func (e *Error) Unwrap() error { return e.Err }

// Is lets errors.Is(err, nixl.ErrRemoteDiscon) match by status.
func (e *Error) Is(target error) bool {
	if s, ok := target.(Status); ok {
		return e.Status == s
	}
	return false
}

// Error makes Status usable as an errors.Is target.
func (s Status) Error() string { return "nixl: " + s.String() }

// Errorf builds an *Error.
func Errorf(st Status, op, format string, args ...any) *Error {
	return &Error{Status: st, Op: op, Msg: fmt.Sprintf(format, args...)}
}

// StatusOf returns the NIXL status carried by err: Success for nil, the code
// of an *Error, ErrUnknown for anything else.
func StatusOf(err error) Status {
	if err == nil {
		return Success
	}
	var e *Error
	if errors.As(err, &e) {
		return e.Status
	}
	return ErrUnknown
}

// ErrUnavailable is wrapped by Engine.Available and Open when an engine's
// native library cannot be loaded on this host.
var ErrUnavailable = errors.New("engine not available")

// Desc is one contiguous memory range: NIXL's nixlBasicDesc.
type Desc struct {
	Addr  uint64
	Len   uint64
	DevID uint64
}

// Region is a registration descriptor (nixlBlobDesc without metaInfo, which
// gonixl never uses for DRAM/VRAM).
type Region = Desc

// AgentConfig configures a new agent.
type AgentConfig struct {
	// Name must be unique across the deployment (vLLM uses a UUID).
	Name string
	// Backends lists NIXL plugin names in order of preference; default ["UCX"].
	// Engines that are themselves a single transport (ucx) accept only "UCX".
	Backends []string
	// BackendParams holds per-backend init parameters (string→string).
	BackendParams map[string]map[string]string
	// ProgressThread lets the engine progress transfers on its own thread.
	ProgressThread bool
	// ProgressDelay is how long that thread waits for an event before it
	// progresses everything anyway (NIXL's pthrDelay). Zero makes NIXL's UCX
	// progress thread poll without waiting: a busy loop that takes a whole
	// core (what NIXL's Python API always asks for).
	ProgressDelay time.Duration
	// NumThreads > 0 is passed to backends as num_threads.
	NumThreads int
	// Telemetry requests per-transfer telemetry (vLLM always asks for it).
	Telemetry bool
}

// Telemetry describes one finished transfer, as nixl_xfer_telem_t does.
type Telemetry struct {
	Start     time.Time
	PostDur   time.Duration // time spent in Post
	XferDur   time.Duration // from the start of Post to the poll that saw completion
	Bytes     uint64        // sum of local descriptor lengths
	DescCount int           // descriptors after merging
}

// Notif is one received notification.
type Notif struct {
	Agent string // sender's agent name
	Msg   []byte
}

// Agent is one transfer agent. See the package comment for the concurrency
// contract.
type Agent interface {
	// Name returns the agent's name.
	Name() string
	// Engine returns the engine name this agent belongs to ("nixl", "ucx", ...).
	Engine() string
	// RegisterMem registers regions of one memory type with every backend
	// that supports it. The memory is owned by the caller and must stay valid
	// until DeregisterMem.
	RegisterMem(mem MemType, regions []Region) error
	// DeregisterMem undoes RegisterMem; regions must match exactly.
	DeregisterMem(mem MemType, regions []Region) error
	// LocalMetadata returns this agent's metadata blob (connection info and
	// registered regions) to hand to peers.
	LocalMetadata() ([]byte, error)
	// LoadRemoteMetadata loads a peer's blob and returns the peer's agent name.
	// Garbage is an error, never a crash.
	LoadRemoteMetadata(md []byte) (string, error)
	// InvalidateRemote forgets a peer and disconnects from it.
	InvalidateRemote(agent string) error
	// PrepDescList prepares a descriptor list once for repeated use. agent is
	// "" for the local side, or a loaded remote agent's name. Every
	// descriptor must lie inside a region registered (locally, or advertised
	// by the remote) for mem.
	PrepDescList(agent string, mem MemType, descs []Desc) (DescList, error)
	// MakeXfer builds a transfer between prepared lists from descriptor
	// indices (the arrays cross into native code whole). localIdx and
	// remoteIdx must have the same non-zero length, every index must be in
	// range and each pair must have equal lengths; violations are errors
	// before anything is posted. notif, if non-nil, is delivered to the
	// remote agent once all data of the transfer is complete.
	MakeXfer(op XferOp, local DescList, localIdx []int32, remote DescList, remoteIdx []int32, notif []byte) (Xfer, error)
	// SendNotif sends a standalone notification to a loaded remote agent.
	SendNotif(agent string, msg []byte) error
	// GetNotifs drains the notifications received since the last call.
	GetNotifs() ([]Notif, error)
	// Close releases everything the agent holds. Idempotent.
	Close() error
}

// DescList is a prepared descriptor list.
type DescList interface {
	Len() int
	Agent() string // "" for a local list
	Release() error
}

// Xfer is a prepared transfer request. Post returns InProgress or Success;
// Check polls it. Both return a non-nil error whose status is the NIXL
// error code when the transfer failed. A finished Xfer can be posted again.
type Xfer interface {
	Post() (Status, error)
	Check() (Status, error)
	// Telemetry is valid after Check returned Success; before that it
	// returns InProgress.
	Telemetry() (Telemetry, Status)
	// Release cancels an in-flight transfer if possible and frees the
	// request. Releasing twice is an error, not a crash.
	Release() error
}

// Engine creates agents of one implementation.
type Engine interface {
	// Name is the registry key: "nixl", "ucx", "fake".
	Name() string
	// Available reports why the engine cannot run on this host (wrapping
	// ErrUnavailable), or nil. It loads native libraries on first call.
	Available() error
	// Supports reports whether the engine can register and move mem.
	Supports(mem MemType) bool
	// NewAgent creates an agent.
	NewAgent(cfg AgentConfig) (Agent, error)
	// Info describes the loaded native library (paths, versions) for logs.
	Info() string
}

var (
	regMu   sync.Mutex
	engines = map[string]Engine{}
)

// Register makes an engine available by name. It panics on a duplicate
// name, which is a programming error caught at init.
func Register(e Engine) {
	regMu.Lock()
	defer regMu.Unlock()
	if _, dup := engines[e.Name()]; dup {
		panic("nixl: engine registered twice: " + e.Name())
	}
	engines[e.Name()] = e
}

// Lookup returns a registered engine.
func Lookup(name string) (Engine, error) {
	regMu.Lock()
	defer regMu.Unlock()
	e, ok := engines[name]
	if !ok {
		return nil, fmt.Errorf("nixl: no engine named %q (registered: %v)", name, namesLocked())
	}
	return e, nil
}

// Engines lists registered engine names, sorted.
func Engines() []string {
	regMu.Lock()
	defer regMu.Unlock()
	return namesLocked()
}

func namesLocked() []string {
	out := make([]string, 0, len(engines))
	for n := range engines {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// Select resolves a transfer_engine setting: "nixl", "ucx", or "auto" (NIXL
// when it loads and supports mem, else UCX). It returns the chosen engine
// and, for auto, why the others were passed over.
func Select(kind string, mem MemType) (Engine, string, error) {
	if kind == "" {
		kind = "auto"
	}
	if kind != "auto" {
		e, err := Lookup(kind)
		if err != nil {
			return nil, "", err
		}
		if err := e.Available(); err != nil {
			return nil, "", err
		}
		if !e.Supports(mem) {
			return nil, "", fmt.Errorf("nixl: engine %q cannot move %v memory", kind, mem)
		}
		return e, "configured", nil
	}
	var why []string
	for _, name := range []string{"nixl", "ucx"} {
		e, err := Lookup(name)
		if err != nil {
			why = append(why, name+": not built in")
			continue
		}
		if err := e.Available(); err != nil {
			why = append(why, name+": "+err.Error())
			continue
		}
		if !e.Supports(mem) {
			why = append(why, fmt.Sprintf("%s: no %v support", name, mem))
			continue
		}
		reason := "auto"
		if len(why) > 0 {
			reason = fmt.Sprintf("auto (skipped %v)", why)
		}
		return e, reason, nil
	}
	return nil, "", fmt.Errorf("nixl: no transfer engine available: %v: %w", why, ErrUnavailable)
}

// Strided is Count descriptors of Len bytes at Addr, Addr+Stride, ...,
// Addr+(Count-1)*Stride on device DevID: one region's blocks of a KV cache.
type Strided struct {
	Addr, Stride, Len, Count, DevID uint64
}

// StridedPreparer is implemented by agents that keep a descriptor list as
// strided runs, checking each run once instead of expanding it (a large
// model's remote list is 1.6M descriptors but a few hundred runs). The list
// behaves exactly as PrepDescList's of the expanded descriptors: index i of
// run r is the sum of the earlier runs' counts plus i.
type StridedPreparer interface {
	PrepStridedDescList(agent string, mem MemType, runs []Strided) (DescList, error)
}

// maxStridedDescs bounds the expanded length of a strided list (the index
// arrays that address it are int32).
const maxStridedDescs = 1<<31 - 1

// PrepStrided prepares runs on a: through StridedPreparer when a implements
// it, else as PrepDescList of the expanded descriptors.
func PrepStrided(a Agent, agent string, mem MemType, runs []Strided) (DescList, error) {
	var n uint64
	for i, r := range runs {
		if err := r.check(); err != nil {
			return nil, Errorf(ErrInvalidParam, "PrepDescList", "run %d: %v", i, err)
		}
		n += r.Count
		if n > maxStridedDescs {
			return nil, Errorf(ErrInvalidParam, "PrepDescList", "runs expand to more than %d descriptors", maxStridedDescs)
		}
	}
	if sp, ok := a.(StridedPreparer); ok {
		return sp.PrepStridedDescList(agent, mem, runs)
	}
	return a.PrepDescList(agent, mem, ExpandStrided(runs))
}

// ExpandStrided lists runs' descriptors in order.
func ExpandStrided(runs []Strided) []Desc {
	n := 0
	for _, r := range runs {
		n += int(r.Count)
	}
	out := make([]Desc, 0, n)
	for _, r := range runs {
		for k := uint64(0); k < r.Count; k++ {
			out = append(out, Desc{Addr: r.Addr + k*r.Stride, Len: r.Len, DevID: r.DevID})
		}
	}
	return out
}

// check reports a run that is empty or whose last byte overflows.
func (r Strided) check() error {
	if r.Len == 0 || r.Count == 0 {
		return fmt.Errorf("empty run (len %d, count %d)", r.Len, r.Count)
	}
	if _, ok := r.End(); !ok {
		return fmt.Errorf("run %#x + %d x %d (+%d) overflows", r.Addr, r.Count-1, r.Stride, r.Len)
	}
	return nil
}

// End returns the end of the run's last descriptor (exclusive) and whether
// it is representable.
func (r Strided) End() (uint64, bool) {
	if r.Count == 0 {
		return r.Addr, true
	}
	hi, span := bits.Mul64(r.Count-1, r.Stride)
	if hi != 0 {
		return 0, false
	}
	last, c1 := bits.Add64(r.Addr, span, 0)
	end, c2 := bits.Add64(last, r.Len, 0)
	return end, c1 == 0 && c2 == 0
}

// BlockRegion is one region of a transfer given as regions × blocks: the
// ids of its block 0 in the local and in the remote descriptor list (for a
// KV cache prepared one strided run per region, region r's block 0 is
// descriptor r*num_blocks).
type BlockRegion struct{ Local, Remote int32 }

// BlockXferMaker is implemented by agents that build a transfer from its
// structure rather than from one index pair per descriptor: every region
// of regions times every block pair k, local descriptor
// Local+localBlocks[k] paired with remote descriptor Remote+remoteBlocks[k],
// region-major. The transfer is the one MakeXfer makes from ExpandBlocks'
// index arrays; an engine that keeps the structure (the ucx engine's CUDA
// path sends the region table and the block pairs, a few kilobytes, to
// the device) never materialises them.
type BlockXferMaker interface {
	MakeXferBlocks(op XferOp, local DescList, remote DescList, regions []BlockRegion, localBlocks, remoteBlocks []int32, notif []byte) (Xfer, error)
}

// MakeXferBlocks makes a regions × blocks transfer on a: through
// BlockXferMaker when a implements it, else MakeXfer over the expanded
// index arrays.
func MakeXferBlocks(a Agent, op XferOp, local DescList, remote DescList, regions []BlockRegion, localBlocks, remoteBlocks []int32, notif []byte) (Xfer, error) {
	if len(regions) == 0 || len(localBlocks) == 0 || len(localBlocks) != len(remoteBlocks) {
		return nil, Errorf(ErrInvalidParam, "MakeXfer", "want regions and equal, non-empty block lists (%d regions, %d and %d blocks)",
			len(regions), len(localBlocks), len(remoteBlocks))
	}
	if m, ok := a.(BlockXferMaker); ok {
		return m.MakeXferBlocks(op, local, remote, regions, localBlocks, remoteBlocks, notif)
	}
	li, ri, err := ExpandBlocks(regions, localBlocks, remoteBlocks)
	if err != nil {
		return nil, err
	}
	return a.MakeXfer(op, local, li, remote, ri, notif)
}

// ExpandBlocks returns the index arrays of a regions × blocks transfer,
// region-major.
func ExpandBlocks(regions []BlockRegion, localBlocks, remoteBlocks []int32) (li, ri []int32, err error) {
	n := len(regions) * len(localBlocks)
	if len(localBlocks) != len(remoteBlocks) || n/max(len(regions), 1) != len(localBlocks) || n > maxStridedDescs {
		return nil, nil, Errorf(ErrInvalidParam, "MakeXfer", "%d regions × %d/%d blocks", len(regions), len(localBlocks), len(remoteBlocks))
	}
	li, ri = make([]int32, n), make([]int32, n)
	if n == 0 {
		return li, ri, nil
	}
	// The block lists' extremes bound every index of a region: a region
	// whose bounds are in range is filled without a check per descriptor
	// (its sums then fit in int32), the others pair by pair, which finds
	// the same first bad pair, region-major.
	lmin, lmax := minMax(localBlocks)
	rmin, rmax := minMax(remoteBlocks)
	nb := len(localBlocks)
	for i, r := range regions {
		dl, dr := li[i*nb:(i+1)*nb], ri[i*nb:(i+1)*nb]
		if inIndexRange(int64(r.Local)+lmin, int64(r.Local)+lmax) && inIndexRange(int64(r.Remote)+rmin, int64(r.Remote)+rmax) {
			for k, b := range localBlocks {
				dl[k] = r.Local + b
			}
			for k, b := range remoteBlocks {
				dr[k] = r.Remote + b
			}
			continue
		}
		for k := range localBlocks {
			l, m := int64(r.Local)+int64(localBlocks[k]), int64(r.Remote)+int64(remoteBlocks[k])
			if !inIndexRange(l, l) || !inIndexRange(m, m) {
				return nil, nil, Errorf(ErrInvalidParam, "MakeXfer", "region (%d, %d) block pair %d (%d, %d): index out of range",
					r.Local, r.Remote, k, localBlocks[k], remoteBlocks[k])
			}
			dl[k], dr[k] = int32(l), int32(m)
		}
	}
	return li, ri, nil
}

// minMax returns the smallest and largest of a non-empty v.
func minMax(v []int32) (lo, hi int64) {
	a, b := v[0], v[0]
	for _, x := range v[1:] {
		a, b = min(a, x), max(b, x)
	}
	return int64(a), int64(b)
}

// inIndexRange reports whether [lo, hi] lies within a descriptor list's
// index range [0, maxStridedDescs].
func inIndexRange(lo, hi int64) bool { return lo >= 0 && hi <= maxStridedDescs }
