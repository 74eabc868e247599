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
	"sort"
	"strings"
	"sync"
	"unsafe"

	"github.com/gonixl/gonixl/nixl"
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
	direct    bool // nixlAgent methods found: unmapped statuses
)

// candidates lists the libnixl_capi.so paths to try, most specific first.
func candidates() []string {
	var out []string
	if d := os.Getenv("NIXL_LIB_DIR"); d != "" {
		return []string{filepath.Join(d, capiName)}
	}
	var sites []string
	addVenv := func(venv string) {
		m, _ := filepath.Glob(filepath.Join(venv, "lib", "python3*", "site-packages"))
		sort.Sort(sort.Reverse(sort.StringSlice(m)))
		sites = append(sites, m...)
	}
	if v := os.Getenv("VIRTUAL_ENV"); v != "" {
		addVenv(v)
	}
	var starts []string
	if wd, err := os.Getwd(); err == nil {
		starts = append(starts, wd)
	}
	if exe, err := os.Executable(); err == nil {
		starts = append(starts, filepath.Dir(exe))
	}
	for _, s := range starts {
		for d := s; ; d = filepath.Dir(d) {
			if fi, err := os.Stat(filepath.Join(d, ".venv")); err == nil && fi.IsDir() {
				addVenv(filepath.Join(d, ".venv"))
			}
			if filepath.Dir(d) == d {
				break
			}
		}
	}
	seen := map[string]bool{}
	for _, site := range sites {
		for _, w := range wheelLibDirs {
			p := filepath.Join(site, w, capiName)
			if seen[p] {
				continue
			}
			seen[p] = true
			if _, err := os.Stat(p); err == nil {
				out = append(out, p)
			}
		}
	}
	// Last resort: the dynamic linker's search path.
	return append(out, capiName)
}

// load finds and dlopens the C API once per process.
func load() error {
	loadOnce.Do(func() {
		var errs []string
		for _, p := range candidates() {
			undo := prepareEnv(p)
			cp := C.CString(p)
			var buf [1024]C.char
			rc := C.gxnixl_load(cp, &buf[0], C.size_t(len(buf)))
			C.free(unsafe.Pointer(cp))
			if rc == 0 {
				loadedLib = p
				direct = C.gxnixl_have_direct_status() != 0
				return
			}
			undo()
			errs = append(errs, C.GoString(&buf[0]))
		}
		loadErr = fmt.Errorf("%w: NIXL not available: %s", nixl.ErrUnavailable, strings.Join(errs, "; "))
	})
	return loadErr
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
	if _, ok := os.LookupEnv("UCX_RCACHE_MAX_UNRELEASED"); !ok {
		_ = os.Setenv("UCX_RCACHE_MAX_UNRELEASED", "1024")
		set = append(set, "UCX_RCACHE_MAX_UNRELEASED")
	}
	return func() {
		for _, k := range set {
			_ = os.Unsetenv(k)
		}
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
