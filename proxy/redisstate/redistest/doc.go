// Package redistest runs a real redis-server (or valkey-server) for tests:
// on a free loopback port, with its own data directory, no persistence, and
// stopped at the end of the test. A machine without the binary fails the
// test that asks for one (./build.sh setup installs Debian's redis-server);
// GONIXL_REDIS_SERVER names another binary.
//
// Imports: the standard library and testing only. Concurrency: a *Server
// belongs to the test that started it (Stop and Restart are not for
// concurrent use).
package redistest
