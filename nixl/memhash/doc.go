// Package memhash hashes ranges of this process's own memory: the KV-cache
// blocks a worker registered (shim's KV digests, docs/FAULTS.md "KV
// digests"). It is a leaf beside the engines because it reads memory by
// address, which only the engine packages and this one may do (unsafe);
// the caller checks that every span lies inside memory it registered.
//
// The hash is XXH3-64 (github.com/zeebo/xxh3, SIMD on amd64 and arm64):
// a non-cryptographic hash chosen for its speed over DRAM. The digests
// catch transport and ownership faults, not an adversary.
package memhash
