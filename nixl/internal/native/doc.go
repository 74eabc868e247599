// Package native is the one home of how gonixl's transfer engines find the
// native libraries that Python wheels ship (nixl-cu12/-cu13, libucx-cu12/
// -cu13) and of the environment defaults they set before those libraries
// initialise. Both engines (nixl/libnixl, nixl/ucx) use it; the Python
// package sets nothing itself (NIXL_LIB_DIR, GONIXL_UCX_LIB and the UCX_*
// variables remain the user's overrides).
//
// Imports: the standard library only. Concurrency: SitePackages and Find
// only read; SetUCXDefaults and Unset change the process environment and
// are called by an engine's one-time load (under its sync.Once), before the
// native library is opened.
package native
