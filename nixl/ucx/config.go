package ucx

import (
	"fmt"
	"sort"
	"strings"

	"github.com/gonixl/gonixl/nixl"
)

// Backend parameters read from AgentConfig.BackendParams["UCX"]. The names
// are NIXL's UCX plugin parameters, so a vLLM configuration that works with
// the "nixl" engine means the same here.
const (
	// ParamErrMode: "auto" (default), "peer" or "none". "error_handling"
	// is accepted as an alias. auto picks none for a peer on this host in
	// this network namespace (shared memory; a dead peer is caught through
	// /proc) and peer for any other (UCX then picks network transports,
	// which reach across namespaces, and detects the peer's failure).
	ParamErrMode = "ucx_error_handling_mode"
	// ParamEngineConfig: raw UCX settings "KEY=VAL,KEY=VAL" (keys without
	// the UCX_ prefix), applied with ucp_config_modify.
	ParamEngineConfig = "engine_config"
	// ParamDevices: comma-separated device list, applied as NET_DEVICES.
	ParamDevices = "device_list"
	// ParamDataPath: "cma" (default), "ucp" or "shm". cma: for a peer on
	// this host (same boot and pid namespace), move the data with
	// process_vm_readv/writev (one syscall per 512 operations) on a
	// goroutine of this process and use UCX only for the notification, so
	// a READ needs no CPU time of the peer's (UCX 1.13 serves ucp_get on
	// memory it did not allocate by software emulation, fragment by
	// fragment on the peer's progress; UCX 1.22 uses CMA zero-copy itself).
	// Peers on other hosts always go through UCP. ucp: ucp_get_nbx /
	// ucp_put_nbx for every peer. shm: as cma, and
	// in addition RegisterMem re-backs each region's page-aligned interior
	// with a sealed memfd (same addresses and contents) that same-host
	// peers map, so a READ or WRITE of it is a memcpy (see shm.go); both
	// sides should set it. Both fall back to ucp per peer when the kernel
	// denies cross-memory attach.
	ParamDataPath = "data_path"
	// EnvDataPath sets the data path when the backend parameters do not.
	EnvDataPath = "GONIXL_UCX_DATA_PATH"
)

// peerModeFor returns whether an endpoint to a peer described by proc uses
// UCP_ERR_HANDLING_MODE_PEER.
func (s settings) peerModeFor(proc procID) bool {
	if s.autoMode {
		return !sameNetwork(proc)
	}
	return s.peerMode
}

// settings is the resolved configuration of one agent.
type settings struct {
	peerMode bool   // with errMode "peer"
	autoMode bool   // errMode "auto": per peer, none on this host, else peer
	errMode  string // "auto", "peer" or "none", for Info
	errFrom  string // where errMode came from
	ucxCfg   []string
	path     dataPath
}

// dataPath is how a transfer's bytes move to or from a peer on this host
// (a peer on another host always goes through UCP). One strategy per
// agent, chosen by data_path / GONIXL_UCX_DATA_PATH.
type dataPath int

const (
	// pathUCP: ucp_get_nbx/ucp_put_nbx (UCX picks the transport).
	pathUCP dataPath = iota
	// pathCMA: this process copies with process_vm_readv/writev (falls
	// back to UCP for a peer the kernel refuses).
	pathCMA
	// pathShm: the KV cache is shared (memfd) and peers' regions mapped
	// here; a transfer is a memcpy, with CMA for what is not mapped.
	pathShm
)

func parseDataPath(s string) (dataPath, bool) {
	switch strings.ToLower(s) {
	case "ucp":
		return pathUCP, true
	case "", "cma":
		return pathCMA, true
	case "shm":
		return pathShm, true
	}
	return pathUCP, false
}

// copiesHere reports whether this process moves a same-host transfer's
// bytes itself (cma, shm) rather than UCP.
func (d dataPath) copiesHere() bool { return d != pathUCP }

// sharesMemory reports whether local regions are shared and peers' mapped.
func (d dataPath) sharesMemory() bool { return d == pathShm }

func (d dataPath) String() string {
	switch d {
	case pathCMA:
		return "cma for same-host peers"
	case pathShm:
		return "shm (shared memory, cma for the rest) for same-host peers"
	}
	return "ucp"
}

