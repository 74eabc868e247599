// Command gonixl-bench runs gonixl's benchmarks. Each benchmark is a
// subcommand registered from its own file:
//
//	gonixl-bench transfer   ...  transfer-engine throughput and latency, gonixl vs NIXL's Python API
//	gonixl-bench ucxperf    ...  the ucx engine vs ucx_perftest and a single-core memcpy
//	gonixl-bench proxy      ...  latency the gonixl-proxy process adds over calling the upstream
//	gonixl-bench multiturn  ...  multi-turn serving client against a proxy
//
// Run "gonixl-bench <subcommand> -h" for a subcommand's flags.
//
// Imports: nixl and its engine subpackages (the transfer benchmark), the
// standard library, zap and client_golang; never capi, shim or proxy.
//
// Concurrency: a command; each benchmark documents the goroutines and
// processes it starts and stops them all before it returns.
package main
