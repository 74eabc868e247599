//go:build !cgo || gonixl_noucx

package ucx

import (
	"errors"
	"testing"

	"github.com/gonixl/gonixl/nixl"
)

func TestStubReportsWhy(t *testing.T) {
	e, err := nixl.Lookup(EngineName)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Available(); !errors.Is(err, nixl.ErrUnavailable) {
		t.Fatalf("Available() = %v, want ErrUnavailable", err)
	}
	if _, err := e.NewAgent(nixl.AgentConfig{Name: "x"}); err == nil {
		t.Fatal("NewAgent succeeded in a build without UCX")
	}
}