// resolveSettings validates the agent config for this engine. env is
// os.Getenv in production (a parameter for tests).
func resolveSettings(cfg nixl.AgentConfig, env func(string) string) (settings, error) {
	var s settings
	if cfg.Name == "" {
		return s, nixl.Errorf(nixl.ErrInvalidParam, "NewAgent", "agent name is empty")
	}
	if len(cfg.Name) > maxNameLen {
		return s, nixl.Errorf(nixl.ErrInvalidParam, "NewAgent", "agent name longer than %d bytes", maxNameLen)
	}
	for _, b := range cfg.Backends {
		if b != "UCX" {
			return s, nixl.Errorf(nixl.ErrNotSupported, "NewAgent",
				"the ucx engine provides only the UCX backend, not %q (use transfer_engine=nixl for other NIXL backends)", b)
		}
	}
	for name := range cfg.BackendParams {
		if name != "UCX" {
			return s, nixl.Errorf(nixl.ErrNotSupported, "NewAgent", "parameters for backend %q, the ucx engine has only UCX", name)
		}
	}
	p := cfg.BackendParams["UCX"]
	mode, from := "", ""
	switch {
	case p[ParamErrMode] != "":
		mode, from = p[ParamErrMode], "backend param "+ParamErrMode
	case p["error_handling"] != "":
		mode, from = p["error_handling"], "backend param error_handling"
	case env(EnvErrMode) != "":
		mode, from = env(EnvErrMode), EnvErrMode
	default:
		mode, from = "auto", "default"
	}
	switch strings.ToLower(mode) {
	case "auto":
		s.autoMode, s.errMode = true, "auto"
	case "peer":
		s.peerMode, s.errMode = true, "peer"
	case "none":
		s.peerMode, s.errMode = false, "none"
	default:
		return s, nixl.Errorf(nixl.ErrInvalidParam, "NewAgent", "%s=%q: want auto, peer or none", from, mode)
	}
	s.errFrom = from

	dp := p[ParamDataPath]
	if dp == "" {
		dp = env(EnvDataPath)
	}
	var ok bool
	if s.path, ok = parseDataPath(dp); !ok {
		return s, nixl.Errorf(nixl.ErrInvalidParam, "NewAgent", "%s=%q: want ucp, cma or shm", ParamDataPath, dp)
	}

	// NIXL's default: no rendezvous for active messages (notifications),
	// unless the user set UCX_RNDV_THRESH.
	if env("UCX_RNDV_THRESH") == "" {
		s.ucxCfg = append(s.ucxCfg, "RNDV_THRESH=inf")
	}
	if d := strings.TrimSpace(p[ParamDevices]); d != "" {
		var devs []string
		for _, x := range strings.Split(d, ",") {
			if x = strings.TrimSpace(x); x != "" {
				if !strings.Contains(x, ":") {
					x += ":1"
				}
				devs = append(devs, x)
			}
		}
		s.ucxCfg = append(s.ucxCfg, "NET_DEVICES="+strings.Join(devs, ","))
	}
	if ec := strings.TrimSpace(p[ParamEngineConfig]); ec != "" {
		for _, kv := range strings.Split(ec, ",") {
			kv = strings.TrimSpace(kv)
			if kv == "" {
				continue
			}
			k, v, ok := strings.Cut(kv, "=")
			k = strings.TrimPrefix(strings.TrimSpace(k), "UCX_")
			if !ok || k == "" || strings.ContainsAny(k+v, "\n\x00") {
				return s, nixl.Errorf(nixl.ErrInvalidParam, "NewAgent", "%s: bad entry %q, want KEY=VAL", ParamEngineConfig, kv)
			}
			s.ucxCfg = append(s.ucxCfg, k+"="+strings.TrimSpace(v))
		}
	}
	var unknown []string
	for k := range p {
		switch k {
		case ParamErrMode, "error_handling", ParamEngineConfig, ParamDevices, ParamDataPath,
			// Accepted for parity with NIXL; this engine has one worker.
			"num_workers", "num_threads", "split_batch_size", "ucx_ep_close_force", "ucx_num_device_channels":
		default:
			unknown = append(unknown, k)
		}
	}
	if len(unknown) > 0 {
		sort.Strings(unknown)
		return s, nixl.Errorf(nixl.ErrInvalidParam, "NewAgent", "unknown UCX backend parameters %v", unknown)
	}
	return s, nil
}

func (s settings) String() string {
	return fmt.Sprintf("error handling %s (%s), data path %s", s.errMode, s.errFrom, s.path)
}
