package kvwire

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// exportedStrings returns the exported string constants of the Go package
// in dir (test files excluded), by name.
func exportedStrings(t *testing.T, dir string) map[string]string {
	t.Helper()
	fset := token.NewFileSet()
	pkgs, err := parser.ParseDir(fset, dir, func(fi os.FileInfo) bool { return !strings.HasSuffix(fi.Name(), "_test.go") }, 0)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, p := range pkgs {
		for _, f := range p.Files {
			for _, d := range f.Decls {
				gd, ok := d.(*ast.GenDecl)
				if !ok || gd.Tok != token.CONST {
					continue
				}
				for _, s := range gd.Specs {
					vs := s.(*ast.ValueSpec)
					for i, n := range vs.Names {
						if !n.IsExported() || i >= len(vs.Values) {
							continue
						}
						if lit, ok := vs.Values[i].(*ast.BasicLit); ok && lit.Kind == token.STRING {
							v, err := strconv.Unquote(lit.Value)
							if err != nil {
								t.Fatal(err)
							}
							out[n.Name] = v
						}
					}
				}
			}
		}
	}
	return out
}

// Every string constant of the wire formats — gonixl's keys, prefixes and
// factors here and in the side channel — is specified in docs/PROTOCOL.md,
// and every gonixl_* key the Python connector writes is one of them: a key
// added without its line in the protocol document fails here.
func TestProtocolDocumentsEveryConstant(t *testing.T) {
	doc, err := os.ReadFile(filepath.Join("..", "..", "docs", "PROTOCOL.md"))
	if err != nil {
		t.Fatal(err)
	}
	consts := exportedStrings(t, ".")
	for name, v := range exportedStrings(t, filepath.Join("..", "..", "sidechannel")) {
		if strings.HasPrefix(v, "gonixl") {
			consts["sidechannel."+name] = v
		}
	}
	if len(consts) < 10 {
		t.Fatalf("found only %d constants: %v", len(consts), consts)
	}
	for name, v := range consts {
		if !strings.Contains(string(doc), "`"+v) {
			t.Errorf("%s (%q) is not specified in docs/PROTOCOL.md", name, v)
		}
	}
	// The Python connector's gonixl_* strings: C functions (the header
	// declares them) or wire keys.
	header, err := os.ReadFile(filepath.Join("..", "..", "include", "gonixl.h"))
	if err != nil {
		t.Fatal(err)
	}
	known := map[string]bool{}
	for _, v := range consts {
		known[v] = true
	}
	lit := regexp.MustCompile(`"(gonixl_[a-z_]+)"`)
	files, _ := filepath.Glob(filepath.Join("..", "..", "pybridge", "gonixl", "*.py"))
	if len(files) == 0 {
		t.Fatal("no Python connector files found")
	}
	for _, f := range files {
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range lit.FindAllStringSubmatch(string(src), -1) {
			k := m[1]
			if known[k] || strings.Contains(string(header), " "+k+"(") {
				continue
			}
			t.Errorf("%s writes %q, which is neither a kvwire key nor a C function: add it to shim/kvwire and docs/PROTOCOL.md", filepath.Base(f), k)
		}
	}
}
