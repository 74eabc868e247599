package native

import (
	"bufio"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// SitePackages returns the Python site-packages directories this process
// can see, most specific first, each once: those of $VIRTUAL_ENV; those
// holding an object already mapped into the process (inside vLLM, torch's
// and vLLM's own extensions: an unactivated virtual environment is found
// too); and those of every .venv found walking up from the working
// directory and from the executable's directory (Go tests and tools).
// Within a virtual environment the highest python3.N comes first.
func SitePackages() []string {
	var out []string
	seen := map[string]bool{}
	add := func(dirs ...string) {
		for _, d := range dirs {
			if d != "" && !seen[d] {
				seen[d] = true
				out = append(out, d)
			}
		}
	}
	if v := os.Getenv("VIRTUAL_ENV"); v != "" {
		add(venvSites(v)...)
	}
	add(mappedSites("/proc/self/maps")...)
	var starts []string
	if wd, err := os.Getwd(); err == nil {
		starts = append(starts, wd)
	}
	if exe, err := os.Executable(); err == nil {
		starts = append(starts, filepath.Dir(exe))
	}
	for _, s := range starts {
		for d := s; ; d = filepath.Dir(d) {
			if fi, err := os.Stat(filepath.Join(d, ".venv")); err == nil && fi.IsDir() {
				add(venvSites(filepath.Join(d, ".venv"))...)
			}
			if filepath.Dir(d) == d {
				break
			}
		}
	}
	return out
}

// Find returns, for each site-packages directory in SitePackages order,
// each of rels under it that exists as a file.
func Find(rels ...string) []string {
	var out []string
	for _, sp := range SitePackages() {
		for _, r := range rels {
			p := filepath.Join(sp, r)
			if fi, err := os.Stat(p); err == nil && !fi.IsDir() {
				out = append(out, p)
			}
		}
	}
	return out
}

func venvSites(venv string) []string {
	m, _ := filepath.Glob(filepath.Join(venv, "lib", "python3*", "site-packages"))
	sort.Sort(sort.Reverse(sort.StringSlice(m)))
	return m
}

// mappedSites lists the site-packages directories of the objects mapped
// in a /proc/<pid>/maps file.
func mappedSites(maps string) []string {
	f, err := os.Open(maps)
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	seen := map[string]bool{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		i := strings.Index(line, "/site-packages/")
		if i < 0 {
			continue
		}
		j := strings.LastIndexByte(line[:i], ' ')
		d := line[j+1 : i+len("/site-packages")]
		if !seen[d] {
			seen[d] = true
			out = append(out, d)
		}
	}
	return out
}

// ucxDefaults are set (each only where the user left it unset) before UCX
// is loaded by either engine:
//   - UCX_RCACHE_MAX_UNRELEASED=1024, as vLLM sets it: bounds UCX's
//     registration cache of freed-but-registered regions;
//   - UCX_HANDLE_ERRORS=none and UCX_ERROR_SIGNALS="": libucs otherwise
//     installs its own SIGSEGV/SIGBUS/SIGILL/SIGFPE handlers over the Go
//     runtime's, turning a recoverable Go panic anywhere in the process
//     into a UCX backtrace and an abort. libucs reads them when loaded.
var ucxDefaults = [][2]string{
	{"UCX_RCACHE_MAX_UNRELEASED", "1024"},
	{"UCX_HANDLE_ERRORS", "none"},
	{"UCX_ERROR_SIGNALS", ""},
}

// SetUCXDefaults applies the UCX environment defaults and returns the
// names it set (for Unset, when a candidate library fails to load). os.Setenv
// reaches the C environment (getenv) under cgo.
func SetUCXDefaults() []string {
	var set []string
	for _, kv := range ucxDefaults {
		if _, ok := os.LookupEnv(kv[0]); !ok {
			_ = os.Setenv(kv[0], kv[1])
			set = append(set, kv[0])
		}
	}
	return set
}

// Unset removes the named variables (undoing SetUCXDefaults).
func Unset(names []string) {
	for _, k := range names {
		_ = os.Unsetenv(k)
	}
}
