package shim

import (
	"maps"
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"

	"github.com/gonixl/gonixl/nixl"
)

// Reference forms of the descriptor-id code as first written (one append
// per descriptor), for the optimised forms to be checked against.

func regionDescIDsRef(regions []Region, numBlocks int64, ids BlockIDs) []int32 {
	var out []int32
	if !regionsMapped(regions) {
		for ri := range regions {
			off := int64(ri) * numBlocks
			for _, g := range ids {
				for _, b := range g {
					out = append(out, int32(off+b))
				}
			}
		}
		return out
	}
	for gi, g := range ids {
		for ri, r := range regions {
			if r.Group != gi && r.Group != SharedGroup {
				continue
			}
			off := int64(ri) * numBlocks
			for _, b := range g {
				out = append(out, int32(off+b))
			}
		}
	}
	return out
}

func subBlockIDsRef(regions, nb int64, local, remote BlockIDs, remoteNumBlocks int64, n int) (lidx, ridx []int32) {
	k64 := int64(n)
	for i := int64(0); i < regions; i++ {
		for g := range remote {
			for k, rb := range remote[g] {
				b, j := local[g][k/n], int64(k%n)
				lidx = append(lidx, int32((i*k64+j)*nb+b))
				ridx = append(ridx, int32(i*remoteNumBlocks+rb))
			}
		}
	}
	return lidx, ridx
}

// captureAgent keeps the index arrays of the last transfer made.
type captureAgent struct {
	fzAgent
	li, ri []int32
}

func (a *captureAgent) MakeXfer(_ nixl.XferOp, _ nixl.DescList, li []int32, _ nixl.DescList, ri []int32, _ []byte) (nixl.Xfer, error) {
	a.li, a.ri = li, ri
	return nopXfer{}, nil
}

// The descriptor ids of regionDescIDs and subBlockXferMaker are those of
// their first, per-descriptor forms, for random layouts and block lists.
func TestDescIDsMatchReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(19, 1))
	for iter := 0; iter < 2000; iter++ {
		nb, rnb := int64(1+rng.IntN(300)), int64(1+rng.IntN(300))
		ngroups := 1 + rng.IntN(3)
		regions := make([]Region, 1+rng.IntN(12))
		mapped := rng.IntN(2) == 0
		for i := range regions {
			if mapped {
				regions[i].Group = rng.IntN(ngroups+1) - 1 // SharedGroup is -1
			}
		}
		ids := make(BlockIDs, ngroups)
		for g := range ids {
			ids[g] = make([]int64, rng.IntN(40))
			for k := range ids[g] {
				ids[g][k] = rng.Int64N(nb)
			}
		}
		if got, want := regionDescIDs(regions, nb, ids), regionDescIDsRef(regions, nb, ids); len(got)+len(want) > 0 && !reflect.DeepEqual(got, want) {
			t.Fatalf("regionDescIDs(%v, %d, %v) = %v, want %v", regions, nb, ids, got, want)
		}

		// Sub-blocks: n remote blocks per local block, the last local block
		// possibly part filled.
		n := 2 + rng.IntN(3)
		local, remote := make(BlockIDs, ngroups), make(BlockIDs, ngroups)
		for g := range local {
			local[g] = ids[g]
			if len(local[g]) == 0 {
				continue
			}
			remote[g] = make([]int64, (len(local[g])-1)*n+1+rng.IntN(n))
			for k := range remote[g] {
				remote[g][k] = rng.Int64N(rnb)
			}
		}
		a := &captureAgent{}
		w := &Worker{layout: &KVLayout{NumBlocks: nb, Regions: regions}, agent: a}
		if _, err := w.subBlockXferMaker(local, remote, rnb, n)(nil, nil, nil); err != nil {
			t.Fatal(err)
		}
		wl, wr := subBlockIDsRef(int64(len(regions)), nb, local, remote, rnb, n)
		if len(a.li)+len(wl) > 0 && (!reflect.DeepEqual(a.li, wl) || !reflect.DeepEqual(a.ri, wr)) {
			t.Fatalf("subBlockXferMaker(%v, %v, n=%d): %v / %v, want %v / %v", local, remote, n, a.li, a.ri, wl, wr)
		}
	}
}

// Expired, which skips its sweep while a lower bound of the deadlines is
// ahead, frees exactly what a full sweep frees, through random holds,
// extensions, raises, drops and clock steps (backwards too).
func TestLeasesExpiredMatchesFullSweep(t *testing.T) {
	rng := rand.New(rand.NewPCG(19, 2))
	clock := NewFakeClock(100)
	l := newLeases(clock.Now)
	ref := map[string]float64{}
	for step := 0; step < 20000; step++ {
		id := string(rune('a' + rng.IntN(40)))
		until := clock.Now() + rng.Float64()*20 - 2
		switch rng.IntN(7) {
		case 0:
			l.Hold(id, until)
			ref[id] = until
		case 1:
			l.Extend(id, until)
			if old, ok := ref[id]; ok && until > old {
				ref[id] = until
			}
		case 2:
			l.Raise(id, until)
			if old, ok := ref[id]; !ok || until > old {
				ref[id] = until
			}
		case 3:
			l.Drop(id)
			delete(ref, id)
		case 4:
			clock.Advance(rng.Float64()*3 - 0.5)
		default:
			var want []string
			for id, d := range ref {
				if clock.Now() >= d {
					want = append(want, id)
				}
			}
			slices.Sort(want)
			for _, id := range want {
				delete(ref, id)
			}
			if got := l.Expired(); !reflect.DeepEqual(got, want) {
				t.Fatalf("step %d: Expired() = %v, want %v", step, got, want)
			}
		}
		if !maps.Equal(l.until, ref) {
			t.Fatalf("step %d: leases %v, want %v", step, l.until, ref)
		}
	}
}
