package main

/*
#cgo CFLAGS: -I${SRCDIR}/../include
#include "gonixl.h"
*/
import "C"

import (
	"os"

	"github.com/gonixl/gonixl/shim"
)

func main() {}

//export gonixl_abi_version
func gonixl_abi_version() C.uint32_t {
	return C.GONIXL_ABI_VERSION
}

//export gonixl_version
func gonixl_version(buf *C.char, lenp *C.size_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return guard(cerr, func() error {
		return writeOut(buf, lenp, []byte(shim.Version))
	})
}

//export gonixl_probe
func gonixl_probe(buf *C.char, lenp *C.size_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return guard(cerr, func() error {
		return writeOut(buf, lenp, shim.ProbeJSON())
	})
}

func parseConfig(p *C.char, n C.size_t) (*shim.Config, error) {
	data, err := readIn(p, n, "config_json")
	if err != nil {
		return nil, err
	}
	cfg, err := shim.ParseConfig(data)
	if err != nil {
		return nil, errorf(statusInvalidArg, "%v", err)
	}
	return cfg, nil
}

//export gonixl_scheduler_new
func gonixl_scheduler_new(cfgJSON *C.char, cfgLen C.size_t, out *C.gonixl_scheduler_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return guard(cerr, func() error {
		if out == nil {
			return errorf(statusNullPointer, "out handle pointer is NULL")
		}
		*out = 0
		cfg, err := parseConfig(cfgJSON, cfgLen)
		if err != nil {
			return err
		}
		s, err := shim.NewScheduler(cfg)
		if err != nil {
			return errorf(statusInvalidArg, "%v", err)
		}
		*out = C.gonixl_scheduler_t(handles.add(kindScheduler, s))
		return nil
	})
}

//export gonixl_scheduler_close
func gonixl_scheduler_close(h C.gonixl_scheduler_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return guard(cerr, func() error {
		obj, err := handles.remove(uint64(h), kindScheduler)
		if err != nil {
			return err
		}
		return obj.(*shim.Scheduler).Close()
	})
}

//export gonixl_worker_new
func gonixl_worker_new(cfgJSON *C.char, cfgLen C.size_t, out *C.gonixl_worker_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return guard(cerr, func() error {
		if out == nil {
			return errorf(statusNullPointer, "out handle pointer is NULL")
		}
		*out = 0
		cfg, err := parseConfig(cfgJSON, cfgLen)
		if err != nil {
			return err
		}
		w, err := shim.NewWorker(cfg)
		if err != nil {
			return errorf(statusInvalidArg, "%v", err)
		}
		*out = C.gonixl_worker_t(handles.add(kindWorker, w))
		return nil
	})
}

//export gonixl_worker_close
func gonixl_worker_close(h C.gonixl_worker_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return guard(cerr, func() error {
		obj, err := handles.remove(uint64(h), kindWorker)
		if err != nil {
			return err
		}
		return obj.(*shim.Worker).Close()
	})
}

// testHooks is read once at load: the panic hook works only in processes
// started with GONIXL_TEST_HOOKS=1.
var testHooks = os.Getenv("GONIXL_TEST_HOOKS") == "1"

//export gonixl_debug_panic
func gonixl_debug_panic(cerr *C.gonixl_error_t) C.gonixl_status_t {
	return guard(cerr, func() error {
		if !testHooks {
			return errorf(statusNotSupported, "gonixl_debug_panic needs GONIXL_TEST_HOOKS=1 in the environment")
		}
		panic("gonixl_debug_panic called")
	})
}
