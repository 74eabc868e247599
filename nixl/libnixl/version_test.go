package libnixl

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gonixl/gonixl/nixl"
)

func TestSupportedVersion(t *testing.T) {
	for _, v := range []string{supportedMin, supportedMax} {
		if !supportedVersion(v) {
			t.Errorf("supportedVersion(%q) = false", v)
		}
	}
	// Versions around the range (1.5.1) and strings that are no release.
	for _, v := range []string{"1.5.0", "1.5.2", "1.4.0", "1.6.0", "2.0.0", "0.9.0", "1.5.10",
		"1.5.1rc1", "1.5.1.dev0", "1.5.1+local", "1.5", "1.5.1.0", "", "v1.5.1", "1..1", "01.5.1x"} {
		if supportedVersion(v) {
			t.Errorf("supportedVersion(%q) = true", v)
		}
	}
	if s := SupportedVersions(); !strings.Contains(s, supportedMin) {
		t.Errorf("SupportedVersions() = %q", s)
	}
}

func TestBannerVersion(t *testing.T) {
	for _, c := range []struct {
		data, want string
		err        bool
	}{
		{"\x00FATAL\x00NIXL_LOG_LEVEL\x00NIXL version: \x001.5.1\x00 (git: \x001d2a52eb\x00", "1.5.1", false},
		{"NIXL version: \x002.0.0rc1\x00", "2.0.0rc1", false}, // at the start of the section
		{"\x00no banner here\x001.5.1\x00", "", false},
		{"\x00Old NIXL version: \x009.9.9\x00", "", false}, // the tail of another string
		{"\x00NIXL version: 1.5.1\x00", "", false},         // not the banner literal
		{"\x00NIXL version: \x00 (git: \x00", "", true},
		{"\x00NIXL version: \x00", "", true},
		{"\x00NIXL version: \x001.5.1", "", true},
		{"\x00NIXL version: \x001.5.1\x00NIXL version: \x001.6.0\x00", "", true},
		{"\x00NIXL version: \x001.5.1\x00NIXL version: \x001.5.1\x00", "1.5.1", false},
	} {
		got, err := bannerVersion([]byte(c.data))
		if got != c.want || (err != nil) != c.err {
			t.Errorf("bannerVersion(%q) = %q, %v; want %q, error %v", c.data, got, err, c.want, c.err)
		}
	}
}

// The version is read from the installed library's files, and the loaded
// library passes the check: a NIXL that is present but refused fails here
// rather than skipping the tests that need it.
func TestInstalledVersionAccepted(t *testing.T) {
	if os.Getenv("NIXL_LIB_DIR") == "" && len(candidates()) == 1 {
		t.Skip("no nixl wheel found (candidates: only the bare soname)")
	}
	if err := (Engine{}).Available(); err != nil {
		if nixl.StatusOf(err) == nixl.ErrNotSupported || nixl.StatusOf(err) == nixl.ErrNotFound {
			t.Fatalf("installed NIXL refused: %v", err)
		}
		t.Skipf("NIXL not loadable here: %v", err)
	}
	common := loadedFile(versionLib)
	v, err := libraryVersion(common)
	if err != nil {
		t.Fatalf("version of %s: %v", common, err)
	}
	t.Logf("%s loaded with %s: NIXL %s", LibraryPath(), common, v)
	if v != Version() || !supportedVersion(v) {
		t.Fatalf("file says NIXL %q, Version() %q, supported %s", v, Version(), supportedText())
	}
	if !strings.Contains((Engine{}).Info(), "NIXL "+v+" ") {
		t.Errorf("Info does not name the version: %s", (Engine{}).Info())
	}
}

// stubLib builds, with the C compiler, a stand-in NIXL in a new directory:
// libnixl_capi.so defining the required C API symbols except omit (each
// aborts the process if called) and depending on a libnixl_common.so that
// holds NIXL's version banner with version ("" for no banner).
func stubLib(t *testing.T, version, omit string) string {
	t.Helper()
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "gcc"
	}
	if _, err := exec.LookPath(cc); err != nil {
		t.Skipf("no C compiler (%s) to build a stub NIXL: %v", cc, err)
	}
	dir := t.TempDir()
	common := "const char gonixl_stub_text[] = \"\\0\" \"NIXL build without a version banner\";\n"
	if version != "" {
		common = fmt.Sprintf("const char gonixl_stub_banner[] = \"\\0\" %q \"\\0\" %q \"\\0\" \" (git: \" \"\\0\" \"stub\";\n",
			versionBanner, version)
	}
	var capi strings.Builder
	capi.WriteString("#include <stdlib.h>\n")
	omitted := false
	for _, s := range requiredSymbols() {
		if s == omit {
			omitted = true
			continue
		}
		fmt.Fprintf(&capi, "int %s(void) { abort(); }\n", s)
	}
	if omit != "" && !omitted {
		t.Fatalf("%s is not a required symbol", omit)
	}
	write := func(name, text string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	run := func(args ...string) {
		if out, err := exec.Command(cc, args...).CombinedOutput(); err != nil {
			t.Fatalf("%s %v: %v\n%s", cc, args, err, out)
		}
	}
	run("-shared", "-fPIC", "-o", filepath.Join(dir, versionLib), write("common.c", common),
		"-Wl,-soname,"+versionLib)
	run("-shared", "-fPIC", "-o", filepath.Join(dir, capiName), write("capi.c", capi.String()),
		"-Wl,-soname,"+capiName, "-Wl,--no-as-needed", "-L"+dir, "-lnixl_common", "-Wl,-rpath,$ORIGIN")
	return dir
}

