package tests

import (
	"bytes"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

const module = "github.com/gonixl/gonixl"

type goPackage struct {
	ImportPath string
	Name       string
	Dir        string
	Imports    []string
	CgoFiles   []string
	GoFiles    []string
}

// rule says what a package (matched by prefix, relative to the module) may
// import from the module and from outside the standard library.
type rule struct {
	prefix   string   // module-relative path; "x/" matches x and its subpackages
	internal []string // allowed module packages (prefixes ending in "/..." match subtrees)
	external []string // allowed third-party module prefixes
	cgo      bool     // may use import "C"
	unsafe   bool     // may import unsafe
}

var (
	logging = []string{"go.uber.org/zap"}
	metrics = []string{"github.com/prometheus/client_golang", "github.com/prometheus/common", "github.com/prometheus/client_model"}
)

// rules follow docs/ARCHITECTURE.md ("Layers"; each package's doc.go says
// what it may import). The first matching prefix wins; a package no rule matches fails.
var rules = []rule{
	{prefix: "capi", internal: []string{"shim", "shim/kvwire", "nixl", "nixl/..."}, cgo: true, unsafe: true},
	{prefix: "shim", internal: []string{"shim/kvwire", "nixl", "nixl/memhash", "sidechannel"}, external: concat(logging, metrics)},
	// The wire formats: a leaf, below shim (nothing of the module).
	{prefix: "shim/kvwire", internal: nil, external: []string{"github.com/vmihailenco/msgpack/v5"}},
	{prefix: "nixl/libnixl", internal: []string{"nixl", "nixl/internal/native"}, cgo: true, unsafe: true},
	{prefix: "nixl/ucx", internal: []string{"nixl", "nixl/internal/native"}, cgo: true, unsafe: true},
	{prefix: "nixl/nixltest", internal: []string{"nixl"}, unsafe: true},
	{prefix: "nixl/internal/", internal: []string{"nixl", "nixl/internal/..."}, unsafe: true},
	// Reads this process's memory by address (KV digests): a leaf.
	{prefix: "nixl/memhash", internal: nil, external: []string{"github.com/zeebo/xxh3"}, unsafe: true},
	{prefix: "nixl", internal: nil},
	{prefix: "sidechannel", internal: nil, external: concat(logging, []string{"github.com/vmihailenco/msgpack/v5"})},
	{prefix: "proxy", internal: nil, external: concat(logging, metrics)},
	// The shared conversation state: the proxy's StateStore in Redis/Valkey.
	{prefix: "proxy/redisstate", internal: []string{"proxy"}, external: []string{"github.com/redis/go-redis/v9"}},
	{prefix: "proxy/redisstate/redistest", internal: nil},
	{prefix: "cmd/gonixl-proxy", internal: []string{"proxy", "proxy/redisstate"}, external: concat(logging, metrics)},
	{prefix: "cmd/gonixl-bench", internal: []string{"nixl", "nixl/..."}, external: concat(logging, metrics)},
	{prefix: "tests/", internal: []string{"..."}, external: []string{""}, cgo: true, unsafe: true},
	{prefix: "tests", internal: nil},
}

func concat(lists ...[]string) []string {
	var out []string
	for _, l := range lists {
		out = append(out, l...)
	}
	return out
}

func (r rule) matches(rel string) bool {
	if strings.HasSuffix(r.prefix, "/") {
		return strings.HasPrefix(rel, r.prefix)
	}
	return rel == r.prefix
}

func allowedInternal(r rule, dep string) bool {
	for _, a := range r.internal {
		switch {
		case a == "...":
			return true
		case strings.HasSuffix(a, "/..."):
			base := strings.TrimSuffix(a, "/...")
			if strings.HasPrefix(dep, base+"/") {
				return true
			}
		case a == dep:
			return true
		}
	}
	return false
}

func allowedExternal(r rule, dep string) bool {
	for _, a := range r.external {
		if a == "" || dep == a || strings.HasPrefix(dep, a+"/") {
			return true
		}
	}
	return false
}

func isStd(path string) bool {
	first := strings.SplitN(path, "/", 2)[0]
	return !strings.Contains(first, ".")
}

func listPackages(t *testing.T) []goPackage {
	t.Helper()
	_, file, _, _ := runtime.Caller(0)
	root := filepath.Dir(filepath.Dir(file))
	cmd := exec.Command("go", "list", "-json", "./...")
	cmd.Dir = root
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, stderr.String())
	}
	var pkgs []goPackage
	dec := json.NewDecoder(bytes.NewReader(out))
	for {
		var p goPackage
		if err := dec.Decode(&p); err == io.EOF {
			break
		} else if err != nil {
			t.Fatalf("decode go list output: %v", err)
		}
		pkgs = append(pkgs, p)
	}
	if len(pkgs) == 0 {
		t.Fatal("go list returned no packages")
	}
	return pkgs
}

