// Command gonixl-proxy is the P/D proxy in front of vLLM prefill and decode
// instances: vLLM's toy_proxy_server.py by default, its
// disagg_proxy_multiturn.py with --multiturn, with the same command-line flags
// (argparse conventions: "--prefiller-hosts a b --prefiller-ports 8100 8101").
//
//	gonixl-proxy --port 8192 --prefiller-hosts 127.0.0.1 --prefiller-ports 8100 \
//	    --decoder-hosts 127.0.0.1 --decoder-ports 8200
//
// --host defaults to 127.0.0.1 in both modes (disagg_proxy_multiturn.py
// listens on 0.0.0.0 by default): pass --host 0.0.0.0 to serve other hosts.
//
// Once the listening socket is bound it logs "listening on HOST:PORT" to
// stderr, and from then on GET /healthcheck answers 200. Upstream requests
// carry "Authorization: Bearer $OPENAI_API_KEY" when that variable is set.
// Logs are zap console lines on stderr, at --log-level or $GONIXL_LOG_LEVEL.
// SIGINT or SIGTERM shut it down gracefully (in-flight requests get 10 s).
// Unless GOGC is set, the garbage collector target is 400.
//
// Imports: the proxy package, proxy/redisstate (--state-store redis://...),
// zap and the standard library. The command owns
// the process: it installs the signal handlers and chooses the exit status
// (0 after a clean shutdown, 1 when serving fails, 2 for a bad command line).
package main
