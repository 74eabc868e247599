// Command scpeer drives package sidechannel from tests/python/test_sidechannel.py.
// It is a test tool: each subcommand reads JSON or hex on stdin and writes
// JSON or hex on stdout.
//
//	scpeer encode            stdin {"hash": str, "metadata": {...}} -> hex NixlHandshakePayload
//	scpeer decode            stdin hex NixlHandshakePayload -> {"hash": str, "metadata": {...}}
//	scpeer decode-many       stdin lines "payload|metadata|request <hex>" -> lines "ok" / "err <msg>"
//	scpeer hash              stdin {factor: value} -> hex SHA-256 (HashFactorsJSON, engine kind from $SCPEER_ENGINE_KIND)
//	scpeer compat            stdin CompatFactors as JSON (Go field names) -> CompatibilityHash
//	scpeer serve  -payloads FILE [-secret S]
//	                         FILE lines "pp tp hex"; prints "PORT n", serves until stdin closes
//	scpeer fetch  -port N -engine E -hash H -ranks 0:0,0:1 [-secret S] [-allow-mismatch]
//	                         -> {"agents": {"pp:tp": {...}}, "clock_offset": x} or {"error": msg} (exit 1)
//
// Metadata JSON uses vLLM's field names; bytes are hex strings; None is null.
//
// Imports: sidechannel and the standard library (a test tool).
// Concurrency: one command at a time; serve runs until its stdin closes.
package main
