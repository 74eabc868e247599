package main

import (
	"errors"
	"fmt"
	"testing"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/shim"
)

// statusOf is the one place errors become status codes: each class of
// error the shim and the engines return maps to its code, through any
// wrapping, and an unclassified error is internal.
func TestStatusOfMapsEveryClass(t *testing.T) {
	_, cfgErr := shim.ParseConfig([]byte(`{"kv_role": 7}`))
	_, paramsErr := shim.ParseTransferParams([]byte(`{"remote_port": "x"}`))
	w, err := shim.NewWorker(mustConfig(t), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	_, stateErr := w.HandshakePayload()
	startErr := w.StartLoadKV([]byte{0xc1})
	for _, c := range []struct {
		name string
		err  error
		want int32
	}{
		{"config", cfgErr, statusInvalidArg},
		{"kv_transfer_params", paramsErr, statusInvalidArg},
		{"payload before register", stateErr, statusState},
		{"garbage step metadata", startErr, statusInvalidArg},
		{"wrapped class", fmt.Errorf("outer: %w", shim.ErrNotSupported), statusNotSupported},
		{"engine unavailable", fmt.Errorf("transfer engine: %w", nixl.ErrUnavailable), statusUnavailable},
		{"engine invalid param", nixl.Errorf(nixl.ErrInvalidParam, "MakeXfer", "x"), statusInvalidArg},
		{"engine failure", fmt.Errorf("register: %w", nixl.Errorf(nixl.ErrBackend, "RegisterMem", "x")), statusTransfer},
		{"C argument", errorf(statusNullPointer, "x"), statusNullPointer},
		{"handle", &handleError{statusWrongHandle, "x"}, statusWrongHandle},
		{"unclassified", errors.New("a bug"), statusInternal},
	} {
		if c.err == nil {
			t.Errorf("%s: no error produced", c.name)
			continue
		}
		if got := statusOf(c.err); got != c.want {
			t.Errorf("%s: statusOf(%v) = %d, want %d", c.name, c.err, got, c.want)
		}
	}
}

func mustConfig(t *testing.T) *shim.Config {
	t.Helper()
	cfg, err := shim.ParseConfig([]byte(`{"role": "worker", "engine_id": "e", "kv_role": "kv_consumer"}`))
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}
