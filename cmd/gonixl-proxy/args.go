package main

import (
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/gonixl/gonixl/proxy"
)

// The command line follows Python argparse conventions, because the same
// command lines must work for vLLM's proxies and this one: "--opt value",
// "--opt=value", list options take one or more following values
// ("--prefiller-hosts a b c"), and a repeated option replaces earlier values.

type nargs int

const (
	flagOnly  nargs = iota // no value (store_true)
	one                    // exactly one value
	oneOrMore              // nargs="+"
)

type optSpec struct {
	names []string // canonical name first
	n     nargs
	def   []string
	help  string
}

var optSpecs = []optSpec{
	{[]string{"--host"}, one, []string{"127.0.0.1"}, "address to listen on"},
	{[]string{"--port"}, one, []string{"8000"}, "port to listen on (0 picks a free port)"},
	{[]string{"--prefiller-hosts", "--prefiller-host"}, oneOrMore, []string{"localhost"}, "prefill instance hosts"},
	{[]string{"--prefiller-ports", "--prefiller-port"}, oneOrMore, []string{"8100"}, "prefill instance ports, one per host"},
	{[]string{"--decoder-hosts", "--decoder-host"}, oneOrMore, []string{"localhost"}, "decode instance hosts"},
	{[]string{"--decoder-ports", "--decoder-port"}, oneOrMore, []string{"8200"}, "decode instance ports, one per host"},
	{[]string{"--multiturn"}, flagOnly, nil, "multi-turn proxy (disagg_proxy_multiturn.py) instead of the toy proxy"},
	{[]string{"--reuse-mode"}, one, []string{"bidirectional"}, "multi-turn: bidirectional (cache decode params per conversation) or oneway"},
	{[]string{"--require-conversation-id"}, flagOnly, nil, "multi-turn: reject requests without conversation_id (400 missing_conversation_id)"},
	{[]string{"--decoder-kv-blocks-ttl", "--cache-ttl"}, one, []string{"480"}, "multi-turn: seconds a conversation's decode params are kept: the decodes' decoder_kv_blocks_ttl (the prefill also checks the decode's expiry in the params)"},
	{[]string{"--state-store"}, one, []string{"memory"}, "multi-turn: where conversations' decode params are kept between turns: memory (this process) or a Redis/Valkey URL shared by several proxies (redis://host:port/db, rediss://..., unix:///path?db=N)"},
	{[]string{"--state-store-timeout"}, one, []string{"0.05"}, "multi-turn: seconds each call to a Redis/Valkey state store may take; a store that fails or is slower makes the turn a full prefill (counted in gonixl_proxy_state_store_errors_total)"},
	{[]string{"--state-key-prefix"}, one, []string{"gonixl:conv:"}, "multi-turn: prefix of the state store's keys (proxies that share conversations use the same prefix and database)"},
	{[]string{"--connect-timeout"}, one, []string{"5"}, "seconds to wait for an upstream TCP connection"},
	{[]string{"--upstream-timeout"}, one, []string{"300"}, "seconds to wait for an upstream's response headers, a whole prefill, or the next chunk of a decode stream"},
	{[]string{"--abandon-grace"}, one, []string{"2"}, "seconds an upstream request outlives a client that went away, so that the decode's connector frees the prefill's blocks at once (0: cancel at once; --push always cancels at once)"},
	{[]string{"--upstream-idle-timeout"}, one, []string{"4"}, "seconds an idle upstream connection is kept for reuse; keep below vLLM's keep-alive timeout (5 s)"},
	{[]string{"--push"}, flagOnly, nil, "instances with vLLM's push connector (NixlPushConnector / GoNixlPushConnector): after a prefill's first answer, send its requests and the decode's at once, tied by one X-Request-Id (toy mode, or --multiturn with --reuse-mode oneway)"},
	{[]string{"--forward-client-kv-params"}, flagOnly, nil, "let a client's own kv_transfer_params reach a decode instance when the prefill returns none (off: clients cannot point a decode at remote engines or blocks)"},
	{[]string{"--log-level"}, one, []string{""}, "debug, info, warn or error (default: $GONIXL_LOG_LEVEL, else info)"},
}

