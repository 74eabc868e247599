package proxy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand"
	"reflect"
	"strings"
	"testing"
	"testing/iotest"
)

// parseObjectCases are texts on which parseObject must agree with
// encoding/json: objects of every value kind, escapes, odd spacing,
// duplicates, and invalid or non-object texts (whose errors must match).
var parseObjectCases = []string{
	`{}`, ` { } `, `{"a":1}`, "\t{\n\"a\" :\r1 , \"b\":\"x\" }\n",
	`{"s":"a\"b\\c\/\u00e9\n","n":-1.5e+3,"t":true,"f":false,"z":null}`,
	`{"o":{"x":[1,{"y":"}]"}],"e":{}},"a":[],"b":[[[]]]}`,
	`{"k\"ey":1,"\u006b":2,"caf\u00e9":3,"é":4,"\ud83d\ude00":5}`,
	`{"dup":1,"dup":2}`, `{"a":"]}{["}`, `{"":0}`,
	"{\"bad\xffkey\":1}", "{\"v\":\"bad\xffvalue\"}",
	`null`, ` null `, `[1,2]`, `"s"`, `1`, `true`, ``, ` `, `{`, `{"a"}`, `{"a":}`, `{"a":1,}`,
	`{"a":1}x`, `{"a":1}{}`, `{'a':1}`, `{"a":01}`, `{"a":tru}`, "{\"a\":\"\x01\"}", `{"a":1}]`,
	"\xef\xbb\xbf{}", `not json`, `{"a":[1,2}`, `{"a":"\x"}`,
}

func checkParseObject(t *testing.T, in []byte) {
	t.Helper()
	got, gotErr := parseObject(in)
	want, wantErr := unmarshalObject(in)
	if fmt.Sprint(gotErr) != fmt.Sprint(wantErr) {
		t.Fatalf("%q: error %v, want %v", in, gotErr, wantErr)
	}
	if len(got) != len(want) || (got == nil) != (want == nil) {
		t.Fatalf("%q: %v, want %v", in, got, want)
	}
	for k, v := range want {
		if g, ok := got[k]; !ok || !bytes.Equal(g, v) {
			t.Fatalf("%q: key %q = %q, want %q", in, k, g, v)
		}
	}
}

func TestParseObjectMatchesEncodingJSON(t *testing.T) {
	for _, c := range parseObjectCases {
		checkParseObject(t, []byte(c))
	}
	// Random cuts and byte flips of valid objects: mostly invalid texts,
	// some still valid.
	rng := rand.New(rand.NewSource(1))
	const flips = `{}[]":,\ 1an`
	for _, c := range parseObjectCases[:10] {
		for n := 0; n < 300; n++ {
			b := []byte(c)
			switch rng.Intn(3) {
			case 0:
				b = b[:rng.Intn(len(b)+1)]
			case 1:
				b[rng.Intn(len(b))] = flips[rng.Intn(len(flips))]
			default:
				i := rng.Intn(len(b) + 1)
				b = append(b[:i:i], append([]byte{flips[rng.Intn(len(flips))]}, b[i:]...)...)
			}
			checkParseObject(t, b)
		}
	}
}

func FuzzParseObject(f *testing.F) {
	for _, c := range parseObjectCases {
		f.Add([]byte(c))
	}
	f.Fuzz(func(t *testing.T, in []byte) { checkParseObject(t, in) })
}

func TestHasKVParams(t *testing.T) {
	for body, want := range map[string]bool{
		`{}`: false, `{"kv_transfer_params":null}`: false, `{"kv_transfer_params":{}}`: false,
		`{"kv_transfer_params":{ }}`: false, `{"kv_transfer_params":"{x}"}`: false, `{"kv_transfer_params":[1]}`: false,
		`{"kv_transfer_params":{"a":1}}`: true, `{"kv_transfer_params": { "a" : 1 } }`: true,
	} {
		o, err := parseObject([]byte(body))
		if err != nil {
			t.Fatal(err)
		}
		_, viaParse := kvParams(o)
		if got := hasKVParams(o); got != want || viaParse != want {
			t.Errorf("%s: hasKVParams %v, kvParams %v, want %v", body, got, viaParse, want)
		}
	}
}