func TestLayering(t *testing.T) {
	pkgs := listPackages(t)
	seen := map[string]bool{}
	for _, p := range pkgs {
		rel := strings.TrimPrefix(strings.TrimPrefix(p.ImportPath, module), "/")
		seen[rel] = true
		var r *rule
		for i := range rules {
			if rules[i].matches(rel) {
				r = &rules[i]
				break
			}
		}
		if r == nil {
			t.Errorf("package %s matches no layering rule; add one to tests/layering_test.go that follows the architecture", p.ImportPath)
			continue
		}
		if len(p.CgoFiles) > 0 && !r.cgo {
			t.Errorf("package %s uses import \"C\" (%v); cgo is allowed only in capi and the engine subpackages", p.ImportPath, p.CgoFiles)
		}
		for _, dep := range p.Imports {
			switch {
			case dep == "C":
				// covered by CgoFiles
			case dep == "unsafe":
				if !r.unsafe {
					t.Errorf("package %s imports unsafe; unsafe is allowed only in capi and the engine subpackages", p.ImportPath)
				}
			case strings.HasPrefix(dep, module+"/") || dep == module:
				d := strings.TrimPrefix(strings.TrimPrefix(dep, module), "/")
				if d == "capi" {
					t.Errorf("package %s imports capi; nothing may import capi", p.ImportPath)
				} else if !allowedInternal(*r, d) {
					t.Errorf("package %s imports %s, which the architecture does not allow (allowed: %v)", p.ImportPath, d, r.internal)
				}
			case isStd(dep):
			default:
				if !allowedExternal(*r, dep) {
					t.Errorf("package %s imports third-party %s (allowed: %v)", p.ImportPath, dep, r.external)
				}
			}
		}
	}
	for _, p := range pkgs {
		if _, err := os.Stat(filepath.Join(p.Dir, "doc.go")); err != nil {
			t.Errorf("package %s has no doc.go (what it is for, what it may import, its concurrency contract)", p.ImportPath)
		}
	}
	for _, must := range []string{"capi", "shim", "shim/kvwire", "nixl"} {
		if !seen[must] {
			t.Errorf("package %s is missing from go list output", must)
		}
	}
}

// TestRulesRejectViolations checks the checker itself: a layering checker
// that accepts everything would pass TestLayering silently.
func TestRulesRejectViolations(t *testing.T) {
	find := func(rel string) rule {
		for _, r := range rules {
			if r.matches(rel) {
				return r
			}
		}
		t.Fatalf("no rule for %s", rel)
		return rule{}
	}
	cases := []struct {
		pkg, dep string
		want     bool
	}{
		{"shim", "nixl", true},
		{"shim", "nixl/libnixl", false},
		{"shim", "nixl/ucx", false},
		{"shim", "sidechannel", true},
		{"nixl", "shim", false},
		{"sidechannel", "nixl", false},
		{"proxy", "shim", false},
		{"capi", "nixl/ucx", true},
		{"nixl/ucx", "nixl", true},
		{"nixl/ucx", "shim", false},
	}
	for _, c := range cases {
		if got := allowedInternal(find(c.pkg), c.dep); got != c.want {
			t.Errorf("%s importing %s: allowed=%v, want %v", c.pkg, c.dep, got, c.want)
		}
	}
	if find("shim").cgo || find("shim").unsafe || find("nixl").unsafe || find("sidechannel").cgo {
		t.Error("pure-Go layers must not be allowed cgo or unsafe")
	}
	if allowedExternal(find("nixl"), "go.uber.org/zap") {
		t.Error("nixl must stay standard-library only")
	}
}
