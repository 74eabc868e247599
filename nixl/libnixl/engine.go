package libnixl

/*
#include <stdlib.h>
#include "gxnixl.h"
*/
import "C"

import (
	"fmt"
	"strings"
	"time"
	"unsafe"

	"github.com/gonixl/gonixl/nixl"
)

// Engine is the "nixl" engine. The registered instance is the only one.
type Engine struct{}

func init() { nixl.Register(Engine{}) }

func (Engine) Name() string { return "nixl" }

// Available loads the library on first call.
func (Engine) Available() error { return load() }

// Supports reports the memory types NIXL's plugins can move in general;
// whether this host's backends can register a type shows at RegisterMem.
func (Engine) Supports(m nixl.MemType) bool {
	switch m {
	case nixl.DRAM, nixl.VRAM, nixl.BLK, nixl.OBJ, nixl.FILE:
		return true
	}
	return false
}

func (Engine) Info() string {
	if err := load(); err != nil {
		return err.Error()
	}
	st := "NIXL's own (nixlAgent post/status/release)"
	if !direct {
		st = "the C API's (errors other than INVALID_PARAM/NOT_FOUND/NO_TELEMETRY reported as BACKEND)"
	}
	return fmt.Sprintf("NIXL %s via %s; NIXL_PLUGIN_DIR=%s; transfer statuses: %s", version, loadedLib, pluginDir, st)
}

// numThreadsKey is the backend parameter NIXL's Python API sets from
// num_threads, per plugin.
func numThreadsKey(backend string) string {
	switch backend {
	case "UCX", "OBJ", "LIBFABRIC":
		return "num_threads"
	case "GDS_MT":
		return "thread_count"
	case "UCCL":
		return "num_cpus"
	}
	return ""
}

// NewAgent creates a NIXL agent with the configured backends. A backend
// whose plugin is missing is skipped (as NIXL's Python API does); an agent
// with no backend at all is an error.
func (e Engine) NewAgent(cfg nixl.AgentConfig) (nixl.Agent, error) {
	if err := load(); err != nil {
		return nil, err
	}
	if cfg.Name == "" {
		return nil, nixl.Errorf(nixl.ErrInvalidParam, "NewAgent", "empty agent name")
	}
	if strings.IndexByte(cfg.Name, 0) >= 0 {
		return nil, nixl.Errorf(nixl.ErrInvalidParam, "NewAgent", "agent name contains NUL")
	}
	backends := cfg.Backends
	if len(backends) == 0 {
		backends = []string{"UCX"}
	}
	cname := C.CString(cfg.Name)
	defer C.free(unsafe.Pointer(cname))
	var h unsafe.Pointer
	prog, tel := 0, 0
	if cfg.ProgressThread {
		prog = 1
	}
	if cfg.Telemetry {
		tel = 1
	}
	if cfg.ProgressDelay < 0 {
		return nil, nixl.Errorf(nixl.ErrInvalidParam, "NewAgent", "negative progress delay %v", cfg.ProgressDelay)
	}
	delayUs := uint64(cfg.ProgressDelay / time.Microsecond)
	if s := C.gxnixl_agent_new(cname, C.int(prog), 0, C.int(tel), C.uint64_t(delayUs), &h); s != 0 {
		return nil, statusErr("NewAgent", s, "creating agent %q", cfg.Name)
	}
	a := &agent{h: h, name: cfg.Name, cfg: cfg, lists: map[*descList]struct{}{}, xfers: map[*xfer]struct{}{}}
	fail := func(err error) (nixl.Agent, error) {
		a.Close()
		return nil, err
	}
	if s := C.gxnixl_notif_map_new(&a.nmap); s != 0 {
		return fail(statusErr("NewAgent", s, "creating notification map"))
	}
	plugins, err := a.plugins()
	if err != nil {
		return fail(err)
	}
	for _, b := range backends {
		if !contains(plugins, b) {
			a.skipped = append(a.skipped, b)
			continue
		}
		params := map[string]string{}
		if k := numThreadsKey(b); k != "" && cfg.NumThreads > 0 {
			params[k] = fmt.Sprint(cfg.NumThreads)
		}
		for k, v := range cfg.BackendParams[b] {
			params[k] = v
		}
		if err := a.createBackend(b, params); err != nil {
			return fail(err)
		}
		a.backends = append(a.backends, b)
	}
	if len(a.backends) == 0 {
		return fail(nixl.Errorf(nixl.ErrNotFound, "NewAgent", "none of the backends %v has a plugin (available: %v, NIXL_PLUGIN_DIR=%s)", backends, plugins, pluginDir))
	}
	return a, nil
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// statusErr turns a non-success NIXL status into a *nixl.Error.
func statusErr(op string, s C.int, format string, args ...any) error {
	return &nixl.Error{Status: nixl.Status(s), Op: op, Msg: fmt.Sprintf(format, args...)}
}