// The values of a parsed object are the input's own bytes, as
// json.RawMessage would hold them.
func TestParseObjectValues(t *testing.T) {
	o, err := parseObject([]byte(` {"a" : [1, 2] ,"b":"x"} `))
	if err != nil {
		t.Fatal(err)
	}
	want := object{"a": json.RawMessage(`[1, 2]`), "b": json.RawMessage(`"x"`)}
	if !reflect.DeepEqual(o, want) {
		t.Errorf("%q, want %q", o, want)
	}
}

var benchBody = []byte(`{"model":"m","prompt":"` + string(bytes.Repeat([]byte("word "), 64)) +
	`","max_tokens":16,"stream":false,"temperature":0,"bench_service_us":0}`)

func BenchmarkParseObject(b *testing.B) {
	b.Run("scan", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			_, _ = parseObject(benchBody)
		}
	})
	b.Run("encoding/json", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			_, _ = unmarshalObject(benchBody)
		}
	})
}

func BenchmarkToyBodies(b *testing.B) {
	presp := []byte(`{"id":"cmpl-p","object":"text_completion","choices":[{"index":0,"text":"x","finish_reason":"length"}],` +
		`"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1,2,3,4,5,6,7,8],` +
		`"remote_engine_id":"e0","remote_request_id":"r0","remote_host":"127.0.0.1","remote_port":5600,"tp_size":1}}`)
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		o, _ := parseObject(benchBody)
		_, _ = toyPrefillBody(o)
		p, _ := parseObject(presp)
		if hasKVParams(p) {
			d := o.clone()
			d["kv_transfer_params"] = p["kv_transfer_params"]
			_, _ = d.marshal()
		}
	}
}

var validJSONCases = []string{
	`0`, `-0`, `-`, `01`, `1.`, `1.5`, `.5`, `1e5`, `1E+5`, `1e-05`, `1e`, `1e+`, `-1.5e3`, `2.`, `00`, `-a`,
	`""`, `"\u00e9\uD83D"`, `"\u00g0"`, `"\u12"`, `"\x"`, `"a\/b"`, "\"\x7f\xff\"", "\"\x1f\"", `"`, `"\`,
	`true`, `tru`, `truex`, `false`, `null`, `nul`, `[]`, `[1,]`, `[,1]`, `[1 2]`, `{"a":1,"b":[true,null]}`,
	`{"a" 1}`, `{"a":1 "b":2}`, `{1:2}`, `{"a":1}}`, ` [ 1 , { } ] `, "\t\n\r 1 \r\n", `1 2`, ``, ` `,
	strings.Repeat("[", maxJSONDepth) + strings.Repeat("]", maxJSONDepth),
	strings.Repeat("[", maxJSONDepth+1) + strings.Repeat("]", maxJSONDepth+1),
	strings.Repeat(`{"a":`, maxJSONDepth) + "1" + strings.Repeat("}", maxJSONDepth),
	strings.Repeat(`{"a":`, maxJSONDepth+1) + "1" + strings.Repeat("}", maxJSONDepth+1),
}

func TestValidJSONMatchesEncodingJSON(t *testing.T) {
	for _, c := range append(validJSONCases, parseObjectCases...) {
		if got, want := validJSON([]byte(c)), json.Valid([]byte(c)); got != want {
			t.Errorf("validJSON(%.40q) = %v, want %v", c, got, want)
		}
	}
}

func FuzzValidJSON(f *testing.F) {
	for _, c := range append(validJSONCases, parseObjectCases...) {
		if len(c) < 1000 { // the deep nests make mutation slow
			f.Add([]byte(c))
		}
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		if got, want := validJSON(in), json.Valid(in); got != want {
			t.Fatalf("validJSON(%q) = %v, want %v", in, got, want)
		}
	})
}

// readBody reads bodies shorter, equal to and longer than announced.
func TestReadBody(t *testing.T) {
	for _, tc := range []struct {
		body   string
		length int64
	}{{"", 0}, {"abc", 3}, {"abc", 10}, {"abcdef", 3}, {strings.Repeat("x", 5000), 100}, {"abc", -1}} {
		got, err := readBody(iotest.OneByteReader(strings.NewReader(tc.body)), tc.length, 1<<20)
		if err != nil || string(got) != tc.body {
			t.Errorf("length %d: %q %v, want %q", tc.length, got, err, tc.body)
		}
	}
	if _, err := readBody(iotest.TimeoutReader(strings.NewReader("abcdef")), 6, 1<<20); err == nil {
		t.Error("a read error was lost")
	}
}
