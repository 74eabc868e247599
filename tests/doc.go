// Package tests holds cross-layer checks that belong to no single package:
// the import-layering rules of the architecture (layering_test.go). Its
// subfolders hold the cgo harness that drives libgonixl.so through its C ABI
// (tests/cabi), Python suites (tests/python) and the end-to-end suite with
// real vLLM (tests/e2e).
//
// Imports: anything (test code only). Concurrency: not applicable.
package tests
