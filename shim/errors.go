package shim

import (
	"errors"
	"fmt"

	"github.com/gonixl/gonixl/nixl"
)

// Error classes. Every error the shim's exported entry points return
// carries one (errors.Is), or is a *nixl.Error from the transfer engine
// with its NIXL status; capi maps both to the C ABI's status codes in one
// function (capi/guard.go statusOf). An error with neither is a bug.
var (
	// ErrInvalidInput: malformed or out-of-range input — configuration,
	// kv_transfer_params, step metadata, KV-cache geometry, a payload.
	ErrInvalidInput = errors.New("invalid input")
	// ErrState: a call out of order (before register_kv_caches, after
	// close, twice).
	ErrState = errors.New("invalid state")
	// ErrNotSupported: valid input gonixl does not handle.
	ErrNotSupported = errors.New("not supported")
)

// classed attaches a class to an error without changing its message.
type classed struct {
	class error
	err   error
}

func (c *classed) Error() string   { return c.err.Error() }
func (c *classed) Unwrap() []error { return []error{c.class, c.err} }

// withClass returns err carrying class (nil stays nil; an error that
// already has a class or a NIXL status keeps it).
func withClass(class, err error) error {
	if err == nil || classOf(err) != nil {
		return err
	}
	return &classed{class: class, err: err}
}

// classify is withClass for a deferred named error result.
func classify(errp *error, class error) { *errp = withClass(class, *errp) }

// classOf returns the class err carries: one of the Err* classes above,
// nixl.ErrUnavailable, the *nixl.Error, or nil.
func classOf(err error) error {
	for _, c := range []error{ErrInvalidInput, ErrState, ErrNotSupported, nixl.ErrUnavailable} {
		if errors.Is(err, c) {
			return c
		}
	}
	var ne *nixl.Error
	if errors.As(err, &ne) {
		return ne
	}
	return nil
}

func errRole(got, want Role) error {
	return withClass(ErrInvalidInput, fmt.Errorf("config: role %q given to the %s constructor", got, want))
}
