package main

import (
	"strings"
	"testing"
	"time"
)

func msSeries(v ...int) series {
	s := make(series, len(v))
	for i, x := range v {
		s[i] = time.Duration(x) * time.Millisecond
	}
	return s
}

func TestRoundOrder(t *testing.T) {
	// Every round holds each kind once; over numKinds rounds each kind
	// takes each position once, also for the negative (warm-up) rounds.
	for _, from := range []int{-3, 0, 7} {
		var pos [numKinds][numKinds]int
		for i := from; i < from+int(numKinds); i++ {
			o := roundOrder(i)
			var seen [numKinds]bool
			for j, k := range o {
				if k < 0 || k >= numKinds || seen[k] {
					t.Fatalf("roundOrder(%d) = %v: not a permutation of the kinds", i, o)
				}
				seen[k] = true
				pos[k][j]++
			}
		}
		for k := range pos {
			for j, n := range pos[k] {
				if n != 1 {
					t.Errorf("rounds %d..%d: kind %d at position %d %d times, want once", from, from+2, k, j, n)
				}
			}
		}
	}
}

func TestPoolSeries(t *testing.T) {
	var p poolSeries
	p.add(3*time.Millisecond, true)
	p.add(90*time.Millisecond, false)
	p.add(4*time.Millisecond, true)
	if len(p.all) != 3 || len(p.hits) != 2 || len(p.misses) != 1 || p.misses[0] != 90*time.Millisecond {
		t.Fatalf("poolSeries = %+v", p)
	}
	if got, want := p.hitText(), "2 of 3 creates took a warm-pool sandbox"; got != want {
		t.Errorf("hitText = %q, want %q", got, want)
	}
}

// TestTargetsAreHonest renders a report whose warm-pool create meets the
// 1.5x target and whose cold create misses it, and checks each row says so.
func TestTargetsAreHonest(t *testing.T) {
	r := &report{cfg: config{settle: 300 * time.Millisecond, warmup: 1}}
	for _, d := range []int{20, 21, 22} {
		r.createPool.add(time.Duration(d)*time.Millisecond, true)
	}
	r.createPool.add(200*time.Millisecond, false)
	r.createCold = msSeries(160, 170, 180, 190)
	r.createRunc = msSeries(100, 100, 110, 120)
	r.fcPool.add(30*time.Millisecond, true)
	r.fcCold = msSeries(190)
	r.fcRunc = msSeries(120)
	md := r.markdown()
	for _, want := range []string{
		"| create p50 (warm pool; 3 of 4 creates took a warm-pool sandbox) / `runc run` p50 | 21.00 ms | 100.00 ms | 0.21x | <= 1.5x | **met** |",
		"| create p50 (cold, skip_warm_pool) / `runc run` p50 | 170.00 ms | 100.00 ms | 1.70x | <= 1.5x | **NOT met** |",
		"| time to first command p50 (cold) / `runc run` + `runc exec` p50 | 190.00 ms | 120.00 ms | 1.58x | no target | |",
		"| ours, warm pool: the misses (made cold) | 1 | 200.00 |",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("report lacks %q", want)
		}
	}
	if t.Failed() {
		t.Log(md)
	}
}
