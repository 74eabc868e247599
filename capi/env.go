package main

/*
#include <stddef.h>
extern char **environ;
static const char *gx_environ_at(size_t i) { return environ[i]; }
*/
import "C"

import (
	"os"
	"strings"
)

// syncEnv makes the Go runtime's environment the process's current one.
//
// A Go library takes its environment from the envp array its process
// started with, which it finds behind argv on the initial stack, not from
// the C library's environ. Loaded into a running Python process, it would
// then miss every variable set in os.environ before it loaded (vLLM and
// gonixl's own loader set some), and in vLLM's EngineCore and worker
// processes, which rename themselves with setproctitle (that overwrites the
// original argv/environment block), it would see no variables at all:
// GONIXL_LOG_LEVEL, GONIXL_UCX_* and the rest were silently ignored there.
// C's environ is the live one; Go's copy is rebuilt from it once, when the
// library loads (later changes to os.environ are not seen).
func syncEnv() {
	var live []string
	for i := 0; ; i++ {
		p := C.gx_environ_at(C.size_t(i))
		if p == nil {
			break
		}
		live = append(live, C.GoString(p))
	}
	keep := make(map[string]bool, len(live))
	for _, kv := range live {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			continue
		}
		keep[k] = true
		if old, set := os.LookupEnv(k); !set || old != v {
			_ = os.Setenv(k, v)
		}
	}
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); !keep[k] {
			_ = os.Unsetenv(k)
		}
	}
}

// envSynced orders package initialisation: every package-level variable
// that reads the environment depends on it.
var envSynced = func() bool { syncEnv(); return true }()
