package libnixl

import (
	"bytes"
	"debug/elf"
	"fmt"
	"strconv"
	"strings"
)

// The NIXL versions (inclusive) whose ABI gxnixl.c was written against: the
// C API's structs and signatures it declares by hand and the mangled
// nixlAgent methods it calls. Only NIXL 1.5.1 (requirements.lock) has been
// checked; widen the range only after checking a version's wrapper.h and
// nixlAgent against gxnixl.c.
const (
	supportedMin = "1.5.1"
	supportedMax = "1.5.1"
)

// versionLib is the NIXL library that carries the build's version, and
// versionBanner the text NIXL logs it after (nixl_log.cpp:
// "NIXL version: " NIXL_VERSION [" (git: " NIXL_GIT_HASH ")"], NIXL_VERSION
// being meson's project version). Both are string literals of that one
// translation unit, so the version string follows the banner string in the
// library's read-only data.
const (
	versionLib    = "libnixl_common.so"
	versionBanner = "NIXL version: "
)

// supportedText names the supported versions for messages.
func supportedText() string {
	if supportedMin == supportedMax {
		return "NIXL " + supportedMin + " only"
	}
	return "NIXL " + supportedMin + " to " + supportedMax
}

// parseVersion reads a release version "X.Y.Z". Anything else (two parts,
// a pre-release or local suffix) is not a version this binding knows.
func parseVersion(s string) (v [3]int, ok bool) {
	parts := strings.Split(s, ".")
	if len(parts) != 3 {
		return v, false
	}
	for i, p := range parts {
		if p == "" || len(p) > 6 || strings.TrimLeft(p, "0123456789") != "" {
			return v, false
		}
		v[i], _ = strconv.Atoi(p)
	}
	return v, true
}

func cmpVersion(a, b [3]int) int {
	for i := range a {
		if a[i] != b[i] {
			if a[i] < b[i] {
				return -1
			}
			return 1
		}
	}
	return 0
}

// supportedVersion reports whether v lies in [supportedMin, supportedMax].
func supportedVersion(v string) bool {
	pv, ok := parseVersion(v)
	lo, _ := parseVersion(supportedMin)
	hi, _ := parseVersion(supportedMax)
	return ok && cmpVersion(pv, lo) >= 0 && cmpVersion(pv, hi) <= 0
}

// libraryVersion reads the NIXL version compiled into the library file at
// path (libnixl_common.so): the string after the version banner in its
// read-only data. It reads the file only; nothing of it is executed.
func libraryVersion(path string) (string, error) {
	f, err := elf.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	found := ""
	for _, s := range f.Sections {
		if s.Type != elf.SHT_PROGBITS || s.Flags&elf.SHF_ALLOC == 0 || s.Flags&(elf.SHF_WRITE|elf.SHF_EXECINSTR) != 0 {
			continue
		}
		data, err := s.Data()
		if err != nil {
			return "", fmt.Errorf("reading %s: %v", s.Name, err)
		}
		v, err := bannerVersion(data)
		if err != nil {
			return "", fmt.Errorf("%s: %v", s.Name, err)
		}
		if v != "" && found != "" && v != found {
			return "", fmt.Errorf("two version banners (%q, %q)", found, v)
		}
		if v != "" {
			found = v
		}
	}
	if found == "" {
		return "", fmt.Errorf("no %q banner in its read-only data", versionBanner)
	}
	return found, nil
}

// bannerVersion finds the NUL-terminated string versionBanner in data and
// returns the NUL-terminated string after it, which must look like a
// version; "" when data holds no banner.
func bannerVersion(data []byte) (string, error) {
	marker := []byte(versionBanner + "\x00")
	found := ""
	for off := 0; ; {
		i := bytes.Index(data[off:], marker)
		if i < 0 {
			break
		}
		i += off
		off = i + len(marker)
		if i > 0 && data[i-1] != 0 {
			continue // the tail of a longer string
		}
		end := bytes.IndexByte(data[off:], 0)
		if end < 0 {
			return "", fmt.Errorf("version banner without a version after it")
		}
		v := string(data[off : off+end])
		if !looksLikeVersion(v) {
			return "", fmt.Errorf("version banner followed by %q, not a version", v)
		}
		if found != "" && v != found {
			return "", fmt.Errorf("two version banners (%q, %q)", found, v)
		}
		found = v
	}
	return found, nil
}

// looksLikeVersion accepts what a meson project version can be (digits
// first, then digits, letters, '.', '+', '-', '_'), short.
func looksLikeVersion(s string) bool {
	if s == "" || len(s) > 64 || s[0] < '0' || s[0] > '9' {
		return false
	}
	for _, c := range []byte(s) {
		switch {
		case c >= '0' && c <= '9', c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c == '.', c == '+', c == '-', c == '_':
		default:
			return false
		}
	}
	return true
}