var errHelp = errors.New("help requested")

func lookupSpec(name string) *optSpec {
	for i := range optSpecs {
		for _, n := range optSpecs[i].names {
			if n == name {
				return &optSpecs[i]
			}
		}
	}
	return nil
}

// isValue reports whether a command-line word is a value rather than an
// option; like argparse, a word starting with '-' is an option unless it is a
// negative number.
func isValue(s string) bool {
	if !strings.HasPrefix(s, "-") || s == "-" {
		return true
	}
	_, err := strconv.ParseFloat(s, 64)
	return err == nil
}

// parseArgs returns the values of every option by canonical name, defaults
// filled in.
func parseArgs(args []string) (map[string][]string, error) {
	vals := make(map[string][]string)
	for _, s := range optSpecs {
		vals[s.names[0]] = s.def
	}
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "-h" || a == "--help" {
			return nil, errHelp
		}
		if !strings.HasPrefix(a, "--") {
			return nil, fmt.Errorf("unexpected argument %q", a)
		}
		name, inline, hasInline := strings.Cut(a, "=")
		spec := lookupSpec(name)
		if spec == nil {
			return nil, fmt.Errorf("unknown option %s", name)
		}
		key := spec.names[0]
		switch spec.n {
		case flagOnly:
			if hasInline {
				return nil, fmt.Errorf("option %s takes no value", name)
			}
			vals[key] = []string{"true"}
		case one:
			if hasInline {
				vals[key] = []string{inline}
				continue
			}
			if i+1 >= len(args) || !isValue(args[i+1]) {
				return nil, fmt.Errorf("option %s expects one value", name)
			}
			i++
			vals[key] = []string{args[i]}
		case oneOrMore:
			var list []string
			if hasInline {
				list = append(list, inline)
			}
			for i+1 < len(args) && isValue(args[i+1]) {
				i++
				list = append(list, args[i])
			}
			if len(list) == 0 {
				return nil, fmt.Errorf("option %s expects at least one value", name)
			}
			vals[key] = list
		}
	}
	return vals, nil
}

func printUsage(w io.Writer) {
	fmt.Fprintln(w, "usage: gonixl-proxy [options]")
	fmt.Fprintln(w, "P/D proxy for vLLM disaggregated serving; flags as vLLM's toy_proxy_server.py")
	fmt.Fprintln(w, "and (with --multiturn) disagg_proxy_multiturn.py. Upstream Authorization is")
	fmt.Fprintln(w, "\"Bearer $OPENAI_API_KEY\" when that variable is set.")
	fmt.Fprintln(w)
	for _, s := range optSpecs {
		names := strings.Join(s.names, ", ")
		switch s.n {
		case one:
			names += " VALUE"
		case oneOrMore:
			names += " VALUE [VALUE ...]"
		}
		def := ""
		if len(s.def) > 0 && s.def[0] != "" {
			def = " (default " + strings.Join(s.def, " ") + ")"
		}
		fmt.Fprintf(w, "  %s\n      %s%s\n", names, s.help, def)
	}
}

// options is the parsed command line.
type options struct {
	listenHost string
	listenPort int
	cfg        proxy.Config
	logLevel   string
	// stateURL is --state-store when it is not "memory"; main opens the
	// store (proxy/redisstate) with stateKeyPrefix.
	stateURL       string
	stateKeyPrefix string
}

func parseInts(opt string, vs []string) ([]int, error) {
	out := make([]int, len(vs))
	for i, v := range vs {
		n, err := strconv.Atoi(v)
		if err != nil {
			return nil, fmt.Errorf("%s: %q is not an integer", opt, v)
		}
		out[i] = n
	}
	return out, nil
}

