package shim

import (
	"encoding/json"
	"runtime"

	"github.com/gonixl/gonixl/nixl"
)

// Version is the library version; build.sh overrides it with -ldflags -X.
var Version = "0.1.0-dev"

// EngineProbe says whether one transfer engine loads on this host.
type EngineProbe struct {
	Name      string `json:"name"`
	Available bool   `json:"available"`
	Reason    string `json:"reason,omitempty"`
	Info      string `json:"info,omitempty"`
	DRAM      bool   `json:"dram"`
	VRAM      bool   `json:"vram"`
}

// ProbeReport describes the library and its native dependencies.
type ProbeReport struct {
	Version   string        `json:"version"`
	GoVersion string        `json:"go_version"`
	Engines   []EngineProbe `json:"engines"`
}

// Probe loads every registered engine's native library (once) and reports
// which ones can run here.
func Probe() ProbeReport {
	r := ProbeReport{Version: Version, GoVersion: runtime.Version(), Engines: []EngineProbe{}}
	for _, name := range nixl.Engines() {
		e, err := nixl.Lookup(name)
		if err != nil {
			continue
		}
		p := EngineProbe{Name: name}
		if err := e.Available(); err != nil {
			p.Reason = err.Error()
		} else {
			p.Available = true
			p.Info = e.Info()
			p.DRAM = e.Supports(nixl.DRAM)
			p.VRAM = e.Supports(nixl.VRAM)
		}
		r.Engines = append(r.Engines, p)
	}
	return r
}

// ProbeJSON is Probe encoded as JSON.
func ProbeJSON() []byte {
	b, _ := json.Marshal(Probe()) // plain structs: cannot fail
	return b
}
