package libnixl

/*
#cgo LDFLAGS: -ldl
#include <stdlib.h>
#include "gxnixl.h"
*/
import "C"

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"unsafe"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/nixl/internal/native"
)

const capiName = "libnixl_capi.so"

// wheelLibDirs are the lib directories of the nixl wheels, relative to
// site-packages, in order of preference.
var wheelLibDirs = []string{".nixl_cu12.mesonpy.libs", ".nixl_cu13.mesonpy.libs"}

var (
	loadOnce  sync.Once
	loadErr   error
	loadedLib string // path given to dlopen
	pluginDir string
	direct    bool   // nixlAgent methods found: unmapped statuses
	version   string // NIXL version of the loaded library
)

// candidates lists the libnixl_capi.so paths to try, most specific first.
func candidates() []string {
	if d := os.Getenv("NIXL_LIB_DIR"); d != "" {
		return []string{filepath.Join(d, capiName)}
	}
	var rels []string
	for _, w := range wheelLibDirs {
		rels = append(rels, filepath.Join(w, capiName))
	}
	out := native.Find(rels...)
	// Last resort: the dynamic linker's search path.
	return append(out, capiName)
}

// load finds and dlopens the C API once per process. Candidates that do
// not open are passed over. The first that opens is the process's NIXL:
// its version is checked before any symbol is resolved, then every symbol
// gonixl needs is resolved; if either fails the library is closed and NIXL
// is unavailable. No further candidate is tried then, since its
// dependencies would bind by soname to the libraries already loaded (for
// libnixl.so, which cannot be unloaded, for the rest of the process).
func load() error {
	loadOnce.Do(func() {
		var errs []string
		for _, p := range candidates() {
			undo := prepareEnv(p)
			cp := C.CString(p)
			var buf [1024]C.char
			rc := C.gxnixl_open(cp, &buf[0], C.size_t(len(buf)))
			C.free(unsafe.Pointer(cp))
			if rc != 0 {
				undo()
				errs = append(errs, C.GoString(&buf[0]))
				continue
			}
			if err := admit(p); err != nil {
				C.gxnixl_close()
				undo()
				loadErr = fmt.Errorf("%w: NIXL not available: %w", nixl.ErrUnavailable, err)
				return
			}
			loadedLib = p
			direct = C.gxnixl_have_direct_status() != 0
			return
		}
		loadErr = fmt.Errorf("%w: NIXL not available: %s", nixl.ErrUnavailable, strings.Join(errs, "; "))
	})
	return loadErr
}

// admit checks the opened library's NIXL version against the supported
// range, then resolves every symbol. Until the version is accepted nothing
// of the library is looked up or called: its version is read from the
// file of the libnixl_common.so that the dynamic linker loaded with it.
func admit(p string) error {
	capi := loadedFile("")
	if capi == "" {
		capi = p
	}
	common := loadedFile(versionLib)
	if common == "" {
		return nixl.Errorf(nixl.ErrNotSupported, "Load",
			"cannot tell which NIXL %s is: it did not load %s, which carries the version; gonixl supports %s",
			capi, versionLib, supportedText())
	}
	v, err := libraryVersion(common)
	if err != nil {
		return nixl.Errorf(nixl.ErrNotSupported, "Load",
			"cannot tell which NIXL %s is: no version in %s (%v); gonixl supports %s",
			capi, common, err, supportedText())
	}
	if !supportedVersion(v) {
		return nixl.Errorf(nixl.ErrNotSupported, "Load",
			"%s is NIXL %s (version from %s); gonixl supports %s and does not call into another version's C API",
			capi, v, common, supportedText())
	}
	var missing, msg [512]C.char
	if C.gxnixl_resolve(&missing[0], C.size_t(len(missing)), &msg[0], C.size_t(len(msg))) != 0 {
		return nixl.Errorf(nixl.ErrNotFound, "Load",
			"%s (NIXL %s) lacks symbol %s, which gonixl needs: %s",
			capi, v, C.GoString(&missing[0]), C.GoString(&msg[0]))
	}
	version = v
	return nil
}

// loadedFile returns the file of the loaded object soname ("": the opened
// C API library), or "".
func loadedFile(soname string) string {
	var cs *C.char
	if soname != "" {
		cs = C.CString(soname)
		defer C.free(unsafe.Pointer(cs))
	}
	var buf [4096]C.char
	if C.gxnixl_loaded_file(cs, &buf[0], C.size_t(len(buf))) != 0 {
		return ""
	}
	return filepath.Clean(C.GoString(&buf[0]))
}

// requiredSymbols lists the C API symbols that must all resolve.
func requiredSymbols() []string {
	n := int(C.gxnixl_required_count())
	out := make([]string, 0, n)
	for i := 0; i < n; i++ {
		out = append(out, C.GoString(C.gxnixl_required_name(C.size_t(i))))
	}
	return out
}

// prepareEnv sets what NIXL and UCX read at initialisation, unless the user
// set it: the plugin directory beside the library, and UCX's registration
// cache bound. os.Setenv reaches the C environment (getenv) under cgo.
// The returned function undoes it, for a candidate that fails to load.
func prepareEnv(lib string) (undo func()) {
	var set []string
	if dir := filepath.Dir(lib); dir != "." {
		p := filepath.Join(dir, "plugins")
		if fi, err := os.Stat(p); err == nil && fi.IsDir() {
			if os.Getenv("NIXL_PLUGIN_DIR") == "" {
				_ = os.Setenv("NIXL_PLUGIN_DIR", p)
				set = append(set, "NIXL_PLUGIN_DIR")
			}
		}
	}
	pluginDir = os.Getenv("NIXL_PLUGIN_DIR")
	set = append(set, native.SetUCXDefaults()...)
	return func() {
		native.Unset(set)
		pluginDir = ""
	}
}

// LibraryPath returns the libnixl_capi.so that was loaded, or "" before a
// successful load.
func LibraryPath() string {
	if load() != nil {
		return ""
	}
	return loadedLib
}

// Version returns the NIXL version of the loaded library, or "" when none
// loaded.
func Version() string {
	if load() != nil {
		return ""
	}
	return version
}

// SupportedVersions names the NIXL versions this binding loads.
func SupportedVersions() string { return supportedText() }
