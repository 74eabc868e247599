package native

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
)

func TestMappedSites(t *testing.T) {
	dir := t.TempDir()
	maps := filepath.Join(dir, "maps")
	content := "7f00-7f01 r-xp 00000000 08:01 1 /v/lib/python3.11/site-packages/torch/lib/libc10.so\n" +
		"7f01-7f02 r-xp 00000000 08:01 2 /v/lib/python3.11/site-packages/torch/lib/libtorch.so\n" +
		"7f02-7f03 r-xp 00000000 08:01 3 /usr/lib/x86_64-linux-gnu/libc.so.6\n" +
		"7f03-7f04 r-xp 00000000 08:01 4 /w/site-packages/a.so\n"
	if err := os.WriteFile(maps, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	got := mappedSites(maps)
	want := []string{"/v/lib/python3.11/site-packages", "/w/site-packages"}
	if !slices.Equal(got, want) {
		t.Fatalf("mapped sites %q, want %q", got, want)
	}
}

func TestSitePackagesVirtualEnvFirst(t *testing.T) {
	venv := t.TempDir()
	for _, v := range []string{"python3.11", "python3.12"} {
		if err := os.MkdirAll(filepath.Join(venv, "lib", v, "site-packages", "pkg"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(venv, "lib", "python3.11", "site-packages", "pkg", "lib.so"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("VIRTUAL_ENV", venv)
	sp := SitePackages()
	want := []string{filepath.Join(venv, "lib", "python3.12", "site-packages"), filepath.Join(venv, "lib", "python3.11", "site-packages")}
	if len(sp) < 2 || !slices.Equal(sp[:2], want) {
		t.Fatalf("site-packages %q, want %q first", sp, want)
	}
	if got := Find(filepath.Join("pkg", "lib.so"), filepath.Join("pkg", "none.so")); len(got) != 1 || got[0] != filepath.Join(want[1], "pkg", "lib.so") {
		t.Fatalf("Find: %q", got)
	}
}

func TestSetUCXDefaultsKeepsUserValues(t *testing.T) {
	t.Setenv("UCX_RCACHE_MAX_UNRELEASED", "7")
	for _, k := range []string{"UCX_HANDLE_ERRORS", "UCX_ERROR_SIGNALS"} {
		old, had := os.LookupEnv(k)
		os.Unsetenv(k)
		t.Cleanup(func() {
			if had {
				os.Setenv(k, old)
			} else {
				os.Unsetenv(k)
			}
		})
	}
	set := SetUCXDefaults()
	if !slices.Equal(set, []string{"UCX_HANDLE_ERRORS", "UCX_ERROR_SIGNALS"}) {
		t.Fatalf("set %q", set)
	}
	if os.Getenv("UCX_RCACHE_MAX_UNRELEASED") != "7" || os.Getenv("UCX_HANDLE_ERRORS") != "none" {
		t.Fatal("defaults overrode the user or were not set")
	}
	if v, ok := os.LookupEnv("UCX_ERROR_SIGNALS"); !ok || v != "" {
		t.Fatalf("UCX_ERROR_SIGNALS %q %v", v, ok)
	}
	Unset(set)
	if _, ok := os.LookupEnv("UCX_HANDLE_ERRORS"); ok {
		t.Fatal("Unset")
	}
}
