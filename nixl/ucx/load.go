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
	"os"
	"path/filepath"
	"strings"
	"unsafe"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/nixl/internal/native"
)

// candidates lists the libraries to try, in order: GONIXL_UCX_LIB alone if
// set; else libucp.so.0 from a libucx wheel (libucx-cu12/-cu13) in any
// Python site-packages this process can see (native.SitePackages); else the
// system soname.
func candidates() []string {
	if p := os.Getenv(EnvLib); p != "" {
		return []string{p}
	}
	return append(native.Find(filepath.Join("libucx", "lib", "libucp.so.0")), "libucp.so.0")
}

func (e *engine) load() {
	native.SetUCXDefaults() // before the first dlopen: libucs reads them when loaded
	errBuf := (*C.char)(C.malloc(1024))
	defer C.free(unsafe.Pointer(errBuf))
	for _, p := range candidates() {
		cp := C.CString(p)
		rc := C.gx_load(cp, errBuf, 1024)
		C.free(unsafe.Pointer(cp))
		if rc != 0 {
			e.tried = append(e.tried, p+": "+C.GoString(errBuf))
			continue
		}
		e.path = C.GoString(C.gx_loaded_path())
		var ma, mi, re C.uint
		C.gx_version(&ma, &mi, &re)
		e.version = [3]uint{uint(ma), uint(mi), uint(re)}
		if e.version[0] != 1 || e.version[1] < 13 {
			// The binding is written against the 1.13 API; older
			// libraries lack calls or struct fields it uses.
			e.err = fmt.Errorf("ucx: %s is UCX %d.%d, need 1.13 or newer: %w", e.path, e.version[0], e.version[1], nixl.ErrUnavailable)
			return
		}
		return
	}
	e.err = fmt.Errorf("ucx: cannot load libucp (%s; install libucx0 or set %s): %w",
		strings.Join(e.tried, "; "), EnvLib, nixl.ErrUnavailable)
	e.tried = nil
}
