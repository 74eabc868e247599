//go:build cgo && !gonixl_noucx

package ucx

/*
#cgo CFLAGS: -O2 -Wall
#cgo LDFLAGS: -ldl -lpthread
#include <stdlib.h>
#include "gxucx.h"
*/
import "C"

import (
	"fmt"
	"strings"
	"sync"
	"unsafe"

	"github.com/gonixl/gonixl/nixl"
)

// The C array of operations is a []op reinterpreted: same size and field
// offsets, checked here at compile time.
var (
	_ [unsafe.Sizeof(C.gx_iov{}) - unsafe.Sizeof(op{})]byte
	_ [unsafe.Sizeof(op{}) - unsafe.Sizeof(C.gx_iov{})]byte
	_ [unsafe.Offsetof(C.gx_iov{}.rkey_idx) - unsafe.Offsetof(op{}.rkey)]byte
	_ [unsafe.Offsetof(op{}.rkey) - unsafe.Offsetof(C.gx_iov{}.rkey_idx)]byte
	_ [unsafe.Offsetof(C.gx_iov{}.memh_idx) - unsafe.Offsetof(op{}.memh)]byte
	_ [unsafe.Offsetof(op{}.memh) - unsafe.Offsetof(C.gx_iov{}.memh_idx)]byte
)

func init() { nixl.Register(theEngine) }

var theEngine = &engine{}

// engine loads libucp once per process. A process can hold only one UCX
// (its symbols are process-wide); the first successful load wins.
type engine struct {
	once    sync.Once
	err     error
	path    string // the file that defines ucp_init_version
	version [3]uint
	tried   []string // candidates and why each failed
}

func (e *engine) Name() string { return EngineName }

func (e *engine) Available() error {
	e.once.Do(e.load)
	return e.err
}

// Supports reports DRAM, and VRAM where the CUDA driver loads: VRAM moves
// by CUDA IPC between processes of one host (cuda.go), not through UCX
// (Debian's UCX 1.13 has no CUDA transports).
func (e *engine) Supports(mem nixl.MemType) bool {
	return mem == nixl.DRAM || (mem == nixl.VRAM && cudaAvailable() == nil)
}

func (e *engine) Info() string {
	if err := e.Available(); err != nil {
		return "ucx: unavailable: " + err.Error()
	}
	s := fmt.Sprintf("ucx: libucp %d.%d.%d from %s", e.version[0], e.version[1], e.version[2], e.path)
	if len(e.tried) > 0 {
		s += " (skipped: " + strings.Join(e.tried, "; ") + ")"
	}
	if e.version[0] == 1 && e.version[1] == 13 {
		s += "; " + tcpCaveat
	}
	return s
}

// tcpCaveat is said with the engine's description when it runs on UCX
// 1.13 (Debian 12's libucx0): its TCP transport, which carries every
// transfer to a peer on another host or in another network namespace,
// crashed a process in uct_tcp_iface_progress (SIGSEGV) on a first
// transfer in 14 of 120 two-process runs here, and in 0 of 60 with UCX
// 1.22 (docs/environment-ucx.md).
const tcpCaveat = "caveat: UCX 1.13's TCP transport can crash this process on a first transfer over TCP " +
	"(peers on other hosts or in other network namespaces); a libucx wheel (pip install libucx-cu12, " +
	"preferred by this engine when installed) or GONIXL_UCX_LIB naming a newer libucp avoids it"

// Version returns the loaded libucp's version, or zeros before a load.
func Version() (major, minor, release uint) {
	if theEngine.Available() != nil {
		return 0, 0, 0
	}
	v := theEngine.version
	return v[0], v[1], v[2]
}

// LibraryPath returns the libucp file in use, or "" when none loaded.
func LibraryPath() string {
	if theEngine.Available() != nil {
		return ""
	}
	return theEngine.path
}

// GX error codes added by gxucx.c on top of ucs_status_t.
const (
	gxErrRepostActive = -1001
	gxErrEpFailed     = -1002
	gxErrEpClosed     = -1003
	gxErrCMADenied    = -1004
	gxErrShmRevoked   = -1005
)

// statusOf maps a gxucx return code to NIXL's status, as NIXL's UCX plugin
// does: connection-level failures are REMOTE_DISCONNECT, bad arguments
// INVALID_PARAM, everything else BACKEND.
func statusOf(rc C.int) nixl.Status {
	switch int(rc) {
	case 0:
		return nixl.Success
	case 1:
		return nixl.InProgress
	case gxErrRepostActive:
		return nixl.ErrRepostActive
	case gxErrEpFailed, gxErrEpClosed,
		C.UCS_ERR_NOT_CONNECTED, C.UCS_ERR_CONNECTION_RESET, C.UCS_ERR_ENDPOINT_TIMEOUT, C.UCS_ERR_CANCELED:
		return nixl.ErrRemoteDiscon
	case C.UCS_ERR_INVALID_PARAM:
		return nixl.ErrInvalidParam
	}
	if int(rc) <= C.UCS_ERR_FIRST_LINK_FAILURE && int(rc) >= C.UCS_ERR_LAST_ENDPOINT_FAILURE {
		return nixl.ErrRemoteDiscon
	}
	return nixl.ErrBackend
}

func rcError(rc C.int, op, what string) error {
	return &nixl.Error{Status: statusOf(rc), Op: op, Msg: what + ": " + C.GoString(C.gx_status_string(rc))}
}

// statusOfInt is statusOf for Go callers (tests).
func statusOfInt(rc int) nixl.Status { return statusOf(C.int(rc)) }
