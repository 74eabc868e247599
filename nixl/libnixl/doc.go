// Package libnixl is the "nixl" engine: real NIXL, through the C API that
// NIXL's Rust bindings use (libnixl_capi.so), loaded with dlopen at run time
// from the installed nixl wheel. It registers itself as engine "nixl".
//
// Loading. Nothing is linked against NIXL, so a binary (or libgonixl.so)
// that contains this package loads on hosts without NIXL; Engine.Available
// then reports "NIXL not available: <dlerror text>". The library is looked
// for, in order, in $NIXL_LIB_DIR, in the nixl wheel's lib directory
// (.nixl_cu12.mesonpy.libs, then .nixl_cu13.mesonpy.libs) under every
// site-packages directory native.SitePackages finds ($VIRTUAL_ENV's, those
// of objects mapped into the process, those of .venv directories above the
// working directory and the executable), and finally by plain soname (the
// system search path). Before the first dlopen it sets, unless already set,
// NIXL_PLUGIN_DIR to the wheel's plugins directory and the UCX defaults of
// native.SetUCXDefaults (UCX_RCACHE_MAX_UNRELEASED=1024 as vLLM does, and
// UCX's own signal handlers off). Every other UCX_* variable reaches UCX
// unchanged.
//
// Version. gxnixl.c declares NIXL 1.5.1's C API and nixlAgent methods, and
// the C API has changed since, so only NIXL versions in [supportedMin,
// supportedMax] (version.go; now 1.5.1 only) are used. The first candidate
// that dlopens (which runs only the libraries' own initialisers) is checked
// before anything in it is looked up or called. Its version is read from
// the file of the libnixl_common.so that the dynamic linker loaded with it:
// NIXL's build compiles its version there, as the string after the
// "NIXL version: " banner it logs (no exported symbol, soname or file name
// carries it, and a wheel's dist-info would not cover NIXL_LIB_DIR or the
// system path). Another version, or none readable, makes Available fail
// with ERR_NOT_SUPPORTED naming the version found and those supported.
// Then every required C API symbol is resolved; one missing fails with
// ERR_NOT_FOUND naming it. Either failure wraps nixl.ErrUnavailable (so
// "auto" falls back to UCX), closes the library and ends the search, since
// a later candidate would bind by soname to the libraries already loaded.
// There is no override. Version and Info report the version loaded.
//
// Declarations. gxnixl.h/gxnixl.c hold gonixl's own declarations of the C
// API functions it calls, resolved with dlsym (gxnixl.c's table required).
// Each Go operation crosses cgo once: descriptor tables ({addr, len, devId}
// triples, the layout of nixl.Desc) and index arrays are passed whole, and
// the C side loops.
//
// Status codes. The C API folds most of NIXL's errors into one BACKEND
// code. So that ERR_REMOTE_DISCONNECT, ERR_REPOST_ACTIVE and the others stay
// distinct where they matter (posting, polling and releasing a transfer),
// gxnixl.c also resolves nixlAgent::postXferReq, ::getXferStatus and
// ::releaseXferReq from libnixl.so and calls them with the C++ object the C
// API's handles wrap; their nixl_status_t comes back unchanged. If those
// symbols are absent the C API's codes are used (Engine.Info says which).
// Other operations report INVALID_PARAM, NOT_FOUND, NO_TELEMETRY or BACKEND
// as the C API does. Index and length errors are caught in Go before
// anything crosses into NIXL.
//
// Imports: nixl and the standard library; cgo and unsafe (allowed for
// engine subpackages).
//
// Concurrency: an agent serialises every call into NIXL with its own mutex
// (NIXL agents are created with NIXL_THREAD_SYNC_NONE, as NIXL's Python API
// does); agents are independent. With AgentConfig.ProgressThread NIXL's own
// progress thread moves data and notifications between calls. A control
// call (loading a peer's metadata, preparing or releasing a descriptor
// list, registering memory) can hold that mutex for seconds; the agent
// reports one running or waiting (nixl.ControlBusy), and the shim puts off
// the polls and posts of vLLM's model thread meanwhile (shim/busy.go).
// Post of a DRAM transfer copies its bytes before it returns (NIXL's UCX
// backend, CMA on one host): the agent says so (nixl.PostCopies), and the
// shim posts from a goroutine of its own (shim/post.go).
package libnixl
