package nixltest

import (
	"fmt"
	"syscall"
	"unsafe"
)

// Mem is a page-aligned anonymous mapping outside the Go heap, so tests of
// higher layers can register real memory by address (as vLLM registers
// tensor storage) and check the bytes a fake transfer moved.
type Mem struct {
	Addr  uint64
	Bytes []byte
}

// Alloc maps n bytes of zeroed memory.
func Alloc(n int) (*Mem, error) {
	b, err := syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		return nil, fmt.Errorf("nixltest: mmap %d bytes: %w", n, err)
	}
	return &Mem{Addr: uint64(uintptr(unsafe.Pointer(&b[0]))), Bytes: b}, nil
}

// Free unmaps the memory; the Mem must not be used afterwards.
func (m *Mem) Free() error {
	if m.Bytes == nil {
		return nil
	}
	err := syscall.Munmap(m.Bytes)
	m.Bytes = nil
	return err
}