// maybeStubChild is the child side of loadStub: with
// GONIXL_TEST_STUB_CHILD=1 it loads whatever NIXL_LIB_DIR holds, prints
// what Available and Version report, and exits.
func maybeStubChild() {
	if os.Getenv("GONIXL_TEST_STUB_CHILD") != "1" {
		return
	}
	err := Engine{}.Available()
	fmt.Printf("status=%v\nunavailable=%v\nversion=%s\nerror=%v\n",
		nixl.StatusOf(err).String(), errors.Is(err, nixl.ErrUnavailable), Version(), err)
	os.Exit(0)
}

type stubResult struct{ status, unavailable, version, err string }

// loadStub loads the library in dir in a child process (load state is per
// process, and an earlier load of the real NIXL would satisfy the stub's
// dependency by soname).
func loadStub(t *testing.T, dir string) stubResult {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "GONIXL_TEST_STUB_CHILD=1", "NIXL_LIB_DIR="+dir)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	var r stubResult
	for _, l := range strings.Split(string(out), "\n") {
		k, v, _ := strings.Cut(l, "=")
		switch k {
		case "status":
			r.status = v
		case "unavailable":
			r.unavailable = v
		case "version":
			r.version = v
		case "error":
			r.err = v
		}
	}
	if r.status == "" {
		t.Fatalf("child printed no result:\n%s", out)
	}
	t.Logf("child: %s", r.err)
	return r
}

// A NIXL of another version is refused, with an error naming both
// versions, before any symbol is resolved: the stub also lacks a required
// symbol, and the error is about the version, not the symbol.
func TestRefuseOtherVersion(t *testing.T) {
	syms := requiredSymbols()
	r := loadStub(t, stubLib(t, "9.8.7", syms[len(syms)/2]))
	if r.status != nixl.ErrNotSupported.String() || r.unavailable != "true" || r.version != "" {
		t.Fatalf("NIXL 9.8.7 stub: %+v", r)
	}
	for _, want := range []string{"NIXL 9.8.7", "NIXL " + supportedMin, capiName, "NIXL not available"} {
		if !strings.Contains(r.err, want) {
			t.Errorf("error does not name %q: %s", want, r.err)
		}
	}
	if strings.Contains(r.err, syms[len(syms)/2]) {
		t.Errorf("symbols were resolved before the version was checked: %s", r.err)
	}
}

// A NIXL whose version cannot be read is refused too.
func TestRefuseUnknownVersion(t *testing.T) {
	r := loadStub(t, stubLib(t, "", ""))
	if r.status != nixl.ErrNotSupported.String() || r.unavailable != "true" {
		t.Fatalf("stub without a version: %+v", r)
	}
	for _, want := range []string{"cannot tell which NIXL", versionLib, "NIXL " + supportedMin} {
		if !strings.Contains(r.err, want) {
			t.Errorf("error does not name %q: %s", want, r.err)
		}
	}
}

// A supported version missing a required symbol is refused at load, naming
// the symbol.
func TestMissingSymbol(t *testing.T) {
	missing := "nixl_capi_gen_notif"
	r := loadStub(t, stubLib(t, supportedMin, missing))
	if r.status != nixl.ErrNotFound.String() || r.unavailable != "true" || r.version != "" {
		t.Fatalf("stub without %s: %+v", missing, r)
	}
	for _, want := range []string{"lacks symbol " + missing, "NIXL " + supportedMin} {
		if !strings.Contains(r.err, want) {
			t.Errorf("error does not say %q: %s", want, r.err)
		}
	}
}

// The same stubs pass with a supported version and every symbol: the
// refusals above come from the version and the symbol, not the stub.
func TestStubSupportedVersionLoads(t *testing.T) {
	r := loadStub(t, stubLib(t, supportedMax, ""))
	if r.status != nixl.Success.String() || r.version != supportedMax {
		t.Fatalf("NIXL %s stub: %+v", supportedMax, r)
	}
}
