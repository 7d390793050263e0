package main

import (
	"testing"
	"time"
)

func TestPercentile(t *testing.T) {
	var s series
	for i := 100; i >= 1; i-- { // unsorted on purpose
		s = append(s, time.Duration(i)*time.Millisecond)
	}
	for _, tc := range []struct {
		p    float64
		want time.Duration
	}{
		{0, 1 * time.Millisecond},
		{50, 50 * time.Millisecond},
		{95, 95 * time.Millisecond},
		{100, 100 * time.Millisecond},
	} {
		if got := s.percentile(tc.p); got != tc.want {
			t.Errorf("percentile(%g) = %v, want %v", tc.p, got, tc.want)
		}
	}
	if s[0] != 100*time.Millisecond {
		t.Errorf("percentile sorted the caller's slice")
	}
	if got := (series{3 * time.Second}).percentile(50); got != 3*time.Second {
		t.Errorf("percentile of one sample = %v, want 3s", got)
	}
	if got := s.mean(); got != 50500*time.Microsecond {
		t.Errorf("mean = %v, want 50.5ms", got)
	}
}

func TestMedianInt64(t *testing.T) {
	if got := medianInt64([]int64{9, 1, 5}); got != 5 {
		t.Errorf("median of 3 = %d, want 5", got)
	}
	if got := medianInt64([]int64{4, 1, 3, 2}); got != 2 {
		t.Errorf("median of 4 = %d, want 2 (lower middle)", got)
	}
}
