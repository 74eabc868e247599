//go:build !cgo || gonixl_noucx

package ucx

import (
	"fmt"

	"github.com/gonixl/gonixl/nixl"
)

// This file stands in for the UCX binding when the package is built
// without cgo or with the gonixl_noucx tag (no UCX headers at build time):
// the engine is still registered and says why it cannot run.

func init() { nixl.Register(stubEngine{}) }

var errStub = fmt.Errorf("ucx: built without the UCX binding (cgo disabled or tag gonixl_noucx; building it needs libucx-dev): %w", nixl.ErrUnavailable)

type stubEngine struct{}

func (stubEngine) Name() string                                  { return EngineName }
func (stubEngine) Available() error                              { return errStub }
func (stubEngine) Supports(nixl.MemType) bool                    { return false }
func (stubEngine) Info() string                                  { return "ucx: unavailable: " + errStub.Error() }
func (stubEngine) NewAgent(nixl.AgentConfig) (nixl.Agent, error) { return nil, errStub }

// Version returns zeros: no libucp is loaded in this build.
func Version() (major, minor, release uint) { return 0, 0, 0 }

// LibraryPath returns "": no libucp is loaded in this build.
func LibraryPath() string { return "" }
