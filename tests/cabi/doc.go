// Package cabi is a cgo harness that drives libgonixl.so through its C ABI
// exactly as a C caller would: dlopen, dlsym, calls with the types of
// include/gonixl.h. It exists because _test.go files cannot import "C".
//
// Imports: the standard library; cgo (libdl). Concurrency: Lib methods may
// be called from several goroutines, as C threads would.
package cabi
