package apiserver

import "time"

// ActiveConnectPortRelays is how many ConnectPort relay goroutines run.
func ActiveConnectPortRelays() int64 { return activeRelays.Load() }

// SetConnectPortIdle shortens ConnectPortIdleAfterEOF until the test ends.
func SetConnectPortIdle(t interface{ Cleanup(func()) }, d time.Duration) {
	old := connectPortIdle.Swap(int64(d))
	t.Cleanup(func() { connectPortIdle.Store(old) })
}
