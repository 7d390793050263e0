package main

import (
	"fmt"
	"math"
	"slices"
	"time"
)

// series is a set of latency samples.
type series []time.Duration

// percentile returns the p-th percentile (0 < p <= 100) by the nearest-rank
// method: the smallest sample with at least p% of the samples at or below it.
func (s series) percentile(p float64) time.Duration {
	if len(s) == 0 {
		return 0
	}
	sorted := slices.Clone(s)
	slices.Sort(sorted)
	rank := int(math.Ceil(p / 100 * float64(len(sorted))))
	rank = max(1, min(rank, len(sorted)))
	return sorted[rank-1]
}

func (s series) min() time.Duration { return s.percentile(0) }

func (s series) max() time.Duration { return s.percentile(100) }

func (s series) mean() time.Duration {
	if len(s) == 0 {
		return 0
	}
	var sum time.Duration
	for _, d := range s {
		sum += d
	}
	return sum / time.Duration(len(s))
}

// ms formats d in milliseconds with two decimals.
func ms(d time.Duration) string {
	return fmt.Sprintf("%.2f", float64(d)/float64(time.Millisecond))
}

// medianInt64 returns the median of v (the lower middle for even lengths).
func medianInt64(v []int64) int64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	return s[(len(s)-1)/2]
}

// mib formats a byte count in MiB with two decimals.
func mib(b int64) string {
	return fmt.Sprintf("%.2f", float64(b)/(1<<20))
}

// poolSeries holds the latencies of default creates (the node may take a
// warm-pool sandbox), all of them and split by whether it did.
type poolSeries struct {
	all, hits, misses series
}

func (p *poolSeries) add(d time.Duration, hit bool) {
	p.all = append(p.all, d)
	if hit {
		p.hits = append(p.hits, d)
	} else {
		p.misses = append(p.misses, d)
	}
}

// hitText says how many of the creates took a warm-pool sandbox.
func (p *poolSeries) hitText() string {
	return fmt.Sprintf("%d of %d creates took a warm-pool sandbox", len(p.hits), len(p.all))
}
