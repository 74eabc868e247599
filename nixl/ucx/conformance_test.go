//go:build cgo && !gonixl_noucx

package ucx

import (
	"testing"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/nixl/internal/conformance"
)

// TestConformance runs the shared two-process suite against this engine on
// TCP and on shared-memory transports. UCX_TLS is read when an agent's
// context is created and is inherited by the peer process.
func TestConformance(t *testing.T) {
	for _, c := range []struct{ name, tls, mode, path string }{
		{"tcp-peer", "tcp", "peer", "ucp"},
		{"shm-none", "sm,self", "none", "ucp"},
		{"posix-cma-none", "posix,cma,self", "none", "ucp"},
		{"datapath-cma", "sm,self", "none", "cma"},
		{"datapath-shm", "sm,self", "none", "shm"},
		{"datapath-shm-tcp-peer", "tcp", "peer", "shm"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv("UCX_TLS", c.tls)
			conformance.RunConfig(t, conformance.Config{
				Engine: EngineName,
				Agent: nixl.AgentConfig{BackendParams: map[string]map[string]string{
					"UCX": {ParamErrMode: c.mode, ParamDataPath: c.path}}},
			})
		})
	}
}
