package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

// waitQuiet writes back dirty data (sync) and waits until the kernel has
// freed the network namespaces of what ran before (the runc loop's
// containers, an earlier system's sandboxes): the count of net_namespace
// objects in /proc/slabinfo unchanged for 2 s, or at most limit. Each
// side of the comparison then starts on a machine that is not still
// cleaning up after the other. It returns how long it waited and the
// count it settled at.
func waitQuiet(ctx context.Context, limit time.Duration) (time.Duration, int, error) {
	start := time.Now()
	unix.Sync()
	last, err := netnsObjects()
	if err != nil {
		return 0, 0, err
	}
	since := time.Now()
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	for time.Since(since) < 2*time.Second && time.Since(start) < limit {
		select {
		case <-ctx.Done():
			return time.Since(start), last, ctx.Err()
		case <-tick.C:
		}
		n, err := netnsObjects()
		if err != nil {
			return time.Since(start), last, err
		}
		if n != last {
			last, since = n, time.Now()
		}
	}
	return time.Since(start), last, nil
}

// netnsObjects is the active net_namespace objects in /proc/slabinfo.
func netnsObjects() (int, error) {
	b, err := os.ReadFile("/proc/slabinfo")
	if err != nil {
		return 0, fmt.Errorf("read slabinfo: %w", err)
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		f := bytes.Fields(sc.Bytes())
		if len(f) > 1 && string(f[0]) == "net_namespace" {
			return strconv.Atoi(string(f[1]))
		}
	}
	return 0, fmt.Errorf("no net_namespace line in /proc/slabinfo")
}