func parseSeconds(opt, v string) (time.Duration, error) {
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || f <= 0 || f > 1e7 {
		return 0, fmt.Errorf("%s: %q is not a positive number of seconds", opt, v)
	}
	return time.Duration(f * float64(time.Second)), nil
}

// buildOptions turns the command line into options, with clear errors.
func buildOptions(args []string, apiKey string) (*options, error) {
	vals, err := parseArgs(args)
	if err != nil {
		return nil, err
	}
	o := &options{listenHost: vals["--host"][0], logLevel: vals["--log-level"][0]}
	ports, err := parseInts("--port", vals["--port"])
	if err != nil {
		return nil, err
	}
	if ports[0] < 0 || ports[0] > 65535 {
		return nil, fmt.Errorf("--port: %d out of range 0..65535", ports[0])
	}
	o.listenPort = ports[0]

	pports, err := parseInts("--prefiller-ports", vals["--prefiller-ports"])
	if err != nil {
		return nil, err
	}
	dports, err := parseInts("--decoder-ports", vals["--decoder-ports"])
	if err != nil {
		return nil, err
	}
	if o.cfg.Prefill, err = proxy.Pair("prefiller", vals["--prefiller-hosts"], pports); err != nil {
		return nil, err
	}
	if o.cfg.Decode, err = proxy.Pair("decoder", vals["--decoder-hosts"], dports); err != nil {
		return nil, err
	}
	if vals["--multiturn"] != nil {
		o.cfg.Mode = proxy.ModeMultiturn
	}
	o.cfg.RequireConversationID = vals["--require-conversation-id"] != nil
	switch rm := proxy.ReuseMode(vals["--reuse-mode"][0]); rm {
	case proxy.ReuseBidirectional, proxy.ReuseOneway:
		o.cfg.ReuseMode = rm
	default:
		return nil, fmt.Errorf("--reuse-mode: %q is not oneway or bidirectional", rm)
	}
	if o.cfg.CacheTTL, err = parseSeconds("--decoder-kv-blocks-ttl", vals["--decoder-kv-blocks-ttl"][0]); err != nil {
		return nil, err
	}
	if o.cfg.StateTimeout, err = parseSeconds("--state-store-timeout", vals["--state-store-timeout"][0]); err != nil {
		return nil, err
	}
	switch st := vals["--state-store"][0]; {
	case st == "memory":
	case strings.HasPrefix(st, "redis://"), strings.HasPrefix(st, "rediss://"), strings.HasPrefix(st, "unix://"):
		o.stateURL = st
	default:
		return nil, fmt.Errorf("--state-store: %q is not memory or a redis://, rediss:// or unix:// URL", st)
	}
	if o.stateKeyPrefix = vals["--state-key-prefix"][0]; o.stateKeyPrefix == "" {
		return nil, errors.New("--state-key-prefix: empty")
	}
	if o.cfg.ConnectTimeout, err = parseSeconds("--connect-timeout", vals["--connect-timeout"][0]); err != nil {
		return nil, err
	}
	if o.cfg.UpstreamTimeout, err = parseSeconds("--upstream-timeout", vals["--upstream-timeout"][0]); err != nil {
		return nil, err
	}
	if o.cfg.UpstreamIdleTimeout, err = parseSeconds("--upstream-idle-timeout", vals["--upstream-idle-timeout"][0]); err != nil {
		return nil, err
	}
	if g := vals["--abandon-grace"][0]; g == "0" {
		o.cfg.AbandonGrace = proxy.NoAbandonGrace
	} else if o.cfg.AbandonGrace, err = parseSeconds("--abandon-grace", g); err != nil {
		return nil, err
	}
	o.cfg.ForwardClientKVParams = vals["--forward-client-kv-params"] != nil
	o.cfg.Push = vals["--push"] != nil
	o.cfg.APIKey = apiKey
	return o, nil
}
