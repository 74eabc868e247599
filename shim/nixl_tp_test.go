package shim

import (
	"fmt"
	"testing"

	"github.com/gonixl/gonixl/nixl"
	_ "github.com/gonixl/gonixl/nixl/libnixl"
)

// TestTensorParallelOverNIXL runs heterogeneous-TP transfers on real NIXL
// (libnixl_capi from the pip wheel), in one process.
func TestTensorParallelOverNIXL(t *testing.T) {
	eng, err := nixl.Lookup("nixl")
	if err != nil {
		// nixl/libnixl is cgo only: a build without cgo has no nixl
		// engine (./build.sh test runs this in its cgo step).
		t.Skipf("built without cgo: nixl engine not built in: %v", err)
	}
	if err := eng.Available(); err != nil {
		t.Fatalf("NIXL does not load (the nixl wheel in .venv, or NIXL_LIB_DIR): %v", err)
	}
	for _, c := range [][3]int{{2, 1, 2}, {1, 2, 2}, {2, 2, 2}} {
		t.Run(fmt.Sprintf("P%d-D%d-heads%d", c[0], c[1], c[2]), func(t *testing.T) {
			tpTransfer(t, eng, c[0], c[1], c[2], "")
		})
	}
}
