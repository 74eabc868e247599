package main

import (
	"bufio"
	"context"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/gonixl/gonixl/sidechannel"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: scpeer encode|decode|decode-many|hash|serve|fetch ...")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "encode":
		err = encode()
	case "decode":
		err = decode()
	case "decode-many":
		err = decodeMany()
	case "hash":
		err = hashCmd()
	case "compat":
		err = compatCmd()
	case "serve":
		err = serve(os.Args[2:])
	case "fetch":
		err = fetch(os.Args[2:])
	default:
		err = fmt.Errorf("unknown subcommand %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "scpeer:", err)
		os.Exit(1)
	}
}

func readStdin() ([]byte, error) { return io.ReadAll(os.Stdin) }

func encode() error {
	var in struct {
		Hash     string         `json:"hash"`
		Metadata map[string]any `json:"metadata"`
	}
	b, err := readStdin()
	if err != nil {
		return err
	}
	if err := json.Unmarshal(b, &in); err != nil {
		return err
	}
	m, err := fromJSON(in.Metadata)
	if err != nil {
		return err
	}
	p := sidechannel.HandshakePayload{CompatibilityHash: in.Hash, AgentMetadataBytes: m.Encode()}
	fmt.Println(hex.EncodeToString(p.Encode()))
	return nil
}

func decode() error {
	b, err := readStdin()
	if err != nil {
		return err
	}
	raw, err := hex.DecodeString(strings.TrimSpace(string(b)))
	if err != nil {
		return err
	}
	p, err := sidechannel.DecodeHandshakePayload(raw)
	if err != nil {
		return err
	}
	m, err := sidechannel.DecodeAgentMetadata(p.AgentMetadataBytes)
	if err != nil {
		return err
	}
	return json.NewEncoder(os.Stdout).Encode(map[string]any{"hash": p.CompatibilityHash, "metadata": toJSON(m)})
}

func decodeMany() error {
	sc := bufio.NewScanner(os.Stdin)
	sc.Buffer(make([]byte, 1<<20), 64<<20)
	w := bufio.NewWriter(os.Stdout)
	defer w.Flush()
	for sc.Scan() {
		kind, h, _ := strings.Cut(sc.Text(), " ")
		raw, err := hex.DecodeString(h)
		if err == nil {
			switch kind {
			case "payload":
				_, err = sidechannel.DecodeHandshakePayload(raw)
			case "metadata":
				_, err = sidechannel.DecodeAgentMetadata(raw)
			case "request":
				_, err = sidechannel.DecodeRequest(raw)
			default:
				err = fmt.Errorf("unknown kind %q", kind)
			}
		}
		if err != nil {
			fmt.Fprintf(w, "err %s\n", strings.ReplaceAll(err.Error(), "\n", " "))
		} else {
			fmt.Fprintln(w, "ok")
		}
	}
	return sc.Err()
}

func hashCmd() error {
	b, err := readStdin()
	if err != nil {
		return err
	}
	h, err := sidechannel.HashFactorsJSON(b, os.Getenv("SCPEER_ENGINE_KIND"))
	if err != nil {
		return err
	}
	fmt.Println(h)
	return nil
}

func compatCmd() error {
	b, err := readStdin()
	if err != nil {
		return err
	}
	var f sidechannel.CompatFactors
	if err := json.Unmarshal(b, &f); err != nil {
		return err
	}
	h, err := sidechannel.CompatibilityHash(&f)
	if err != nil {
		return err
	}
	fmt.Println(h)
	return nil
}

