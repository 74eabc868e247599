package proxy

import (
	"fmt"
	"reflect"
	"testing"
	"time"
)

type fakeClock struct{ t time.Time }

func (c *fakeClock) now() time.Time          { return c.t }
func (c *fakeClock) advance(d time.Duration) { c.t = c.t.Add(d) }

func TestConversationCache(t *testing.T) {
	tests := []struct {
		description string
		age         time.Duration
		want        LookupResult
	}{
		{"fresh", 0, Hit},
		{"just under ttl", 479 * time.Second, Hit},
		{"exactly ttl", 480 * time.Second, Hit},
		{"past ttl", 480*time.Second + time.Nanosecond, Stale},
	}
	for _, tc := range tests {
		t.Run(tc.description, func(t *testing.T) {
			clk := &fakeClock{t: time.Unix(1000, 0)}
			c := NewConversationCache(DefaultCacheTTL, 10, clk.now)
			params := []byte(`{"a":1}`)
			c.Put("conv", params)
			params[2] = 'X' // the cache keeps its own copy
			clk.advance(tc.age)
			got, res := c.Take("conv")
			if res != tc.want {
				t.Fatalf("Take = %v, want %v", res, tc.want)
			}
			if res == Hit && string(got) != `{"a":1}` {
				t.Errorf("Take returned %s", got)
			}
			if _, again := c.Take("conv"); again != Miss {
				t.Errorf("second Take = %v, want miss (single use)", again)
			}
		})
	}
}

func TestConversationCacheEvictAndBound(t *testing.T) {
	clk := &fakeClock{t: time.Unix(1000, 0)}
	c := NewConversationCache(10*time.Second, 3, clk.now)
	c.Put("a", []byte(`{}`))
	clk.advance(5 * time.Second)
	c.Put("b", []byte(`{}`))
	clk.advance(time.Second)
	c.Put("c", []byte(`{}`))
	clk.advance(5 * time.Second) // a is 11 s old: stale
	if n := c.EvictStale(); n != 1 || c.Len() != 2 {
		t.Fatalf("EvictStale = %d, Len = %d; want 1, 2", n, c.Len())
	}
	c.Put("d", []byte(`{}`))
	c.Put("e", []byte(`{}`)) // full: the oldest (b) goes
	var have []string
	for _, id := range []string{"b", "c", "d", "e"} {
		if _, r := c.Take(id); r == Hit {
			have = append(have, id)
		}
	}
	if !reflect.DeepEqual(have, []string{"c", "d", "e"}) {
		t.Errorf("after overflow the cache holds %v, want [c d e]", have)
	}
}

func TestConversationCacheConcurrent(t *testing.T) {
	c := NewConversationCache(time.Minute, 1000, time.Now)
	done := make(chan struct{})
	for g := 0; g < 8; g++ {
		go func() {
			defer func() { done <- struct{}{} }()
			for i := 0; i < 200; i++ {
				id := fmt.Sprint(g, "-", i%10)
				c.Put(id, []byte(`{}`))
				c.Take(id)
				c.EvictStale()
			}
		}()
	}
	for g := 0; g < 8; g++ {
		<-done
	}
	if c.Len() != 0 {
		t.Errorf("Len = %d after every Put was taken", c.Len())
	}
}

func TestConversationIDPopped(t *testing.T) {
	tests := []struct {
		description string
		body        string
		want        string
	}{
		{"string", `{"conversation_id":"abc","x":1}`, "abc"},
		{"number", `{"conversation_id":42}`, "42"},
		{"null", `{"conversation_id":null}`, ""},
		{"absent", `{"x":1}`, ""},
	}
	for _, tc := range tests {
		t.Run(tc.description, func(t *testing.T) {
			o, err := parseObject([]byte(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			if got := conversationID(o); got != tc.want {
				t.Errorf("conversationID = %q, want %q", got, tc.want)
			}
			if o.has("conversation_id") {
				t.Error("conversation_id not popped")
			}
		})
	}
}

func TestKVParamsTruthiness(t *testing.T) {
	for body, want := range map[string]bool{
		`{}`:                              false,
		`{"kv_transfer_params":null}`:     false,
		`{"kv_transfer_params":{}}`:       false,
		`{"kv_transfer_params":"x"}`:      false,
		`{"kv_transfer_params":{"a":1}}`:  true,
		`{"kv_transfer_params": {"a":1}}`: true,
	} {
		o, _ := parseObject([]byte(body))
		if _, got := kvParams(o); got != want {
			t.Errorf("kvParams(%s) = %v, want %v", body, got, want)
		}
	}
}

func TestObjectMarshal(t *testing.T) {
	o, err := parseObject([]byte(`{"b": [1, 2], "a\"q": "x\u00e9", "<k>": {"n": null}}`))
	if err != nil {
		t.Fatal(err)
	}
	got, err := o.marshal()
	if err != nil {
		t.Fatal(err)
	}
	if want := `{"\u003ck\u003e":{"n": null},"a\"q":"x\u00e9","b":[1, 2]}`; string(got) != want {
		t.Errorf("marshal = %s, want %s", got, want)
	}
	back, err := parseObject(got)
	if err != nil || len(back) != 3 || string(back["b"]) != "[1, 2]" {
		t.Errorf("round trip: %v %v", back, err)
	}
}