func serve(args []string) error {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	payloads := fs.String("payloads", "", "file of 'pp tp hex' lines")
	secret := fs.String("secret", "", "shared secret")
	if err := fs.Parse(args); err != nil {
		return err
	}
	cfg := sidechannel.ListenerConfig{Host: "127.0.0.1"}
	if *secret != "" {
		cfg.Secret = []byte(*secret)
	}
	l, err := sidechannel.NewListener(cfg)
	if err != nil {
		return err
	}
	defer l.Stop()
	if *payloads != "" {
		b, err := os.ReadFile(*payloads)
		if err != nil {
			return err
		}
		for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
			var pp, tp int
			var h string
			if _, err := fmt.Sscan(line, &pp, &tp, &h); err != nil {
				return fmt.Errorf("payload line %q: %w", line, err)
			}
			raw, err := hex.DecodeString(h)
			if err != nil {
				return err
			}
			if err := l.SetPayload(pp, tp, raw); err != nil {
				return err
			}
		}
	}
	fmt.Printf("PORT %d\n", l.Addr().Port)
	os.Stdout.Sync()
	io.Copy(io.Discard, os.Stdin) // serve until the parent closes stdin
	served, refused := l.Counts()
	fmt.Printf("SERVED %d REFUSED %d\n", served, refused)
	return nil
}

func fetch(args []string) error {
	fs := flag.NewFlagSet("fetch", flag.ContinueOnError)
	host := fs.String("host", "127.0.0.1", "")
	port := fs.Int("port", 0, "")
	engine := fs.String("engine", "", "")
	hash := fs.String("hash", "", "local compatibility hash")
	ranks := fs.String("ranks", "0:0", "pp:tp,...")
	secret := fs.String("secret", "", "")
	allow := fs.Bool("allow-mismatch", false, "enforce_handshake_compat=false")
	timeout := fs.Duration("timeout", 20*time.Second, "")
	if err := fs.Parse(args); err != nil {
		return err
	}
	var rs []sidechannel.Rank
	for _, s := range strings.Split(*ranks, ",") {
		a, b, _ := strings.Cut(s, ":")
		pp, err1 := strconv.Atoi(a)
		tp, err2 := strconv.Atoi(b)
		if err1 != nil || err2 != nil {
			return fmt.Errorf("bad rank %q", s)
		}
		rs = append(rs, sidechannel.Rank{PP: pp, TP: tp})
	}
	cfg := sidechannel.ClientConfig{CompatHash: *hash, AllowCompatMismatch: *allow, Timeout: *timeout}
	if *secret != "" {
		cfg.Secret = []byte(*secret)
	}
	c := sidechannel.NewClient(cfg)
	defer c.Close()
	res, err := c.Handshake(context.Background(), *host, *port, *engine, rs...)
	if err != nil {
		json.NewEncoder(os.Stdout).Encode(map[string]any{"error": err.Error()})
		c.Close()
		os.Exit(1)
	}
	agents := map[string]any{}
	for r, m := range res.Agents {
		agents[fmt.Sprintf("%d:%d", r.PP, r.TP)] = toJSON(m)
	}
	return json.NewEncoder(os.Stdout).Encode(map[string]any{"agents": agents, "clock_offset": res.ClockOffset})
}

func toJSON(m *sidechannel.AgentMetadata) map[string]any {
	var ple any
	if m.PLEBlockLen != nil {
		ple = *m.PLEBlockLen
	}
	opt := func(v any, isNil bool) any {
		if isNil {
			return nil
		}
		return v
	}
	members := m.RegionMembers
	if members == nil {
		members = [][]string{}
	}
	packed := map[string]any{}
	for _, l := range m.PackedMemberLayouts {
		packed[l.Name] = []int64{l.Offset, l.PageLength}
	}
	addrs := make([]string, len(m.KVCachesBaseAddr)) // as strings: JSON numbers lose precision above 2^53
	for i, a := range m.KVCachesBaseAddr {
		addrs[i] = strconv.FormatUint(a, 10)
	}
	return map[string]any{
		"engine_id":                            m.EngineID,
		"agent_metadata":                       hex.EncodeToString(m.AgentMetadata),
		"kv_caches_base_addr":                  addrs,
		"device_id":                            m.DeviceID,
		"num_blocks":                           m.NumBlocks,
		"block_lens":                           nonNil(m.BlockLens),
		"block_strides":                        nonNil(m.BlockStrides),
		"kv_cache_layout":                      m.KVCacheLayout,
		"block_size":                           m.BlockSize,
		"ssm_sizes":                            m.SSMSizes[:],
		"attn_backend_name":                    m.AttnBackendName,
		"physical_blocks_per_logical_kv_block": m.PhysicalBlocksPerLogicalKVBlock,
		"region_num_blocks":                    opt(m.RegionNumBlocks, m.RegionNumBlocks == nil),
		"region_group_ids":                     opt(m.RegionGroupIDs, m.RegionGroupIDs == nil),
		"region_names":                         opt(m.RegionNames, m.RegionNames == nil),
		"region_mem_types":                     opt(m.RegionMemTypes, m.RegionMemTypes == nil),
		"dcp_size":                             m.DCPSize,
		"pcp_size":                             m.PCPSize,
		"ple_block_len":                        ple,
		"region_members":                       members,
		"packed_member_layouts":                packed,
	}
}

func nonNil(v []int64) []int64 {
	if v == nil {
		return []int64{}
	}
	return v
}

// fromJSON builds metadata from the JSON form; packed_member_layouts is a
// list of [name, offset, page_len] so its order is explicit.
func fromJSON(j map[string]any) (*sidechannel.AgentMetadata, error) {
	b, _ := json.Marshal(j)
	var in struct {
		EngineID     string     `json:"engine_id"`
		Agent        string     `json:"agent_metadata"`
		Addrs        []string   `json:"kv_caches_base_addr"`
		DeviceID     int64      `json:"device_id"`
		NumBlocks    int64      `json:"num_blocks"`
		BlockLens    []int64    `json:"block_lens"`
		BlockStrides []int64    `json:"block_strides"`
		Layout       string     `json:"kv_cache_layout"`
		BlockSize    int64      `json:"block_size"`
		SSM          [2]int64   `json:"ssm_sizes"`
		Backend      string     `json:"attn_backend_name"`
		Phys         int64      `json:"physical_blocks_per_logical_kv_block"`
		RegionNum    []int64    `json:"region_num_blocks"`
		RegionGroup  []int64    `json:"region_group_ids"`
		RegionNames  []string   `json:"region_names"`
		RegionMem    []string   `json:"region_mem_types"`
		DCP          *int64     `json:"dcp_size"`
		PCP          *int64     `json:"pcp_size"`
		PLE          *int64     `json:"ple_block_len"`
		Members      [][]string `json:"region_members"`
		Packed       [][3]any   `json:"packed_member_layouts"`
	}
	if err := json.Unmarshal(b, &in); err != nil {
		return nil, err
	}
	m := sidechannel.NewAgentMetadata()
	agent, err := hex.DecodeString(in.Agent)
	if err != nil {
		return nil, err
	}
	m.EngineID, m.AgentMetadata = in.EngineID, agent
	for _, a := range in.Addrs {
		v, err := strconv.ParseUint(a, 10, 64)
		if err != nil {
			return nil, err
		}
		m.KVCachesBaseAddr = append(m.KVCachesBaseAddr, v)
	}
	if m.KVCachesBaseAddr == nil {
		m.KVCachesBaseAddr = []uint64{}
	}
	m.DeviceID, m.NumBlocks, m.BlockLens, m.BlockStrides = in.DeviceID, in.NumBlocks, in.BlockLens, in.BlockStrides
	m.KVCacheLayout, m.BlockSize, m.SSMSizes, m.AttnBackendName = in.Layout, in.BlockSize, in.SSM, in.Backend
	m.PhysicalBlocksPerLogicalKVBlock = in.Phys
	// JSON null leaves these nil (None); [] gives a non-nil empty slice.
	m.RegionNumBlocks, m.RegionGroupIDs, m.RegionNames, m.RegionMemTypes = in.RegionNum, in.RegionGroup, in.RegionNames, in.RegionMem
	if in.DCP != nil {
		m.DCPSize = *in.DCP
	}
	if in.PCP != nil {
		m.PCPSize = *in.PCP
	}
	m.PLEBlockLen, m.RegionMembers = in.PLE, in.Members
	for _, p := range in.Packed {
		name, _ := p[0].(string)
		off, _ := p[1].(float64)
		pl, _ := p[2].(float64)
		m.PackedMemberLayouts = append(m.PackedMemberLayouts, sidechannel.PackedMemberLayout{Name: name, Offset: int64(off), PageLength: int64(pl)})
	}
	return m, nil
}
